"""Transfer backends: the one place offspec touches streams, events and pinned memory (docs/streaming.md §8).

A backend has two queues and events that order work between them:
  copy queue     host -> device layer copies. CUDA: one side stream `copy_s`, made when the backend is made.
                 CPU: one FIFO worker thread.
  compute queue  where the consumer's kernels run. CUDA: the stream current on the consumer's thread when
                 asked (`comp_s`). CPU: the caller's own thread, so work "issued" there has run by the time
                 the call returns; or, to model asynchronous kernels in tests, a second FIFO worker thread.

Event semantics, the same on both backends (they are CUDA's):
  record(q)        marks the work issued to q so far; the event completes when q has done that work.
  wait(q)          work issued to q after this call waits for the most recent record made *before* this call
                   (cudaStreamWaitEvent binds at call time), so record() must come first in host order.
  synchronize()    blocks the calling host thread until the most recent record has completed.
  query()          True when the most recent record has completed; never blocks.
  An event that was never recorded counts as done (c10/cuda/CUDAEvent.h: waiting on it is a no-op).

Nothing here touches torch.cuda at import time: on a CPU-only torch, creating streams, events or pinned
memory raises, so all of it happens inside CudaBackend, which is only built for a CUDA device.
"""
from __future__ import annotations

import collections
import mmap
import threading
import time
from typing import Any, Callable, NoReturn, Optional, Protocol, Union

import numpy as np
import torch

from offspec.errors import OffspecError
from offspec.formats.layout import PAGE_BYTES, format_bytes  # noqa: F401  (format_bytes: this module's callers use it from here)


def raise_from_worker(err: BaseException, where: str) -> NoReturn:
    """Surface an exception caught on a worker thread in the calling thread.

    offspec's own errors pass through unchanged (their one-line message is the whole story, and the CLI
    turns them into a clean exit); anything else is wrapped so the traceback shows both threads."""
    if isinstance(err, OffspecError):
        raise err
    raise RuntimeError(f"{where} failed: {err!r}") from err


def check_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Both backends copy bytes verbatim: same dtype, same size, both contiguous (docs/streaming.md §2: a mismatch
    would make the copy build temporaries, including a pageable host copy)."""
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise RuntimeError("layer copy needs contiguous source and destination")
    if src.dtype != dst.dtype or src.numel() != dst.numel():
        raise RuntimeError(f"layer copy mismatch: {src.dtype}[{src.numel()}] -> {dst.dtype}[{dst.numel()}]")


class TransferEvent(Protocol):
    def record(self, queue: Any) -> None: ...
    def wait(self, queue: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_s(self, end: "TransferEvent") -> float: ...   # both timing events, both completed


class TransferBackend(Protocol):
    device: torch.device
    copy_queue: Any

    def compute_queue(self) -> Any: ...
    def new_event(self, timing: bool = False) -> TransferEvent: ...
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, *, src_pinned: bool) -> None: ...
    def on_dequant_queue(self, fn: Callable[[], None]) -> None: ...   # a quantized layer's dequantization
    def compute(self, fn: Callable[[], None]) -> None: ...
    def device_buffer(self, nbytes: int) -> torch.Tensor: ...
    def host_buffer(self, nbytes: int, host_budget: Optional[int] = None,
                    chunk_bytes: Optional[int] = None) -> "HostBuffer": ...
    def synchronize(self) -> None: ...
    def check(self) -> None: ...
    def close(self) -> None: ...


# ---------------------------------------------------------------- host memory

class HostBuffer:
    """`nbytes` of page-aligned host memory, exactly that size, pinned when the backend could pin it.

    An anonymous mmap, not torch.empty(pin_memory=True): PyTorch's pinned allocator rounds every request up
    to a power of two (docs/streaming.md §4: a 20.4 GiB arena would pin 32 GiB). Page alignment also keeps O_DIRECT
    reads possible later."""

    def __init__(self, nbytes: int, pinned: bool, reason: str, mapping: mmap.mmap):
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # (nbytes,) uint8 over the mapping
        self.nbytes = nbytes      # exact size in bytes
        self.pinned = pinned      # all of it page-locked and registered with CUDA: async H2D copies are allowed
        self.pinned_nbytes = nbytes if pinned else 0   # the pinned prefix (a budget may pin the first pieces only)
        self.reason = reason      # why it is not (all) pinned ("" when it is)
        self._mapping = mapping   # kept so the memory lives as long as this buffer
        self._unpin: Optional[Callable[[], None]] = None   # undoes the registration, once, on close

    def mark_pinned(self, unpin: Callable[[], None], nbytes: Optional[int] = None) -> None:
        """Registered: all of it, or its first `nbytes` (whole pieces within a pinned budget)."""
        self.pinned_nbytes = self.nbytes if nbytes is None else nbytes
        self.pinned, self._unpin = self.pinned_nbytes == self.nbytes, unpin
        self.reason = "" if self.pinned else (f"the first {format_bytes(self.pinned_nbytes)} of "
                                              f"{format_bytes(self.nbytes)} pinned (the pinned budget)")

    def pinned_at(self, offset: int, nbytes: int) -> bool:
        """Bytes [offset, offset + nbytes) are pinned: an async copy from them is allowed."""
        return offset + nbytes <= self.pinned_nbytes

    @staticmethod
    def map(nbytes: int) -> mmap.mmap:
        if nbytes <= 0:
            raise ValueError(f"host buffer of {nbytes} bytes")
        # Private anonymous memory: page-aligned, zero-filled on first touch, plain process memory (the
        # default MAP_SHARED would make it shmem, charged and paged differently).
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def close(self) -> None:
        """Unpin (before the memory can be unmapped, docs/streaming.md §4) and drop our references; the mapping is
        unmapped when the last tensor viewing it dies."""
        if self._unpin is not None:
            unpin, self._unpin = self._unpin, None
            unpin()
            self.pinned, self.pinned_nbytes = False, 0
        self.tensor = None
        self._mapping = None


# ---------------------------------------------------------------- CPU backend

class QueueClosed(Exception):
    """The backend was closed while this thread waited on it (inside a worker: ends that worker)."""


class CallerThread:
    """The caller's own thread as a queue: work submitted here runs before submit() returns."""

    def __init__(self, backend: "CpuBackend"):
        self._backend = backend

    def submit(self, fn: Callable[[], None]) -> None:
        with self._backend.cv:
            self._backend.check_open_locked()
        fn()


class WorkerQueue:
    """One FIFO worker thread, the CPU stand-in for a CUDA stream: tasks run one at a time, in order."""

    def __init__(self, name: str, backend: "CpuBackend"):
        self.name = name
        self._backend = backend
        self._tasks: collections.deque[Callable[[], None]] = collections.deque()
        # daemon: a crashed or abandoned run can never hang interpreter exit on this thread
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        backend = self._backend
        with backend.cv:
            backend.check_open_locked()
            self._tasks.append(fn)
            backend.cv.notify_all()

    def _run(self) -> None:
        backend = self._backend
        while True:
            with backend.cv:
                backend.cv.wait_for(lambda: self._tasks or backend.closed)
                if backend.closed:
                    return
                task = self._tasks.popleft()
            try:
                task()
            except QueueClosed:
                return
            except BaseException as err:   # handed to every waiter and every later submit; never swallowed
                backend.fail(err, self.name)
                return

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"{self.name} thread did not stop within {timeout:.0f} s")


class CpuEvent:
    """A CUDA-style event for the CPU backend: generation counters under the backend's Condition.

    A bare threading.Event cannot model re-recording: a wait must bind to the record that was most recent
    when wait() was called, not to whatever the event is later re-recorded for."""

    def __init__(self, backend: "CpuBackend"):
        self._backend = backend
        self._recorded = 0    # records made so far (host order)
        self._done = 0        # highest record the queues have reached
        self.time = 0.0       # perf_counter() when the latest record completed (timing)

    def record(self, queue: Union[CallerThread, WorkerQueue]) -> None:
        with self._backend.cv:
            self._recorded += 1
            generation = self._recorded
        queue.submit(lambda: self._complete(generation))

    def wait(self, queue: Union[CallerThread, WorkerQueue]) -> None:
        with self._backend.cv:
            generation = self._recorded       # snapshot now: later records do not move this wait
        if generation:                        # never recorded: nothing to wait for
            queue.submit(lambda: self._block_until(generation))

    def synchronize(self) -> None:
        with self._backend.cv:
            generation = self._recorded
        self._block_until(generation)

    def query(self) -> bool:
        with self._backend.cv:
            self._backend.check_locked()
            return self._done >= self._recorded

    def elapsed_s(self, end: "CpuEvent") -> float:
        return end.time - self.time

    def _complete(self, generation: int) -> None:
        with self._backend.cv:
            if generation > self._done:
                self._done = generation
                self.time = time.perf_counter()
            self._backend.cv.notify_all()

    def _block_until(self, generation: int) -> None:
        backend = self._backend
        with backend.cv:
            backend.cv.wait_for(lambda: self._done >= generation or backend.error is not None or backend.closed)
            if self._done >= generation:
                return
            backend.check_locked()
            raise QueueClosed("transfer backend closed while waiting on an event")


class CpuBackend:
    """Host memory is the "device": slots are plain tensors, copies run on one worker thread.

    async_compute=False (what offspec runs): compute is the caller's thread, so recording on the compute
    queue is immediate and waiting on it blocks the caller. async_compute=True (tests): compute is a second
    worker thread, so the host can run ahead of the "kernels" as it does with a GPU, and a missing
    RAW/WAR wait shows up as a torn or stale read."""

    device = torch.device("cpu")

    def __init__(self, async_compute: bool = False):
        self.cv = threading.Condition()        # guards every queue and event of this backend
        self.error: Optional[BaseException] = None  # first exception raised on a worker, re-raised to callers
        self.error_where = ""                  # which worker raised it
        self.closed = False                    # set by close(); wakes and ends every worker
        self.copy_queue = WorkerQueue("offspec-copy", self)
        self.dequant_queue = WorkerQueue("offspec-dequant", self)   # quantized layers' dequantization
        self._compute = WorkerQueue("offspec-compute", self) if async_compute else CallerThread(self)

    def compute_queue(self) -> Union[CallerThread, WorkerQueue]:
        return self._compute

    def new_event(self, timing: bool = False) -> CpuEvent:
        return CpuEvent(self)   # every CPU event can time itself: it keeps its completion clock

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, *, src_pinned: bool) -> None:
        check_copy(dst, src)
        self.copy_queue.submit(lambda: self.copy_bytes(dst, src))

    def copy_bytes(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The copy itself, on the copy worker (tests override it to tear copies in two).

        A plain memcpy through numpy, not Tensor.copy_: a large copy_ runs an OpenMP parallel region, and
        the thread team it gives this second thread keeps competing with the compute thread's own team for
        good: on 2 cores every later draft call ran 2x slower (0.14 vs 0.07 s), idle streamer or not."""
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())

    def on_dequant_queue(self, fn: Callable[[], None]) -> None:
        """Run fn on the dequantization worker, after the waits submitted to it so far (a quantized layer's
        dequantization: tests override it to delay it)."""
        self.dequant_queue.submit(fn)

    def compute(self, fn: Callable[[], None]) -> None:
        self._compute.submit(fn)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_buffer(self, nbytes: int, host_budget: Optional[int] = None,
                    chunk_bytes: Optional[int] = None) -> HostBuffer:
        return HostBuffer(nbytes, pinned=False, reason="cpu device", mapping=HostBuffer.map(nbytes))

    def synchronize(self) -> None:
        """Nothing to do: every wait that matters goes through an event."""

    def fail(self, err: BaseException, where: str) -> None:
        with self.cv:
            if self.error is None and not self.closed:
                self.error, self.error_where = err, where
            self.cv.notify_all()

    def check(self) -> None:
        with self.cv:
            self.check_locked()

    def check_locked(self) -> None:
        if self.error is not None:
            raise_from_worker(self.error, f"{self.error_where} thread")

    def check_open_locked(self) -> None:
        self.check_locked()
        if self.closed:
            raise RuntimeError("transfer backend is closed")

    def close(self) -> None:
        with self.cv:
            if self.closed:
                return
            self.closed = True
            self.cv.notify_all()
        self.copy_queue.join(timeout=30)
        self.dequant_queue.join(timeout=30)
        if isinstance(self._compute, WorkerQueue):
            self._compute.join(timeout=30)


# ---------------------------------------------------------------- CUDA backend

class CudaEvent:
    """torch.cuda.Event behind the backend interface; every record/wait names its stream explicitly
    (docs/streaming.md, review #1: an omitted stream means the *calling thread's* current stream)."""

    def __init__(self, timing: bool):
        self._event = torch.cuda.Event(enable_timing=timing)

    def record(self, queue: "torch.cuda.Stream") -> None:
        self._event.record(queue)                 # cudaEventRecord(event, queue)

    def wait(self, queue: "torch.cuda.Stream") -> None:
        queue.wait_event(self._event)              # cudaStreamWaitEvent: binds to the latest record, now

    def synchronize(self) -> None:
        self._event.synchronize()                  # cudaEventSynchronize; releases the GIL while blocked

    def query(self) -> bool:
        return self._event.query()                 # cudaEventQuery

    def elapsed_s(self, end: "CudaEvent") -> float:
        return self._event.elapsed_time(end._event) / 1000.0   # ms; both must be timing events, completed


class CudaBackend:
    """Copies on a side stream made here, compute on whatever stream the consumer runs on.

    Any thread may issue copies: copy_async enters `torch.cuda.stream(copy_s)` on the calling thread itself
    (the current stream is per thread, docs/streaming.md, review #10)."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CudaBackend needs a cuda device, got {device}")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.copy_queue = torch.cuda.Stream(device=self.device)   # copy_s: every H2D layer copy, nothing else
        # deq_s: quantized layers' dequantization, so the next copy runs while this one dequantizes (§1)
        self.dequant_queue = torch.cuda.Stream(device=self.device)

    def compute_queue(self) -> "torch.cuda.Stream":
        return torch.cuda.current_stream(self.device)             # comp_s, as seen from the calling thread

    def new_event(self, timing: bool = False) -> CudaEvent:
        return CudaEvent(timing)   # synchronization events stay timing-free (docs/streaming.md §6)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, *, src_pinned: bool) -> None:
        """dst (device, uint8) <- src (host, uint8) on copy_s.

        src_pinned=True: an async DMA; the source must really be pinned (docs/streaming.md §2: from pageable memory
        the "async" copy is synchronous or driver-staged). src_pinned=False (the reported pageable fallback):
        a blocking copy on the issuing thread, still ordered on copy_s after its waits."""
        check_copy(dst, src)
        if src_pinned and not src.is_pinned():
            raise RuntimeError("async layer copy from host memory that is not pinned")
        with torch.cuda.stream(self.copy_queue):
            dst.copy_(src, non_blocking=src_pinned)

    def on_dequant_queue(self, fn: Callable[[], None]) -> None:
        """Issue fn's kernels on deq_s, after the waits issued to it so far (a quantized layer's dequantization:
        it writes into a slot's preallocated dense buffer; the kernels allocate nothing, the torch path's
        temporaries are deq_s's own)."""
        with torch.cuda.stream(self.dequant_queue):
            fn()

    def compute(self, fn: Callable[[], None]) -> None:
        fn()    # kernels issued by fn go to the calling thread's current stream: the compute queue

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_buffer(self, nbytes: int, host_budget: Optional[int] = None,
                    chunk_bytes: Optional[int] = None) -> HostBuffer:
        """Exactly-sized pinned memory: anonymous mmap + torch.frombuffer + cudaHostRegister (docs/streaming.md §4,
        pytorch#32167); pageable, with the reason, when over host_budget or when registration fails.

        chunk_bytes: register in pieces of this size (one piece when None), since one huge registration
        can fail (pytorch#152335). Pieces start on page boundaries, and the caller must never copy a range
        that spans two of them (CUDA refuses it). Over host_budget, only the first pieces that fit in it are
        registered (pinned_nbytes; the rest stays pageable)."""
        buffer = HostBuffer(nbytes, pinned=False, reason="", mapping=HostBuffer.map(nbytes))
        chunk = chunk_bytes or nbytes
        if chunk < nbytes and chunk % PAGE_BYTES:
            raise ValueError(f"pinning pieces of {chunk} bytes do not start on {PAGE_BYTES}-byte pages")
        base = buffer.tensor.data_ptr()
        pieces = [(base + offset, min(chunk, nbytes - offset)) for offset in range(0, nbytes, chunk)
                  if host_budget is None or offset + min(chunk, nbytes - offset) <= host_budget]
        if not pieces:
            buffer.reason = f"{format_bytes(nbytes)} exceeds host_budget {format_bytes(host_budget)}"
            return buffer

        def register(cudart) -> str:
            for i, (ptr, size) in enumerate(pieces):
                err = cudart.cudaHostRegister(ptr, size, 0)   # 0 = cudaHostRegisterDefault
                if int(err) != 0:
                    for registered, _ in pieces[:i]:
                        cudart.cudaHostUnregister(registered)
                    return str(cudart.cudaGetErrorString(err))
            return ""

        def unregister(cudart) -> str:
            errors = [cudart.cudaHostUnregister(ptr) for ptr, _ in pieces]
            return "; ".join(str(cudart.cudaGetErrorString(err)) for err in errors if int(err) != 0)

        def unpin() -> None:
            failure = self._on_helper_thread(unregister)
            if failure:
                raise RuntimeError(f"cudaHostUnregister failed: {failure}")

        failure = self._on_helper_thread(register)
        if failure:
            buffer.reason = f"cudaHostRegister failed: {failure}"
        else:
            buffer.mark_pinned(unpin, sum(size for _, size in pieces))
        return buffer

    def _on_helper_thread(self, calls: Callable[[Any], str]) -> str:
        """Run cudart calls (`calls` gets torch.cuda.cudart()) on a short-lived thread bound to our device;
        return what `calls` returns: '' on success, else the CUDA error text.

        Why a thread: a failed runtime call leaves its code in the calling thread's last-error slot
        (cudaGetLastError), and PyTorch's next kernel-launch check on that thread would report it as its
        own failure. A failed pin is an expected, reported outcome; the helper thread takes the slot away."""
        outcome: list = []

        def run() -> None:
            try:
                torch.cuda.set_device(self.device)
                outcome.append(calls(torch.cuda.cudart()))
            except BaseException as exc:   # carried back to the caller below
                outcome.append(exc)

        helper = threading.Thread(target=run, name="offspec-cudart", daemon=True)
        helper.start()
        helper.join()
        if isinstance(outcome[0], BaseException):
            raise_from_worker(outcome[0], "cudart call")
        return outcome[0]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)   # start-up and shutdown only, never per layer

    def check(self) -> None:
        """CUDA reports its errors on the calls themselves."""

    def close(self) -> None:
        # Pinned sources may be unpinned and unmapped right after this: no copy out of them may still run; and no
        # dequantization may still read a slot when the ring's buffers are freed.
        self.copy_queue.synchronize()
        self.dequant_queue.synchronize()


def make_backend(device: torch.device) -> Union[CpuBackend, CudaBackend]:
    if device.type == "cuda":
        return CudaBackend(device)
    if device.type == "cpu":
        return CpuBackend()
    raise ValueError(f"unsupported compute device {device} (offspec streams to cuda or cpu)")
