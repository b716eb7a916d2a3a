"""The ring: the target's streamed layers rotate through n_slots device slots, each copy overlapping compute.

  LayerStreamer   a LayerSource: a ring of n_slots device slots that the streamed layers rotate through,
                  prefetching ahead and wrapping into the next pass; permanently resident layers are
                  interleaved in layer order. Its host side is a weight store (stores.py).

Every stream, event and pinned-memory call goes through a transfer backend (transfer.py), so the CPU
backend runs this exact code in the tests; docs/streaming.md is the contract the ring protocol follows.

A load is one layer, or in a split ring one part of a layer (layout.LAYER_PARTS: attention, gate, up, down, each
a slot a quarter of a layer or less), the parts of a layer loaded in turn and each released once read.

The ring protocol, for the n-th load ever issued (n counts across passes; slot k = n % n_slots):
  loader thread    [disk: wait for the layer's read into staging (started one load earlier, each piece
                    once that staging buffer's gate completed); start the next layer's read likewise]
                   free[k].wait(copy_q)     WAR: compute has finished reading slot k's previous layer
                    [quantized: ready[k].wait(copy_q) instead: slot k's previous block has been dequantized]
                   copy host block -> slot k on copy_q  (split: the part's byte runs of the block; a layer
                    is acquired from the store at its first part, its staging gate recorded after its last)
                   [disk: gate.record(copy_q): the staging buffer may be refilled once this completes]
                   [quantized, on the dequantization queue deq_q, so the next copy runs meanwhile:
                    copied[k].record(copy_q); copied[k].wait(deq_q)    RAW on the block
                    free[k].wait(deq_q)      WAR on the dense buffer: compute has read slot k's previous layer
                    dequantize slot k's block into its dense buffer on deq_q]
                   ready[k].record(copy_q, or deq_q when quantized)  RAW: compute may read slot k then
                   publish "load n issued"
  consumer thread  wait (host) until load n is issued, so the wait below binds to *its* ready record
                   ready[k].wait(comp_q); yield the views of slot k; the consumer issues its kernels
                   ... the consumer asks for the next layer ...
                   free[k].record(comp_q)   after every kernel reading slot k was issued
                   post load n + n_slots    strictly after that record
"""
from __future__ import annotations

import dataclasses
import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

from offspec.formats.layout import LayerLayout, LayerWeights
from offspec.formats.quant import QuantizedLayout, QuantizedPart, QuantizedResident, layer_weights
from offspec.stream.staged import Staged
from offspec.stream.stores import WeightStore
from offspec.stream.transfer import TransferBackend, TransferEvent, raise_from_worker


@dataclass
class StreamStats:
    """Streaming counters. Copy and wait times are read from timing events once per pass, and only for
    work that has completed by then, so a pass's last copies may be counted in the next snapshot."""
    passes: int = 0            # pass_layers() iterations run to their end
    layers: int = 0            # copies counted in bytes and transfer_s: layers, or a split ring's parts of layers
    bytes: int = 0             # bytes those copies moved host -> device
    transfer_s: float = 0.0    # seconds those copies took on the copy queue (device-timed on CUDA)
    wait_s: float = 0.0        # seconds compute stood still waiting for a layer (device-timed on CUDA)
    read_s: float = 0.0        # disk: seconds the layers' reads from layers.bin took (host clock)
    dequant_s: float = 0.0     # quantized layers: seconds their dequantization took on its queue (device-timed)
    prefetched_layers: int = 0   # loads (layers or parts) already in their slots when their pass began, copied
    prefetched_bytes: int = 0    # while the consumer was busy elsewhere (drafting): the wrap-around prefetch at work

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


class LayerStreamer:
    """A LayerSource streaming the non-resident layers through a ring of `n_slots` device slots.

    The protocol is in the module docstring. Threads: the consumer's thread records/waits events and posts
    load numbers; one loader thread takes them in order, gets each layer's host bytes from the store (disk:
    reads them) and issues its copy. Load n always carries streamed layer n % n_streamed (split: part n % P of
    layer (n // P) % n_streamed) into slot n % n_slots, with n counted across passes: a per-pass counter would
    break the wrap-around into the next
    pass whenever n_streamed % n_slots != 0 (docs/streaming.md, review #3). So when a pass ends, the first layers
    of the next pass are already being copied while the draft works.

    A yielded LayerWeights is a set of views into a slot: valid only until the consumer asks for the next
    layer (docs/streaming.md, review #4: keep nothing derived from it, e.g. a cached w.T).

    split (plan.Placement.split): the slots are the size of a layer's largest part, and a streamed layer is
    yielded as its LAYER_PARTS in order, each a LayerWeights carrying that part (LayerWeights.part);
    model.run_layer keeps what the MLP needs between them. Quantized parts dequantize as whole blocks do (on
    the copy queue into their slot's dense part, or compact: at use into the scratch, a part's size).

    A store of quantized layers (QuantizedLayout): slot k receives the quantized block, and the dequantization
    queue turns it into slot k's dense buffer, which is what the consumer reads. Three queues pipeline a
    layer: its copy, the previous layer's dequantization and the one before's compute run at once, so a pass
    costs about max(copies, dequantizations, compute); copied[k] orders the copy before its dequantization,
    and the block is refilled once it has been dequantized (ready[k]), not once it has been computed on.

    A compact ring (`scratch` given, plan.Placement.compact): the slots hold blocks only. The consumer
    dequantizes slot k into the one shared scratch layer on the compute queue (as a held resident layer is),
    releases slot k right after (the block is read; free[k] is recorded after the dequantization's kernels),
    and reads the scratch, which the next layer's dequantization overwrites in stream order after this
    layer's kernels. The copies still overlap compute; the dequantization no longer does.

    overlap=False (debug): no prefetch, and compute is finished before the next copy starts.
    The streamer owns `store` and `backend`: close() stops the loader and closes both."""

    def __init__(self, store: WeightStore, backend: TransferBackend, n_layers: int,
                 resident: dict[int, Union[LayerWeights, QuantizedResident]], n_slots: int, overlap: bool = True,
                 scratch: Optional[torch.Tensor] = None, split: bool = False):
        if n_slots < (2 if overlap else 1):
            raise ValueError(f"n_slots={n_slots}: streaming needs at least 2 slots (1 only with overlap off)")
        self.store, self.backend = store, backend
        self.layout: LayerLayout = store.layout
        self.n_layers, self.n_slots, self.overlap = n_layers, n_slots, overlap
        self.resident = dict(resident)       # layer index -> weights kept on the device (dense, or held quantized)
        self.streamed = [i for i in range(n_layers) if i not in self.resident]   # streamed layers, in order
        if not self.streamed:
            raise ValueError("nothing to stream: every layer is resident (use ResidentLayers)")

        self.quantized = isinstance(self.layout, QuantizedLayout)
        if scratch is not None and not self.quantized:
            raise ValueError("a compact ring is for quantized layers")
        # What one load copies: the whole block, or one part's byte runs of it (of a GGUF layer, only the bytes its
        # own types take: QuantizedPart.runs_for); and what it reads (part.dense).
        self._parts = self.layout.parts(split)
        self._runs = {layer: [part.runs_for(layer) for part in self._parts] for layer in self.streamed}
        self._per_pass = len(self.streamed) * len(self._parts)     # loads a pass
        # Allocated once, never freed or reallocated (docs/streaming.md §3), so no record_stream is needed.
        slot_nbytes = max(part.nbytes for part in self._parts)
        self._slots = [backend.device_buffer(slot_nbytes) for _ in range(n_slots)]   # each (slot_nbytes,) uint8
        self._scratch = scratch    # (≥ the largest part's dense nbytes,) uint8: a compact ring's one dense layer
        # What the consumer reads, per slot and part: the slot itself, or the dense layer (part) its quantized
        # block dequantizes into; a compact ring reads its scratch instead.
        dense_nbytes = max(part.dense.nbytes for part in self._parts)
        self._dense = ([backend.device_buffer(dense_nbytes) for _ in range(n_slots)]
                       if self.quantized and scratch is None else self._slots)            # each (dense_nbytes,) uint8
        self._views = ([] if scratch is not None else
                       [[part.dense.views(dense) for part in self._parts] for dense in self._dense])
        self._staged: Optional[Staged] = None   # loader thread: the layer whose parts it is copying
        self._ready = [backend.new_event() for _ in range(n_slots)]   # slot k readable: copied (and dequantized)
        self._copied = [backend.new_event() for _ in range(n_slots)]  # quantized: the block in slot k copied
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
                for part in range(len(self._parts)):
                    n = self._released
                    assert self._piece(n) == (layer, part), (n, layer, part)
                    k = self._take(n, comp_q)
                    if self._scratch is not None:          # compact: dequantize at use, then the slot is free
                        held = n
                        weights = self._dequantize_at_use(k, layer, self._parts[part], comp_q)
                        held = None
                        self._release(n, comp_q)
                        yield layer, weights
                        continue
                    held = n
                    yield layer, self._views[k][part]
                    held = None
                    self._release(n, comp_q)
            with self._lock:
                self._stats.passes += 1
            self._harvest()
        finally:
            if held is not None:   # the consumer left mid-pass (exception, break): its kernels are issued
                self._release(held, comp_q)
            self._in_pass = False

    def _piece(self, n: int) -> tuple[int, int]:
        """Load n -> (layer, part) it carries: the wrap-around counts loads across passes (docs/streaming.md §1)."""
        q = n % self._per_pass
        return self.streamed[q // len(self._parts)], q % len(self._parts)

    def _take(self, n: int, comp_q) -> int:
        """Make compute wait until load n is in its slot; -> the slot."""
        k = n % self.n_slots
        stall_start, stall_end = self._timing_event(), self._timing_event()
        stall_start.record(comp_q)
        self._wait_issued(n)            # host: the ready record below must be load n's (it binds at call time)
        self._ready[k].wait(comp_q)     # RAW
        stall_end.record(comp_q)
        with self._lock:
            self._pending_waits.append((stall_start, stall_end))
        return k

    def _dequantize_at_use(self, k: int, layer: int, part: QuantizedPart, comp_q) -> LayerWeights:
        """A compact ring: slot k's block (or part of one) of `layer` -> the shared scratch, on the compute queue,
        timed."""
        start, end = self._timing_event(), self._timing_event()
        start.record(comp_q)
        part.dequantize(self._slots[k], self._scratch, layer)
        weights = part.dense.views(self._scratch)
        end.record(comp_q)
        with self._lock:
            self._pending_dequants.append((start, end))
        return weights

    def _release(self, n: int, comp_q) -> None:
        """Hand slot k back: after the consumer's last kernel on it, and before any refill is posted."""
        k = n % self.n_slots
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
            issued = min(self._issued, first + self._per_pass)
        done = [n for n in range(first, issued) if self._ready[n % self.n_slots].query()]
        with self._lock:
            self._stats.prefetched_layers += len(done)
            self._stats.prefetched_bytes += sum(self._moved_nbytes(n) for n in done)

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
        while self._released % self._per_pass:
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

    def _moved_nbytes(self, n: int) -> int:
        """Bytes load n copies (a GGUF layer's matrices may take less than their slot reserves)."""
        layer, p = self._piece(n)
        return sum(nbytes for _, _, nbytes in self._runs[layer][p])

    def _load(self, n: int) -> None:
        (layer, p), k = self._piece(n), n % self.n_slots
        part = self._parts[p]
        runs = self._runs[layer][p]
        if p == 0:                             # a layer's first load: its bytes from the store
            next_layer = self._piece(n + len(self._parts))[0]
            self._staged = self.store.acquire(layer, next_layer=next_layer)   # disk: waits for its read
        staged = self._staged
        copy_q = self.backend.copy_queue
        pipelined = self.quantized and self._scratch is None     # a dequantization queue reads the block
        copy_start, copy_end = self._timing_event(), self._timing_event()
        # WAR: slot k's previous load has been read (by compute; by its dequantization when pipelined)
        (self._ready if pipelined else self._free)[k].wait(copy_q)
        copy_start.record(copy_q)
        for src, dst, nbytes in runs:
            self.backend.copy_async(self._slots[k][dst:dst + nbytes], staged.block[src:src + nbytes],
                                    src_pinned=staged.pinned)
        copy_end.record(copy_q)
        if staged.gate is not None and p == len(self._parts) - 1:
            staged.gate.record(copy_q)         # the staging buffer may be refilled once its last copy is done
        if pipelined:
            dequant_start, dequant_end = self._dequantize_after_copy(k, part, layer, copy_q)
            self._ready[k].record(self.backend.dequant_queue)   # RAW: slot k's dense layer is `layer` then
        else:
            self._ready[k].record(copy_q)      # RAW: slot k holds `layer` once this completes
        with self._lock:
            self._pending_copies.append((copy_start, copy_end, sum(nbytes for _, _, nbytes in runs)))
            if pipelined:
                self._pending_dequants.append((dequant_start, dequant_end))
            self._stats.read_s += staged.read_s if p == 0 else 0.0

    def _dequantize_after_copy(self, k: int, part: QuantizedPart, layer: int, copy_q):
        """Issue slot k's dequantization on the dequantization queue, after its copy (RAW on the block) and after
        compute has read the slot's previous dense layer (WAR); -> its timing events."""
        deq_q = self.backend.dequant_queue
        self._copied[k].record(copy_q)
        self._copied[k].wait(deq_q)
        self._free[k].wait(deq_q)
        start, end = self._timing_event(), self._timing_event()
        start.record(deq_q)
        self.backend.on_dequant_queue(lambda block=self._slots[k], dense=self._dense[k]:
                                      part.dequantize(block, dense, layer))
        end.record(deq_q)
        return start, end

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
