"""Where the target's decoder layers live, and how they reach the compute device each pass.

  weight stores   HostArenaStore: the streamed layers packed into ONE host arena (pinned on CUDA), one
                  contiguous block per layer. DiskStore: offspec's packed store on disk (layers.bin with
                  4096-aligned blocks + manifest.json), read into pinned staging buffers: O_DIRECT where
                  the filesystem allows it, each block in pieces read by several threads at once.
  LayerStreamer   a LayerSource: a ring of n_slots device slots that the streamed layers rotate through,
                  prefetching ahead and wrapping into the next pass; permanently resident layers are
                  interleaved in layer order.
  open_target_layers   the factory: a Placement (from the memory plan, plan.py) -> resident layers and/or a
                  streamer.

Every stream, event and pinned-memory call goes through a transfer backend (transfer.py), so the CPU
backend runs this exact code in the tests; docs/streaming.md is the contract the ring protocol follows.

The ring protocol, for the n-th layer copy ever issued (n counts across passes; slot k = n % n_slots):
  loader thread    [disk: wait for the layer's read into staging (started one load earlier, each piece
                    once that staging buffer's gate completed); start the next layer's read likewise]
                   free[k].wait(copy_q)     WAR: compute has finished reading slot k's previous layer
                   copy host block -> slot k on copy_q
                   [disk: gate.record(copy_q): the staging buffer may be refilled once this completes]
                   [quantized: dequantize slot k into its dense buffer on copy_q, so it overlaps compute
                    as the copy does and the same two events guard it]
                   ready[k].record(copy_q)  RAW: compute may read slot k once this completes
                   publish "load n issued"
  consumer thread  wait (host) until load n is issued, so the wait below binds to *its* ready record
                   ready[k].wait(comp_q); yield the views of slot k; the consumer issues its kernels
                   ... the consumer asks for the next layer ...
                   free[k].record(comp_q)   after every kernel reading slot k was issued
                   post load n + n_slots    strictly after that record
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import threading
import time
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from tqdm import tqdm

from .config import ModelConfig, OffloadConfig
from .errors import BudgetError, CheckpointError, InputError, StoreError
from .layout import LayerLayout, LayerWeights, round_up
from .model import ResidentLayers
from .quant import QuantizedLayout, QuantizedResident, check_target_quant, dequantized, layer_weights, target_layout
from .transfer import (PAGE_BYTES, HostBuffer, TransferBackend, TransferEvent, format_bytes, make_backend,
                       raise_from_worker)

LayerTensorsFn = Callable[[int], dict[str, torch.Tensor]]   # layer index -> tensors keyed by LayerWeights fields
BlockLayout = Union[LayerLayout, QuantizedLayout]          # how a stored / moved layer block is laid out

MODES = ("none", "cpu", "disk")
RESIDENT_QUANTS = ("auto", "on", "off")   # a quantized target's resident layers held quantized: where more fit | always | never
BLOCK_ALIGN = 4096            # bytes; disk blocks start and end on this boundary (page cache, O_DIRECT)
N_STAGING = 2                 # disk staging buffers: one being read while the other is copied out
READS_IN_FLIGHT = 4           # a disk block is read in this many pieces at once, one thread each (queue depth)
STORE_FORMAT = "offspec-layer-store"
STORE_VERSION = 1
MANIFEST = "manifest.json"
LAYERS_BIN = "layers.bin"
PIN_CHUNK_BYTES = 1 << 30     # the host arena is pinned in pieces of about this size (whole layers each)


def layer_nbytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one packed decoder layer takes (on the device, in the arena; the disk block is padded to 4096)."""
    return LayerLayout.of(cfg, dtype).nbytes


def store_fingerprint(layout: BlockLayout, n_layers: int, source_id: str = "") -> str:
    """Identifies what a disk store holds: the model's layer shapes, dtype and quantization (the layout),
    its layer count, and source_id, whatever names the weights (e.g. Checkpoint.fingerprint()); two
    checkpoints of one architecture differ only there. Computed from prepare_disk_store's own arguments, so
    building a store needs no ModelConfig."""
    text = json.dumps({"dtype": str(layout.dtype), "layout": layout.describe(), "n_layers": n_layers,
                       "source": source_id}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _pack_layer(layer_tensors_fn: LayerTensorsFn, layer: int, layout: BlockLayout, block: torch.Tensor) -> None:
    """Layer `layer`'s tensors -> their places in `block` ((layout.nbytes,) uint8), cast to layout.dtype
    (or quantized, for a QuantizedLayout)."""
    tensors = layer_tensors_fn(layer)
    missing = [name for name, _, _ in layout.dense.entries if name not in tensors]
    if missing:
        raise CheckpointError(f"layer {layer}: missing tensors {', '.join(missing)}")
    try:
        layout.pack(tensors, block)
    except ValueError as err:   # a shape that does not match the config
        raise CheckpointError(f"layer {layer}: {err}") from err


@dataclass(frozen=True)
class StoreInfo:
    """Where the streamed layers live on the host, for reports."""
    kind: str          # "host arena" | "disk store"
    nbytes: int        # arena size, or layers.bin size
    pinned: bool       # copies start from pinned memory (arena, or the disk staging buffers)
    reason: str        # why not pinned ("" when pinned)
    path: str = ""     # disk store directory
    io: str = ""       # disk store: how layers.bin is read, e.g. "O_DIRECT, 4 reads in flight (≤ 22.3 MiB each)"


@dataclass
class Staged:
    """One layer's bytes on the host, ready to be copied into a slot."""
    block: torch.Tensor                # (layout.nbytes,) uint8 host memory
    pinned: bool                       # block is pinned: the copy may be asynchronous
    gate: Optional[TransferEvent]      # record on the copy queue after the copy (a staging buffer's reuse gate)
    read_s: float                      # seconds its read from disk took (0 for the arena)


# ---------------------------------------------------------------- host arena

class HostArenaStore:
    """The streamed layers packed into one host arena; layer i is one contiguous block, so moving it is one
    copy. Pinned (exactly sized) on CUDA, with a reported pageable fallback (transfer.HostBuffer).

    Blocks sit at a page-aligned stride so the arena can be pinned in ~1 GiB pieces of whole layers
    (docs/streaming.md §4: one huge registration can fail; no copy may span two registrations)."""

    def __init__(self, layout: BlockLayout, layers: Sequence[int], backend: TransferBackend,
                 host_budget: Optional[int] = None):
        self.layout = layout
        self._block_of = {layer: i for i, layer in enumerate(layers)}   # layer index -> block index
        self._stride = round_up(layout.nbytes, PAGE_BYTES)             # bytes from one block to the next
        nbytes = len(layers) * self._stride      # the memory plan has checked that the host can hold it
        layers_per_piece = max(1, PIN_CHUNK_BYTES // self._stride)
        self._arena = backend.host_buffer(nbytes, host_budget, chunk_bytes=layers_per_piece * self._stride)

    @classmethod
    def build(cls, layer_tensors_fn: LayerTensorsFn, layout: BlockLayout, layers: Sequence[int],
              backend: TransferBackend, host_budget: Optional[int] = None, progress: bool = True) -> "HostArenaStore":
        """The arena, each layer packed from its tensors."""
        return cls.filled(lambda layer, block: _pack_layer(layer_tensors_fn, layer, layout, block), layout, layers,
                          backend, host_budget, progress)

    @classmethod
    def filled(cls, fill: Callable[[int, torch.Tensor], None], layout: BlockLayout, layers: Sequence[int],
               backend: TransferBackend, host_budget: Optional[int] = None, progress: bool = True) -> "HostArenaStore":
        """The arena, fill(layer, block) writing each layer's block ((layout.nbytes,) uint8)."""
        store = cls(layout, layers, backend, host_budget)
        with contextlib.ExitStack() as on_error:
            on_error.callback(store.close)
            for layer in tqdm(layers, desc="packing layers into host memory", unit="layer", disable=not progress):
                fill(layer, store.block(layer))
            on_error.pop_all()
        return store

    def block(self, layer: int) -> torch.Tensor:
        """(layout.nbytes,) uint8 view of layer `layer`'s block in the arena."""
        start = self._block_of[layer] * self._stride
        return self._arena.tensor[start: start + self.layout.nbytes]

    def acquire(self, layer: int, next_layer: Optional[int] = None) -> Staged:
        # The arena is never rewritten, so its blocks need no reuse gate (and nothing is read ahead).
        return Staged(self.block(layer), self._arena.pinned, gate=None, read_s=0.0)

    def info(self) -> StoreInfo:
        return StoreInfo("host arena", self._arena.nbytes, self._arena.pinned, self._arena.reason)

    def close(self) -> None:
        self._arena.close()


# ---------------------------------------------------------------- disk store

def disk_store_exists(directory: str) -> bool:
    """A store exists once its manifest does: prepare_disk_store writes the manifest last."""
    return os.path.isfile(os.path.join(directory, MANIFEST))


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_disk_store(layer_tensors_fn: LayerTensorsFn, n_layers: int, layout: BlockLayout, directory: str,
                       progress: bool = True, *, source_id: str = "") -> None:
    """Pack every layer into `directory`/layers.bin (block i at offset i * block_nbytes, block_nbytes =
    layout.nbytes rounded up to 4096) and describe it in manifest.json. A QuantizedLayout quantizes each
    layer here, once: the store is then cached by (weights, dtype, quantization).

    Crash safety: both files are written under .tmp names, fsynced, then renamed; manifest.json is renamed
    last and is the commit point, so an interrupted build leaves no store (and no temp files when it was
    an exception). An existing store in `directory` is uncommitted first, then rebuilt."""
    os.makedirs(directory, exist_ok=True)
    manifest_path, bin_path = os.path.join(directory, MANIFEST), os.path.join(directory, LAYERS_BIN)
    tmp_manifest, tmp_bin = manifest_path + ".tmp", bin_path + ".tmp"
    block_nbytes = round_up(layout.nbytes, BLOCK_ALIGN)
    # Say so before writing, not after an hour of packing: a 70B store is 140 GB.
    reusable = sum(os.path.getsize(p) for p in (bin_path, tmp_bin) if os.path.exists(p))
    free = shutil.disk_usage(directory).free + reusable
    if n_layers * block_nbytes > free:
        raise StoreError(f"the packed store needs {format_bytes(n_layers * block_nbytes)} at {directory} but its "
                         f"drive has {format_bytes(free)} free: free space or choose --store-dir on another drive")
    if os.path.exists(manifest_path):
        os.unlink(manifest_path)
        _fsync_dir(directory)
    block = torch.zeros(block_nbytes, dtype=torch.uint8)   # reused for every layer; the padding stays zero
    block_bytes = memoryview(block.numpy())
    entries = []
    try:
        what = f"quantizing layers ({layout.quant}) into" if layout.quant != "none" else "packing layers into"
        with open(tmp_bin, "wb") as f, tqdm(total=n_layers, desc=f"{what} {directory}",
                                            unit="layer", disable=not progress) as bar:
            for layer in range(n_layers):
                _pack_layer(layer_tensors_fn, layer, layout, block[: layout.nbytes])
                entries.append({"offset": layer * block_nbytes, "nbytes": block_nbytes,
                                "crc32": zlib.crc32(block_bytes)})
                f.write(block_bytes)
                bar.update(1)
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)   # the written pages need not stay cached
        manifest = {
            "format": STORE_FORMAT,
            "version": STORE_VERSION,
            "fingerprint": store_fingerprint(layout, n_layers, source_id),
            "source_id": source_id,
            "dtype": str(layout.dtype).removeprefix("torch."),
            "quant": layout.quant,
            "layer_nbytes": layout.nbytes,
            "layout": layout.describe(),
            "n_layers": n_layers,
            "block_nbytes": block_nbytes,
            "file_size": n_layers * block_nbytes,
            "layers": entries,
        }
        with open(tmp_manifest, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_manifest, manifest_path)     # the commit point
        _fsync_dir(directory)
    finally:
        for path in (tmp_bin, tmp_manifest):        # present only when the build did not finish
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def drop_page_cache(*paths: str) -> None:
    """Evict these files from the page cache, so their next reads come from the drive (cold-read benchmarks,
    doctor). Mapped or dirty pages stay: close memory maps and fsync first."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(path: str, buffers: Sequence[memoryview], *, direct: bool, drop_behind: bool) -> int:
    """Read the whole file front to back, one read at a time (like dd), each read filling the next of `buffers`
    in turn: the baseline a store's reader is measured against (bench_stream, doctor). O_DIRECT needs
    page-aligned buffers (mmaps) of whole BLOCK_ALIGN blocks and a file of whole blocks (a store is); a
    filesystem that refuses it raises OSError (EINVAL). drop_behind: drop each range from the page cache
    once read. -> bytes read."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        offset, i = 0, 0
        while n := os.preadv(fd, [buffers[i % len(buffers)]], offset):
            if drop_behind:
                os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
            offset, i = offset + n, i + 1
        return offset
    finally:
        os.close(fd)


class DiskStore:
    """Reads layers of a packed store straight into (pinned) staging buffers with os.preadv.

    Opening validates the manifest against the requested model and layout and the file size against the
    manifest; each layer's crc32 is checked the first time this store reads it (checking every pass would
    cost a full extra read of the model per pass).

    How layers.bin is read (info().io says which ran):
      O_DIRECT   with drop_page_cache, when the filesystem takes it (probed once at open): the drive
                 writes into the staging buffer, with no page-cache copy (CPU time compute needs) and
                 nothing cached. docs/streaming.md §5's rules hold by construction: staging buffers are page-aligned
                 mmaps, block offsets and piece lengths are multiples of BLOCK_ALIGN.
      buffered   otherwise (or direct_io=False): plain preadv; with drop_page_cache each piece is dropped
                 from the page cache right after it is read, so either way host memory stays bounded by
                 the ring, not the model. drop_page_cache=False keeps the file cached (a model that fits
                 in RAM is then read from the drive once).
    Each block is split into reads_in_flight pieces of whole BLOCK_ALIGN blocks, all read at once (one
    reader thread each; preadv releases the GIL), so the drive has several requests queued. All at once
    rather than a queue of smaller pieces: the next block's reads start only when this one's are done, so
    a queue would end every block with fewer reads in flight. (On the 2-core VM's virtual drive where this
    was built, 1 to 8 reads in flight and queued 16 MiB pieces read at the same rate into the same buffers:
    the queue depth is for faster drives.)

    On a CPU device the layer is still read into a staging buffer and then copied into the slot (one
    extra host memcpy instead of reading into the slot directly), so the CUDA path's staging gates are what
    the tests exercise."""

    def __init__(self, directory: str, layout: BlockLayout, n_layers: int, backend: TransferBackend, *,
                 source_id: str = "", drop_page_cache: bool = True, n_staging: int = N_STAGING,
                 direct_io: bool = True, reads_in_flight: int = READS_IN_FLIGHT):
        if reads_in_flight < 1:
            raise ValueError(f"reads_in_flight={reads_in_flight}: at least 1")
        self.directory = directory
        self.layout = layout
        manifest = _read_manifest(directory)
        self.block_nbytes, self._offsets, self._crc32 = _check_manifest(manifest, directory, layout, n_layers,
                                                                        source_id)
        self._path = os.path.join(directory, LAYERS_BIN)
        try:
            size = os.stat(self._path).st_size
        except FileNotFoundError:
            raise StoreError(f"{self._path} is missing: delete {directory} to rebuild the store") from None
        if size != manifest["file_size"]:
            raise StoreError(f"{self._path} is {size} bytes but its manifest says {manifest['file_size']}: "
                             f"the store is truncated or was modified; delete {directory} to rebuild it")
        self.file_size = size
        self._drop_page_cache = drop_page_cache
        self._verified: set[int] = set()          # layers whose crc32 this process has checked
        # (start, end) byte ranges of a block, read at once; whole BLOCK_ALIGN blocks each, e.g. the demo
        # target's block of 22851 blocks (89.3 MiB) in 4: three pieces of 5713 blocks and one of 5712.
        n_blocks = self.block_nbytes // BLOCK_ALIGN
        piece_nbytes = -(-n_blocks // reads_in_flight) * BLOCK_ALIGN      # ceil(n_blocks / reads_in_flight) blocks
        self._pieces = [(start, min(start + piece_nbytes, self.block_nbytes))
                        for start in range(0, self.block_nbytes, piece_nbytes)]
        self._pool: Optional[ThreadPoolExecutor] = None
        self._ahead: Optional[tuple[int, list[Future]]] = None   # (layer, its pieces): the read started ahead
        self._stages: list[HostBuffer] = []
        self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        self._direct = False                      # self._fd was opened with O_DIRECT
        with contextlib.ExitStack() as on_error:
            on_error.callback(self.close)
            for _ in range(n_staging):
                self._stages.append(backend.host_buffer(self.block_nbytes))
            if not direct_io:
                how = "buffered (--disk-io buffered)"
            elif not drop_page_cache:   # O_DIRECT would bypass the page cache the caller wants to keep
                how = "buffered: page cache kept (drop_page_cache=False)"
            else:
                how = self._try_direct()
            self._pool = ThreadPoolExecutor(len(self._pieces), thread_name_prefix="offspec-reader")
            on_error.pop_all()
        if not self._direct and drop_page_cache:
            how += "; page cache dropped after each read"
        n = len(self._pieces)
        self.io = f"{how}, {n} read{'s' * (n > 1)} in flight (≤ {format_bytes(piece_nbytes)} each)"
        self._gates = [backend.new_event() for _ in self._stages]   # gate[j]: the copy out of stage j is done
        self._next_stage = 0

    def _try_direct(self) -> str:
        """Switch self._fd to an O_DIRECT descriptor if the filesystem takes one; -> how reads are done.

        A filesystem refuses O_DIRECT with EINVAL (or EOPNOTSUPP) at open, or accepts the open and refuses
        the first read (e.g. a block size above BLOCK_ALIGN): one aligned read into a staging buffer finds out."""
        if not hasattr(os, "O_DIRECT"):
            return "buffered: no O_DIRECT on this platform"
        refused = (errno.EINVAL, errno.EOPNOTSUPP)
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as err:
            if err.errno not in refused:
                raise StoreError(f"cannot open {self._path}: {err.strerror}") from err
            return f"buffered: O_DIRECT refused by the filesystem ({errno.errorcode[err.errno]})"
        try:
            stage = self._stages[0].tensor
            assert stage.data_ptr() % BLOCK_ALIGN == 0    # page-aligned mmap
            os.preadv(fd, [memoryview(stage.numpy())[:BLOCK_ALIGN]], 0)
        except OSError as err:
            os.close(fd)
            if err.errno not in refused:
                raise StoreError(f"reading {self._path} failed: {err.strerror}") from err
            return f"buffered: O_DIRECT reads refused by the filesystem ({errno.errorcode[err.errno]})"
        os.close(self._fd)
        self._fd, self._direct = fd, True
        return "O_DIRECT"

    def _start(self, layer: int, out: torch.Tensor, gate: Optional[TransferEvent] = None) -> list[Future]:
        """Start reading layer `layer`'s padded block into out[:block_nbytes] ((≥ block_nbytes,) uint8,
        page-aligned), one piece per reader thread; with a gate, each piece first waits for it."""
        offset = self._offsets[layer]
        # O_DIRECT's rules (docs/streaming.md §5); _check_manifest checked the offsets, the pieces are whole blocks.
        assert offset % BLOCK_ALIGN == 0 and out.data_ptr() % BLOCK_ALIGN == 0, (offset, out.data_ptr())
        assert out.numel() >= self.block_nbytes, (out.numel(), self.block_nbytes)
        view = memoryview(out.numpy())
        return [self._pool.submit(self._read_piece, layer, view[start:end], offset + start, gate)
                for start, end in self._pieces]

    def _finish(self, layer: int, out: torch.Tensor, pieces: list[Future]) -> float:
        """Wait for a read _start()ed into `out`, check the layer's crc32 on its first read; -> seconds the
        read took (first piece's start to last piece's end). When this returns or raises, no read into
        `out` is still running."""
        wait(pieces)                                  # all of them, even after one failed
        spans = [piece.result() for piece in pieces]  # re-raises the first failure (in block order) here
        if layer not in self._verified:
            crc = zlib.crc32(memoryview(out.numpy())[: self.block_nbytes])
            if crc != self._crc32[layer]:
                raise StoreError(f"layer {layer} of the store at {self.directory} fails its checksum "
                                 f"(crc32 {crc:08x}, manifest {self._crc32[layer]:08x}): the file is corrupt; "
                                 f"delete {self.directory} to rebuild the store")
            self._verified.add(layer)
        return max(end for _, end in spans) - min(start for start, _ in spans)

    def _read_piece(self, layer: int, out: memoryview, offset: int,
                    gate: Optional[TransferEvent]) -> tuple[float, float]:
        """out <- layers.bin[offset : offset + len(out)], on a reader thread; -> (start, end) perf_counter()."""
        if gate is not None:
            gate.synchronize()    # host-side WAR (docs/streaming.md §2): the copy out of this buffer has completed
        start, got, n = time.perf_counter(), 0, len(out)
        try:
            while got < n:
                count = os.preadv(self._fd, [out[got:]], offset + got)
                # End of file. With O_DIRECT a read short of a whole block only happens there (and a next
                # read from that unaligned offset would be refused rather than return 0).
                if count == 0 or (self._direct and count % BLOCK_ALIGN):
                    raise StoreError(f"{self._path} ends inside layer {layer}: "
                                     f"delete {self.directory} to rebuild the store")
                got += count
            if self._drop_page_cache and not self._direct:
                os.posix_fadvise(self._fd, offset, n, os.POSIX_FADV_DONTNEED)
        except OSError as err:
            raise StoreError(f"reading layer {layer} from {self._path} failed: {err.strerror or repr(err)}") from err
        return start, time.perf_counter()

    def read_layer(self, layer: int) -> torch.Tensor:
        """A fresh (layout.nbytes,) uint8 host tensor holding the layer (start-up, for resident layers), read
        the same way as streamed layers, so into page-aligned memory (torch.empty aligns to 64 bytes only)."""
        buffer = torch.frombuffer(HostBuffer.map(self.block_nbytes), dtype=torch.uint8)   # keeps the mapping
        self._finish(layer, buffer, self._start(layer, buffer))
        return buffer[: self.layout.nbytes]

    def acquire(self, layer: int, next_layer: Optional[int] = None) -> Staged:
        """The layer's bytes in the next staging buffer (loader thread only).

        Reads run one layer ahead: with next_layer, its read into the following staging buffer starts
        before this returns (each piece once that buffer's gate completes), so the drive keeps reading while
        the loader issues this layer's copy and waits for the GIL and the consumer computes; acquire(
        next_layer) then only waits for what is left. O_DIRECT has no kernel read-ahead to do this for it."""
        j = self._next_stage
        self._next_stage = (j + 1) % len(self._stages)
        stage = self._stages[j]
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] != layer:
            wait(ahead[1])     # read ahead for another layer (not how the streamer asks): unused, re-read
            ahead = None
        if ahead is None:
            ahead = (layer, self._start(layer, stage.tensor, self._gates[j]))
        read_s = self._finish(layer, stage.tensor, ahead[1])
        if next_layer is not None:
            k = self._next_stage
            self._ahead = (next_layer, self._start(next_layer, self._stages[k].tensor, self._gates[k]))
        return Staged(stage.tensor[: self.layout.nbytes], stage.pinned, gate=self._gates[j], read_s=read_s)

    def info(self) -> StoreInfo:
        stage = self._stages[0]
        return StoreInfo("disk store", self.file_size, stage.pinned, stage.reason, path=self.directory, io=self.io)

    def close(self) -> None:
        """Stop the reader threads (after the reads in flight, if any), then unpin and close the file."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._ahead = None, None
        for stage in self._stages:
            stage.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise StoreError(f"no offspec store at {directory} ({MANIFEST} is missing)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise StoreError(f"{path} is corrupt ({err}); delete {directory} to rebuild the store") from err
    if not isinstance(manifest, dict) or manifest.get("format") != STORE_FORMAT:
        raise StoreError(f"{path} is not an offspec layer store manifest")
    if manifest.get("version") != STORE_VERSION:
        raise StoreError(f"the store at {directory} has format version {manifest.get('version')}, this offspec "
                         f"reads {STORE_VERSION}; delete {directory} to rebuild it")
    return manifest


def _check_manifest(manifest: dict, directory: str, layout: BlockLayout, n_layers: int,
                    source_id: str) -> tuple[int, list[int], list[int]]:
    """-> (block_nbytes, per-layer offsets, per-layer crc32), or StoreError saying what does not match."""
    rebuild = f"delete {directory} to rebuild the store"
    try:
        if manifest["source_id"] != source_id:
            raise StoreError(f"the store at {directory} was built from other weights "
                             f"({manifest['source_id']!r}, expected {source_id!r}): {rebuild}")
        dtype = str(layout.dtype).removeprefix("torch.")
        if manifest["dtype"] != dtype:
            raise StoreError(f"the store at {directory} holds {manifest['dtype']} weights, {dtype} was asked: {rebuild}")
        quant = manifest.get("quant", "none")      # stores from before quantized layers hold dense ones
        if quant != layout.quant:
            raise StoreError(f"the store at {directory} holds {'unquantized' if quant == 'none' else quant} layers, "
                             f"--target-quant {layout.quant} was asked: {rebuild}, or give another --store-dir")
        if manifest["layout"] != layout.describe() or manifest["layer_nbytes"] != layout.nbytes:
            raise StoreError(f"the store at {directory} has a different layer layout: {rebuild}")
        if manifest["n_layers"] != n_layers or len(manifest["layers"]) != n_layers:
            raise StoreError(f"the store at {directory} has {manifest['n_layers']} layers, the model {n_layers}: {rebuild}")
        if manifest["fingerprint"] != store_fingerprint(layout, n_layers, source_id):
            raise StoreError(f"{directory}/{MANIFEST} does not match its own fingerprint: {rebuild}")
        block_nbytes = int(manifest["block_nbytes"])
        offsets = [int(entry["offset"]) for entry in manifest["layers"]]
        crcs = [int(entry["crc32"]) for entry in manifest["layers"]]
        lengths = [int(entry["nbytes"]) for entry in manifest["layers"]]
        file_size = int(manifest["file_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise StoreError(f"{directory}/{MANIFEST} is incomplete ({err!r}): {rebuild}") from err
    if block_nbytes != round_up(layout.nbytes, BLOCK_ALIGN) or any(n != block_nbytes for n in lengths):
        raise StoreError(f"{directory}/{MANIFEST} has wrong block sizes: {rebuild}")
    if any(off % BLOCK_ALIGN or off + block_nbytes > file_size for off in offsets):
        raise StoreError(f"{directory}/{MANIFEST} has misaligned or out-of-file layer offsets: {rebuild}")
    return block_nbytes, offsets, crcs


# ---------------------------------------------------------------- streamer

@dataclass
class StreamStats:
    """Streaming counters. Copy and wait times are read from timing events once per pass, and only for
    work that has completed by then, so a pass's last copies may be counted in the next snapshot."""
    passes: int = 0            # pass_layers() iterations run to their end
    layers: int = 0            # layer copies counted in bytes and transfer_s
    bytes: int = 0             # bytes those copies moved host -> device
    transfer_s: float = 0.0    # seconds those copies took on the copy queue (device-timed on CUDA)
    wait_s: float = 0.0        # seconds compute stood still waiting for a layer (device-timed on CUDA)
    read_s: float = 0.0        # disk: seconds the layers' reads from layers.bin took (host clock)
    dequant_s: float = 0.0     # quantized layers: seconds their dequantization took on the copy queue (device-timed)
    prefetched_layers: int = 0   # layers already in their slots when their pass began: copied while the
    prefetched_bytes: int = 0    # consumer was busy elsewhere (drafting), the wrap-around prefetch at work

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


WeightStore = Union[HostArenaStore, DiskStore]


class LayerStreamer:
    """A LayerSource streaming the non-resident layers through a ring of `n_slots` device slots.

    The protocol is in the module docstring. Threads: the consumer's thread records/waits events and posts
    load numbers; one loader thread takes them in order, gets each layer's host bytes from the store (disk:
    reads them) and issues its copy. Load n always carries streamed layer n % n_streamed into slot
    n % n_slots, with n counted across passes: a per-pass counter would break the wrap-around into the next
    pass whenever n_streamed % n_slots != 0 (docs/streaming.md, review #3). So when a pass ends, the first layers
    of the next pass are already being copied while the draft works.

    A yielded LayerWeights is a set of views into a slot: valid only until the consumer asks for the next
    layer (docs/streaming.md, review #4: keep nothing derived from it, e.g. a cached w.T).

    A store of quantized layers (QuantizedLayout): slot k receives the quantized block, and the copy queue
    dequantizes it into slot k's dense buffer, which is what the consumer reads; ready[k] / free[k] cover
    both, so the protocol is unchanged and dequantization overlaps compute like the copy.

    overlap=False (debug): no prefetch, and compute is finished before the next copy starts.
    The streamer owns `store` and `backend`: close() stops the loader and closes both."""

    def __init__(self, store: WeightStore, backend: TransferBackend, n_layers: int,
                 resident: dict[int, Union[LayerWeights, QuantizedResident]], n_slots: int, overlap: bool = True):
        if n_slots < (2 if overlap else 1):
            raise ValueError(f"n_slots={n_slots}: streaming needs at least 2 slots (1 only with overlap off)")
        self.store, self.backend = store, backend
        self.layout: LayerLayout = store.layout
        self.n_layers, self.n_slots, self.overlap = n_layers, n_slots, overlap
        self.resident = dict(resident)       # layer index -> weights kept on the device (dense, or held quantized)
        self.streamed = [i for i in range(n_layers) if i not in self.resident]   # streamed layers, in order
        if not self.streamed:
            raise ValueError("nothing to stream: every layer is resident (use ResidentLayers)")

        # Allocated once, never freed or reallocated (docs/streaming.md §3), so no record_stream is needed.
        self._slots = [backend.device_buffer(self.layout.nbytes) for _ in range(n_slots)]   # each (nbytes,) uint8
        self.quantized = isinstance(self.layout, QuantizedLayout)
        # What the consumer reads: the slot itself, or the dense layer its quantized block dequantizes into.
        self._dense = ([backend.device_buffer(self.layout.dense.nbytes) for _ in range(n_slots)] if self.quantized
                       else self._slots)                                                    # each (dense nbytes,) uint8
        self._views = [self.layout.dense.views(dense) for dense in self._dense]
        self._ready = [backend.new_event() for _ in range(n_slots)]   # copy into slot k done (RAW)
        self._free = [backend.new_event() for _ in range(n_slots)]    # compute done reading slot k (WAR)
        backend.synchronize()

        self._ahead = n_slots if overlap else 1   # loads posted beyond the released ones
        self._posted = 0         # loads posted to the loader (consumer thread only)
        self._released = 0       # loads whose slot the consumer has handed back (consumer thread only)
        self._in_pass = False    # a pass_layers() generator is running

        self._cv = threading.Condition()   # guards the fields below, shared with the loader thread
        self._requests: deque[int] = deque()   # load numbers posted, not yet taken by the loader
        self._issued = 0                       # loads whose copy and ready record the loader has issued
        self._loader_error: Optional[BaseException] = None
        self._closed = False

        self._lock = threading.Lock()          # guards the timing and stats fields below
        self._stats = StreamStats()
        self._timing_pool: list[TransferEvent] = []     # completed timing events, ready for reuse
        self._pending_copies: list[tuple[TransferEvent, TransferEvent, int]] = []   # (start, end, nbytes)
        self._pending_dequants: list[tuple[TransferEvent, TransferEvent]] = []      # (start, end)
        self._pending_waits: list[tuple[TransferEvent, TransferEvent]] = []         # (start, end)

        # daemon: a crash elsewhere never hangs interpreter exit on this thread
        self._loader = threading.Thread(target=self._loader_main, name="offspec-loader", daemon=True)
        self._loader.start()
        self._post_loads()   # the first pass starts copying now

    # ---- mapping of load numbers (overridden in tests to reproduce the wrap-around bug)
    def _layer_for(self, n: int) -> int:
        return self.streamed[n % len(self.streamed)]

    def _slot_for(self, n: int) -> int:
        return n % self.n_slots

    # ---- consumer side
    def pass_layers(self) -> Iterator[tuple[int, LayerWeights]]:
        if self._closed:
            raise RuntimeError("LayerStreamer is closed")
        if self._in_pass:
            raise RuntimeError("pass_layers() is already running: one pass at a time")
        self._in_pass = True
        held: Optional[int] = None                  # load the consumer is reading now
        try:
            comp_q = self.backend.compute_queue()   # resolved on the consumer's thread
            self._finish_abandoned_pass(comp_q)
            self._count_prefetched()
            for layer in range(self.n_layers):
                if layer in self.resident:
                    yield layer, layer_weights(self.resident[layer])   # a held quantized layer: dequantized now
                    continue
                n = self._released
                assert self._layer_for(n) == layer, (n, layer)
                k = self._take(n, comp_q)
                held = n
                yield layer, self._views[k]
                held = None
                self._release(n, comp_q)
            with self._lock:
                self._stats.passes += 1
            self._harvest()
        finally:
            if held is not None:   # the consumer left mid-pass (exception, break): its kernels are issued
                self._release(held, comp_q)
            self._in_pass = False

    def _take(self, n: int, comp_q) -> int:
        """Make compute wait until load n is in its slot; -> the slot."""
        k = self._slot_for(n)
        stall_start, stall_end = self._timing_event(), self._timing_event()
        stall_start.record(comp_q)
        self._wait_issued(n)            # host: the ready record below must be load n's (it binds at call time)
        self._ready[k].wait(comp_q)     # RAW
        stall_end.record(comp_q)
        with self._lock:
            self._pending_waits.append((stall_start, stall_end))
        return k

    def _release(self, n: int, comp_q) -> None:
        """Hand slot k back: after the consumer's last kernel on it, and before any refill is posted."""
        k = self._slot_for(n)
        self._free[k].record(comp_q)    # WAR
        if not self.overlap:
            self._free[k].synchronize()     # debug: the next copy starts only once compute is done
        self._released = n + 1
        self._post_loads()

    def _post_loads(self) -> None:
        with self._cv:
            while self._posted < self._released + self._ahead:
                self._requests.append(self._posted)
                self._posted += 1
            self._cv.notify_all()

    def _count_prefetched(self) -> None:
        """At the start of a pass: how many of its loads have already completed (query() never blocks).
        Load n's ready record is the latest one on its slot until the consumer releases load n, so a
        completed ready event of an issued load means that load is done."""
        first = self._released
        with self._cv:
            issued = min(self._issued, first + len(self.streamed))
        done = sum(1 for n in range(first, issued) if self._ready[self._slot_for(n)].query())
        with self._lock:
            self._stats.prefetched_layers += done
            self._stats.prefetched_bytes += done * self.layout.nbytes

    def _wait_issued(self, n: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._issued > n or self._loader_error is not None or self._closed)
            if self._issued > n:
                return
            if self._loader_error is not None:
                raise_from_worker(self._loader_error, "layer loader thread")
            raise RuntimeError("LayerStreamer closed while a pass was waiting for a layer")

    def _finish_abandoned_pass(self, comp_q) -> None:
        """A consumer that left a pass early leaves that pass's loads in the ring; take them out in order
        (waiting for each, computing nothing) so this pass starts at its first layer."""
        while self._released % len(self.streamed):
            n = self._released
            self._take(n, comp_q)
            self._release(n, comp_q)

    # ---- loader side
    def _loader_main(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._requests or self._closed)
                    if self._closed:
                        return
                    n = self._requests.popleft()
                self._load(n)
                with self._cv:
                    self._issued = n + 1
                    self._cv.notify_all()
        except BaseException as err:   # handed to the consumer in _wait_issued; never swallowed
            with self._cv:
                if not self._closed:
                    self._loader_error = err
                self._cv.notify_all()

    def _load(self, n: int) -> None:
        layer, k = self._layer_for(n), self._slot_for(n)
        staged = self.store.acquire(layer, next_layer=self._layer_for(n + 1))   # disk: waits for its read
        copy_q = self.backend.copy_queue
        copy_start, copy_end = self._timing_event(), self._timing_event()
        self._free[k].wait(copy_q)             # WAR: slot k's previous layer has been read
        copy_start.record(copy_q)
        self.backend.copy_async(self._slots[k], staged.block, src_pinned=staged.pinned)
        copy_end.record(copy_q)
        if staged.gate is not None:
            staged.gate.record(copy_q)         # the staging buffer may be refilled once the copy is done
        if self.quantized:
            dequant_start, dequant_end = self._timing_event(), self._timing_event()
            dequant_start.record(copy_q)
            self.backend.on_copy_queue(lambda block=self._slots[k], dense=self._dense[k]:
                                       self.layout.dequantize(block, dense))
            dequant_end.record(copy_q)
        self._ready[k].record(copy_q)          # RAW: slot k holds `layer` once this completes
        with self._lock:
            self._pending_copies.append((copy_start, copy_end, staged.block.numel()))
            if self.quantized:
                self._pending_dequants.append((dequant_start, dequant_end))
            self._stats.read_s += staged.read_s

    # ---- timing
    def _timing_event(self) -> TransferEvent:
        with self._lock:
            if self._timing_pool:
                return self._timing_pool.pop()
        return self.backend.new_event(timing=True)

    def _harvest(self) -> None:
        """Count the timed copies, dequantizations and stalls that have completed; query() never blocks."""
        with self._lock:
            copies, self._pending_copies = self._settle(self._pending_copies)
            dequants, self._pending_dequants = self._settle(self._pending_dequants)
            waits, self._pending_waits = self._settle(self._pending_waits)
            for seconds, nbytes in copies:
                self._stats.transfer_s += seconds
                self._stats.bytes += nbytes
                self._stats.layers += 1
            for (seconds,) in dequants:
                self._stats.dequant_s += seconds
            for (seconds,) in waits:
                self._stats.wait_s += seconds

    def _settle(self, pending: list) -> tuple[list, list]:
        """Timed (start, end, *extra) entries -> ([(seconds, *extra) of those completed], [those still running]);
        a completed pair of events goes back to the pool. The caller holds the lock."""
        done, running = [], []
        for start, end, *extra in pending:
            if end.query():
                done.append((start.elapsed_s(end), *extra))
                self._timing_pool += (start, end)
            else:
                running.append((start, end, *extra))
        return done, running

    def stats(self) -> StreamStats:
        """A snapshot of the counters."""
        self._harvest()
        with self._lock:
            return dataclasses.replace(self._stats)

    def reset_stats(self) -> None:
        self._harvest()
        with self._lock:
            self._stats = StreamStats()

    # ---- shutdown
    def close(self) -> None:
        """Stop the loader, then the backend (CUDA: copy_s drained), then the store (unpin, close files)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._loader.join(timeout=60)
        if self._loader.is_alive():
            raise RuntimeError("layer loader thread did not stop within 60 s")
        self.backend.close()
        self.store.close()

    def __enter__(self) -> "LayerStreamer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- placement and factory

@dataclass(frozen=True)
class Placement:
    """Which target layers stay on the compute device and how many ring slots the rest stream through."""
    mode: str                   # "none" | "cpu" | "disk": where the streamed layers live
    n_layers: int               # decoder layers of the target
    layer_nbytes: int           # bytes of one packed (dense) layer, as a resident layer takes them
    resident: tuple[int, ...]   # layers kept on the device for good (the first layers)
    n_slots: int                # ring slots; 0 when nothing streams
    slot_nbytes: Optional[int] = None   # bytes of one ring slot; None = layer_nbytes (a quantized layer's
                                        # slot holds its block and the dense layer it dequantizes into)
    held_nbytes: Optional[int] = None   # resident layers held quantized (--resident-quant): the bytes of one,
                                        # its block; None = resident layers are dense (layer_nbytes each)

    @property
    def streamed(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if i not in self.resident)

    @property
    def ring_slot_nbytes(self) -> int:
        return self.layer_nbytes if self.slot_nbytes is None else self.slot_nbytes

    @property
    def resident_held(self) -> bool:
        """Resident layers are held quantized and dequantized into one scratch layer every pass."""
        return self.held_nbytes is not None and bool(self.resident)

    @property
    def resident_nbytes(self) -> int:
        """Device bytes of one resident layer: its quantized block when held so, else the dense layer."""
        return self.held_nbytes if self.resident_held else self.layer_nbytes

    @property
    def scratch_nbytes(self) -> int:
        """The dense layer that held quantized resident layers dequantize into, one for them all (else 0)."""
        return self.layer_nbytes if self.resident_held else 0

    @property
    def device_bytes(self) -> int:
        """Device memory the target's decoder layers take: resident layers (+ their scratch) + ring."""
        return len(self.resident) * self.resident_nbytes + self.scratch_nbytes + self.n_slots * self.ring_slot_nbytes


def place_layers(n_layers: int, layer_bytes: int, offload: OffloadConfig,
                 layer_budget: Optional[int], slot_bytes: Optional[int] = None,
                 held_bytes: Optional[int] = None) -> Placement:
    """Spend `layer_budget` device bytes on the target's layers: the ring first (n_slots slots of slot_bytes,
    default layer_bytes), then resident layers, first layers first. layer_budget None: nothing resident
    beyond the ring (a CPU device, where cpu/disk offload should really stream).

    held_bytes (a quantized target's block): resident layers are held quantized, held_bytes each, plus one
    dense scratch layer (layer_bytes) they all dequantize into; e.g. a budget of 10 dense bf16 layers and a
    2-slot nf4 ring (slots of 1.28 layers) holds 7 dense or (10 - 2.56 - 1) / 0.28 = 23 held nf4 layers."""
    mode = offload.mode
    if mode not in MODES:
        raise InputError(f"unknown offload mode {mode!r} (expected one of {', '.join(MODES)})")
    min_slots = 2 if offload.overlap else 1
    if offload.n_slots < min_slots:
        raise InputError(f"n_slots={offload.n_slots}: streaming needs at least 2 slots (1 only with overlap off)")
    each, scratch = (layer_bytes, 0) if held_bytes is None else (held_bytes, layer_bytes)
    all_layers = n_layers * each + scratch
    slot = layer_bytes if slot_bytes is None else slot_bytes
    everything = Placement(mode, n_layers, layer_bytes, resident=tuple(range(n_layers)), n_slots=0,
                           held_nbytes=held_bytes)
    if mode == "none":
        if layer_budget is not None and layer_budget < all_layers:
            held = "" if held_bytes is None else " held quantized, with their dequantization scratch"
            raise BudgetError(f"{format_bytes(layer_budget)} for target layers cannot hold all {n_layers} layers{held} "
                              f"({format_bytes(all_layers)}): use --offload cpu or disk")
        return everything
    if layer_budget is None:
        return Placement(mode, n_layers, layer_bytes, resident=(), n_slots=offload.n_slots, slot_nbytes=slot_bytes)
    if layer_budget >= all_layers:     # held quantized, every layer may fit in less than a ring would take
        return everything
    ring_min = min_slots * slot
    if layer_budget < ring_min:
        raise BudgetError(f"{format_bytes(layer_budget)} for target layers is too small to stream: it needs at least "
                          f"{format_bytes(ring_min)} ({min_slots} slots × {format_bytes(slot)} per slot)")
    n_slots = min(offload.n_slots, layer_budget // slot)
    room = layer_budget - n_slots * slot - scratch       # the scratch is paid once, by the first held layer
    n_resident = max(0, min(room // each, n_layers - n_slots))
    return Placement(mode, n_layers, layer_bytes, resident=tuple(range(n_resident)), n_slots=n_slots,
                     slot_nbytes=slot_bytes, held_nbytes=held_bytes if n_resident else None)


def check_resident_quant(resident_quant: str, quantized: bool) -> None:
    """One line for a --resident-quant that cannot be: unknown, or "on" for a target that is not quantized."""
    if resident_quant not in RESIDENT_QUANTS:
        raise InputError(f"unknown --resident-quant {resident_quant!r}; choose one of {', '.join(RESIDENT_QUANTS)}")
    if resident_quant == "on" and not quantized:
        raise InputError("--resident-quant on holds resident layers quantized: it needs --target-quant int8 or nf4")


def choose_placement(n_layers: int, layer_bytes: int, offload: OffloadConfig, layer_budget: Optional[int],
                     slot_bytes: Optional[int] = None, held_bytes: Optional[int] = None,
                     resident_quant: str = "auto") -> Placement:
    """place_layers, with a quantized target's resident layers dense or held quantized (held_bytes: its block;
    None for a dense target) as resident_quant says: "on" held, "off" dense, "auto" held only where that keeps
    MORE layers resident (a tie stays dense: a held layer costs a dequantization every pass, a dense one
    nothing). A budget no placement fits raises the BudgetError of the held one."""
    check_resident_quant(resident_quant, quantized=held_bytes is not None)
    if held_bytes is None or resident_quant == "off":
        return place_layers(n_layers, layer_bytes, offload, layer_budget, slot_bytes)
    held = place_layers(n_layers, layer_bytes, offload, layer_budget, slot_bytes, held_bytes)
    if resident_quant == "on":
        return held
    try:
        dense = place_layers(n_layers, layer_bytes, offload, layer_budget, slot_bytes)
    except BudgetError:
        return held
    return held if len(held.resident) > len(dense.resident) else dense



@dataclass
class TargetLayers:
    """What open_target_layers returns: a LayerSource (hand it to Model as its layers) that also says what
    was decided, reports streaming stats and stops the streamer's threads on close()."""
    source: Union[ResidentLayers, LayerStreamer]   # the layers themselves
    placement: Placement                           # resident layers and ring size
    host: Optional[StoreInfo]                      # where the streamed layers live; None when nothing streams

    def pass_layers(self) -> Iterator[tuple[int, LayerWeights]]:
        return self.source.pass_layers()

    def stats(self) -> Optional[StreamStats]:
        return self.source.stats() if isinstance(self.source, LayerStreamer) else None

    def close(self) -> None:
        if isinstance(self.source, LayerStreamer):
            self.source.close()

    def __enter__(self) -> "TargetLayers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def ring_slot_nbytes(layout: BlockLayout) -> Optional[int]:
    """Device bytes of one ring slot for this layout: None for a dense layer (the layer itself); a quantized
    layer's block plus the dense layer it is dequantized into."""
    return None if layout.quant == "none" else layout.nbytes + layout.dense.nbytes


def _resident_layer(block: torch.Tensor, layout: BlockLayout, device: torch.device,
                    scratch: Optional[torch.Tensor] = None) -> Union[LayerWeights, QuantizedResident]:
    """A host block of `layout` -> the layer on the device for good: dense (a quantized block is copied,
    dequantized there, and dropped), or with a scratch ((dense nbytes,) uint8 on the device) the quantized
    block itself, held, dequantized into the scratch every pass."""
    on_device = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)   # (nbytes,)
    on_device.copy_(block)
    if scratch is not None:
        return QuantizedResident(layout, on_device, scratch)
    return dequantized(layout, on_device)[1]


def open_target_layers(layer_tensors_fn: LayerTensorsFn, cfg: ModelConfig, offload: OffloadConfig,
                       device: torch.device, dtype: torch.dtype, store_dir: Optional[str] = None,
                       progress: bool = True, *, source_id: str = "",
                       placement: Optional[Placement] = None, quant: str = "none",
                       resident_quant: str = "auto") -> TargetLayers:
    """The target's decoder layers, placed as `offload` says.

    layer_tensors_fn(i) gives layer i's tensors keyed by LayerWeights field names, any dtype (cast to
    `dtype` when packed). mode "none": all resident. "cpu": streamed layers packed into a host arena.
    "disk": a packed store at store_dir (or offload.store_dir), built once with a progress bar when
    missing; source_id (e.g. Checkpoint.fingerprint()) is recorded in it, and a store built from other
    weights is refused. The result is a LayerSource; close it (or use it as a context manager) to stop
    the streamer's threads.

    quant "int8" | "nf4": every layer is quantized once, into the packed store at store_dir (whatever the
    mode: quantizing a 70B takes the better part of an hour on a few cores, reading it back seconds); the
    arena and the ring hold quantized blocks, the ring's dense buffers the dequantized layer in `dtype`.
    Resident layers are dense, or held as their quantized blocks and dequantized every pass into one shared
    scratch layer (placement.resident_held; resident_quant decides it when no placement is given). A store
    of another quantization is refused.

    placement: which layers stay resident and how many slots stream the rest, as the memory plan decided
    (plan.make_plan); None = offload.gpu_budget alone decides (no budget: nothing resident beyond the ring)."""
    check_target_quant(quant, device, dtype)
    layout = target_layout(cfg, dtype, quant)
    if placement is None:
        placement = choose_placement(cfg.n_layers, layout.dense.nbytes, offload, offload.gpu_budget,
                                     slot_bytes=ring_slot_nbytes(layout),
                                     held_bytes=None if quant == "none" else layout.nbytes,
                                     resident_quant=resident_quant)
    from_store = offload.mode == "disk" or quant != "none"
    if not placement.streamed and not from_store:
        layers = []
        for i in tqdm(range(cfg.n_layers), desc="loading layers", unit="layer", disable=not progress):
            block = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)   # (nbytes,) one block per layer
            _pack_layer(layer_tensors_fn, i, layout, block)
            layers.append(layout.views(block))
        return TargetLayers(ResidentLayers(layers), placement, host=None)

    backend = make_backend(device)
    with contextlib.ExitStack() as on_error:
        on_error.callback(backend.close)
        disk: Optional[DiskStore] = None
        if from_store:
            directory = store_dir or offload.store_dir
            if directory is None:
                raise InputError("disk offload and quantized targets need a store directory (store_dir)")
            if not disk_store_exists(directory):
                prepare_disk_store(layer_tensors_fn, cfg.n_layers, layout, directory, progress, source_id=source_id)
            disk = DiskStore(directory, layout, cfg.n_layers, backend, source_id=source_id,
                             drop_page_cache=offload.drop_page_cache, direct_io=offload.disk_io == "direct")
            on_error.callback(disk.close)

        def host_block(layer: int) -> torch.Tensor:
            """Layer `layer`'s block on the host: read from the store, or packed from its tensors."""
            if disk is not None:
                return disk.read_layer(layer)
            block = torch.empty(layout.nbytes, dtype=torch.uint8)
            _pack_layer(layer_tensors_fn, layer, layout, block)
            return block

        # Held quantized resident layers share one scratch layer: the plan counted it once (scratch_nbytes).
        scratch = (torch.empty(layout.dense.nbytes, dtype=torch.uint8, device=device)   # (dense nbytes,)
                   if placement.resident_held else None)
        resident = {i: _resident_layer(host_block(i), layout, device, scratch)
                    for i in tqdm(placement.resident, desc="loading resident layers", unit="layer",
                                  disable=not progress or not placement.resident)}
        if not placement.streamed:
            on_error.close()      # the store and the backend were only needed to read the layers
            return TargetLayers(ResidentLayers([resident[i] for i in range(cfg.n_layers)]), placement, host=None)
        store: WeightStore
        if offload.mode == "cpu" and disk is not None:       # quantized: the arena is filled from the store
            store = HostArenaStore.filled(lambda layer, block: block.copy_(disk.read_layer(layer)), layout,
                                          placement.streamed, backend, offload.host_budget, progress)
            on_error.callback(store.close)
            disk.close()
        elif offload.mode == "cpu":
            store = HostArenaStore.build(layer_tensors_fn, layout, placement.streamed, backend,
                                         offload.host_budget, progress)
            on_error.callback(store.close)
        else:
            store = disk
        streamer = LayerStreamer(store, backend, cfg.n_layers, resident, placement.n_slots, overlap=offload.overlap)
        on_error.pop_all()
    return TargetLayers(streamer, placement, store.info())
