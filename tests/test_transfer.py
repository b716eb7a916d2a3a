"""The CPU transfer backend keeps CUDA's event semantics (docs/streaming.md §8), and its failures surface."""
import subprocess
import sys
import threading
import time

import pytest
import torch

from offspec.errors import StoreError
from offspec.stream.transfer import PAGE_BYTES, CpuBackend, CudaBackend, check_copy, make_backend


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.fixture
def backend():
    b = CpuBackend(async_compute=True)
    yield b
    b.close()


def test_never_recorded_event_counts_as_done(backend):
    event = backend.new_event()
    assert event.query()
    event.synchronize()
    event.wait(backend.copy_queue)          # a no-op: nothing queued behind it can block
    marker = backend.new_event()
    marker.record(backend.copy_queue)
    marker.synchronize()


def test_wait_binds_to_the_record_made_before_it(backend):
    """cudaStreamWaitEvent semantics: a re-record after wait() must not move what the wait waits for."""
    first_copy_done, second_copy_done = threading.Event(), threading.Event()
    event, marker = backend.new_event(), backend.new_event()
    backend.copy_queue.submit(first_copy_done.wait)
    event.record(backend.copy_queue)                       # generation 1
    event.wait(backend.compute_queue())                    # binds to generation 1
    marker.record(backend.compute_queue())
    backend.copy_queue.submit(second_copy_done.wait)
    event.record(backend.copy_queue)                       # generation 2, recorded after the wait
    assert not marker.query()
    first_copy_done.set()
    assert wait_until(marker.query), "the compute queue waited for a record made after its wait()"
    assert not event.query()                               # generation 2 is still pending
    second_copy_done.set()
    event.synchronize()
    assert event.query()


def test_caller_thread_compute_queue_runs_at_once():
    b = CpuBackend(async_compute=False)
    try:
        ran = []
        b.compute(lambda: ran.append(threading.current_thread()))
        assert ran == [threading.current_thread()]
        event = b.new_event()
        event.record(b.compute_queue())
        assert event.query()                               # recording on compute is immediate
    finally:
        b.close()


def test_copy_queue_is_fifo_and_copies(backend):
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    done = backend.new_event()
    backend.copy_async(dst, src, src_pinned=False)
    done.record(backend.copy_queue)
    done.synchronize()
    assert torch.equal(dst, src)


def test_copy_checks_dtype_size_and_contiguity(backend):
    with pytest.raises(RuntimeError, match="mismatch"):
        backend.copy_async(torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), src_pinned=False)
    with pytest.raises(RuntimeError, match="mismatch"):
        check_copy(torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="contiguous"):
        check_copy(torch.zeros(8, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)[::2])


def test_worker_exception_reaches_the_caller(backend):
    def broken_copy(dst, src):
        raise ValueError("disk on fire")
    backend.copy_bytes = broken_copy
    done = backend.new_event()
    backend.copy_async(torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8), src_pinned=False)
    done.record(backend.copy_queue)
    with pytest.raises(RuntimeError, match="offspec-copy thread failed.*disk on fire") as info:
        done.synchronize()
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(RuntimeError, match="disk on fire"):   # and every later use fails the same way
        backend.copy_queue.submit(lambda: None)


def test_offspec_errors_pass_through_unchanged(backend):
    def corrupt():
        raise StoreError("layer 3 fails its checksum")
    backend.compute(corrupt)
    event = backend.new_event()
    with pytest.raises(StoreError, match="layer 3"):
        event.record(backend.compute_queue())
        event.synchronize()


def test_close_joins_daemon_threads_and_is_idempotent():
    b = CpuBackend(async_compute=True)
    threads = [b.copy_queue._thread, b.compute_queue()._thread]
    assert all(t.daemon and t.is_alive() for t in threads)
    b.close()
    b.close()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="closed"):
        b.copy_queue.submit(lambda: None)


def test_close_wakes_a_worker_blocked_on_an_event():
    b = CpuBackend(async_compute=True)
    compute_started, compute_busy = threading.Event(), threading.Event()

    def kernel():
        compute_started.set()
        compute_busy.wait()
    b.compute(kernel)                            # the compute worker is held inside a "kernel"
    assert compute_started.wait(timeout=5)       # (close() drops tasks a worker has not started)
    never = b.new_event()
    never.record(b.compute_queue())              # ... so this record cannot complete
    never.wait(b.copy_queue)                     # and the copy worker blocks on it
    assert wait_until(lambda: not b.copy_queue._tasks)   # it has taken that wait and sits in it
    copy_thread = b.copy_queue._thread
    closer = threading.Thread(target=b.close)
    closer.start()
    copy_thread.join(timeout=5)
    assert not copy_thread.is_alive()            # close() woke it although the event never completed
    assert closer.is_alive()                     # close() still joins the busy compute worker
    compute_busy.set()
    closer.join(timeout=5)
    assert not closer.is_alive()


def test_host_buffer_is_exact_and_page_aligned():
    b = CpuBackend()
    try:
        buf = b.host_buffer(12345)
        assert buf.tensor.numel() == 12345 and buf.tensor.dtype == torch.uint8
        assert buf.tensor.data_ptr() % 4096 == 0
        assert not buf.pinned and buf.reason == "cpu device"
        buf.close()
        assert buf.tensor is None
    finally:
        b.close()


def test_cuda_copy_refuses_unpinned_source_claimed_pinned():
    """The §2 assertion runs before any stream is touched (constructed without __init__: no GPU here)."""
    cuda = object.__new__(CudaBackend)
    with pytest.raises(RuntimeError, match="not pinned"):
        cuda.copy_async(torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8), src_pinned=True)


def test_make_backend():
    b = make_backend(torch.device("cpu"))
    assert isinstance(b, CpuBackend)
    b.close()
    with pytest.raises(ValueError, match="unsupported"):
        make_backend(torch.device("meta"))


def test_import_and_cpu_streaming_never_touch_torch_cuda():
    """On a CPU-only torch, torch.cuda calls raise; importing offspec and streaming on CPU must not make any."""
    script = """
import torch
def boom(*a, **k):
    raise AssertionError("torch.cuda touched")
torch.cuda._lazy_init = boom
torch.cuda.Stream = boom
torch.cuda.Event = boom
import offspec.engine.load, offspec.stream.ring, offspec.stream.stores, offspec.stream.transfer
from offspec.stream.transfer import make_backend
b = make_backend(torch.device("cpu"))
e = b.new_event(); e.record(b.copy_queue); e.synchronize()
b.host_buffer(4096).close()
b.close()
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


class FakeCudart:
    """Stands in for torch.cuda.cudart(): records registrations, fails the `fail_at`-th one."""

    def __init__(self, fail_at=None):
        self.registered = {}    # ptr -> size
        self.fail_at = fail_at
        self.threads = set()    # names of the threads that called in

    def cudaHostRegister(self, ptr, size, flags):
        self.threads.add(threading.current_thread().name)
        if len(self.registered) == self.fail_at:
            return 2            # cudaErrorMemoryAllocation
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        del self.registered[ptr]
        return 0

    def cudaGetErrorString(self, err):
        return "out of memory"


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CudaBackend whose cudart is FakeCudart (no GPU here: built without __init__, no stream made)."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    cuda = object.__new__(CudaBackend)
    cuda.device = torch.device("cuda", 0)
    return cuda, fake


def test_cuda_host_buffer_pins_exactly_in_page_aligned_pieces(fake_cuda):
    cuda, fake = fake_cuda
    page = PAGE_BYTES
    buffer = cuda.host_buffer(3 * page + 100, chunk_bytes=2 * page)
    base = buffer.tensor.data_ptr()
    assert buffer.pinned and buffer.reason == ""
    assert fake.registered == {base: 2 * page, base + 2 * page: page + 100}   # exact size, no rounding up
    assert fake.threads == {"offspec-cudart"}        # a failed call's last-error stays off our threads
    buffer.close()
    assert fake.registered == {} and not buffer.pinned


def test_cuda_host_buffer_falls_back_to_pageable_and_says_why(fake_cuda):
    cuda, fake = fake_cuda
    fake.fail_at = 1
    buffer = cuda.host_buffer(4 * PAGE_BYTES, chunk_bytes=PAGE_BYTES)
    assert not buffer.pinned and buffer.reason == "cudaHostRegister failed: out of memory"
    assert fake.registered == {}                     # the pieces pinned before the failure were undone
    over = cuda.host_buffer(4 * PAGE_BYTES, host_budget=PAGE_BYTES)
    assert not over.pinned and "exceeds host_budget" in over.reason
    with pytest.raises(ValueError, match="pages"):
        cuda.host_buffer(4 * PAGE_BYTES, chunk_bytes=PAGE_BYTES + 256)


def test_cuda_host_buffer_over_its_budget_pins_its_first_pieces(fake_cuda):
    """A buffer over host_budget registers the whole pieces that fit in it, first ones first; the rest stays
    pageable, and pinned_at says which bytes an async copy may start from."""
    cuda, fake = fake_cuda
    page = PAGE_BYTES
    buffer = cuda.host_buffer(4 * page, host_budget=2 * page + 100, chunk_bytes=page)
    base = buffer.tensor.data_ptr()
    assert fake.registered == {base: page, base + page: page}
    assert not buffer.pinned and buffer.pinned_nbytes == 2 * page and "the first" in buffer.reason
    assert buffer.pinned_at(0, 2 * page) and buffer.pinned_at(page, page)
    assert not buffer.pinned_at(page, page + 1) and not buffer.pinned_at(3 * page, page)
    buffer.close()
    assert fake.registered == {} and buffer.pinned_nbytes == 0
