"""offspec's packed layer store on disk: building it, checking its manifest, and reading its layers.

  DiskStore        offspec's packed store on disk, read into pinned staging buffers: O_DIRECT where the
                   filesystem allows it, each block in pieces read by several threads at once
                   (docs/streaming.md §5).
  prepare_disk_store   builds a store once from a checkpoint's layer tensors (dense or quantized blocks).

The store format: a folder with layers.bin (every layer one block, starting and ending on BLOCK_ALIGN) and
manifest.json (format, version, layout, offsets, a crc32 per block, and the fingerprint of the weights it was
built from).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from offspec.errors import StoreError
from offspec.formats import published
from offspec.formats.layout import BLOCK_ALIGN, N_STAGING, round_up
from offspec.stream.staged import BlockLayout, LayerTensorsFn, Staged, StoreInfo, pack_layer
from offspec.stream.transfer import HostBuffer, TransferBackend, TransferEvent, format_bytes

READS_IN_FLIGHT = 4           # a disk block is read in this many pieces at once, one thread each (queue depth)
STORE_FORMAT = "offspec-layer-store"
STORE_VERSION = 1
MANIFEST = "manifest.json"
LAYERS_BIN = "layers.bin"


def store_fingerprint(layout: BlockLayout, n_layers: int, source_id: str = "") -> str:
    """Identifies what a disk store holds: the model's layer shapes, dtype and quantization (the layout),
    its layer count, and source_id, whatever names the weights (e.g. Checkpoint.fingerprint()); two
    checkpoints of one architecture differ only there. Computed from prepare_disk_store's own arguments, so
    building a store needs no ModelConfig."""
    text = json.dumps({"dtype": str(layout.dtype), "layout": layout.describe(), "n_layers": n_layers,
                       "source": source_id}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
        what = ("packing layers into" if layout.quant == "none" else
                f"packing layers as published ({published.short(layout.quant)}) into"
                if published.is_published(layout.quant) else f"quantizing layers ({layout.quant}) into")
        with open(tmp_bin, "wb") as f, tqdm(total=n_layers, desc=f"{what} {directory}",
                                            unit="layer", disable=not progress) as bar:
            for layer in range(n_layers):
                pack_layer(layer_tensors_fn, layer, layout, block[: layout.nbytes])
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
            raise StoreError(f"the store at {directory} holds {manifest['dtype']} weights, {dtype} was asked: "
                             f"{rebuild}")
        quant = manifest.get("quant", "none")      # stores from before quantized layers hold dense ones
        if quant != layout.quant:
            held, wanted = (("unquantized" if q == "none" else published.describe(q) if published.is_published(q)
                             else q) for q in (quant, layout.quant))
            raise StoreError(f"the store at {directory} holds {held} layers and {wanted} ones were asked for: "
                             f"{rebuild}, or give another --store-dir")
        if manifest["layout"] != layout.describe() or manifest["layer_nbytes"] != layout.nbytes:
            raise StoreError(f"the store at {directory} has a different layer layout: {rebuild}")
        if manifest["n_layers"] != n_layers or len(manifest["layers"]) != n_layers:
            raise StoreError(f"the store at {directory} has {manifest['n_layers']} layers, the model {n_layers}: "
                             f"{rebuild}")
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
