"""How DiskStore reads layers.bin: O_DIRECT where the filesystem allows it (and the fallback where it refuses),
a block read in pieces by several reader threads, and every failure on a reader thread surfacing as one line."""
import errno
import os
import threading
import time

import pytest
import torch
from test_offload import N_LAYERS, REGIMES, TINY, TearingBackend, filled_layers, random_layers, run_protocol

from offspec.errors import StoreError
from offspec.formats.layout import BLOCK_ALIGN, LayerLayout, layer_shapes
from offspec.stream.disk import LAYERS_BIN, DiskStore, prepare_disk_store
from offspec.stream.ring import LayerStreamer
from offspec.stream.transfer import CpuBackend, HostBuffer, format_bytes

# TINY's float32 block is 11 * BLOCK_ALIGN: with 3 reads in flight, pieces of 4, 4 and 3 blocks.


def o_direct_refusal(directory) -> str:
    """'' when this filesystem takes an aligned O_DIRECT read, else why not (tmpfs and some overlays refuse)."""
    if not hasattr(os, "O_DIRECT"):
        return "no O_DIRECT on this platform"
    path = os.path.join(directory, "probe")
    with open(path, "wb") as f:
        f.write(bytes(BLOCK_ALIGN))
    buffer = HostBuffer.map(BLOCK_ALIGN)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [memoryview(buffer)], 0)
        finally:
            os.close(fd)
    except OSError as err:
        return f"O_DIRECT refused on {directory}: {err}"
    finally:
        os.unlink(path)
    return ""


@pytest.fixture
def store_dir(tmp_path):
    layout = LayerLayout.of(TINY, torch.float32)
    prepare_disk_store(random_layers(TINY).__getitem__, N_LAYERS, layout, str(tmp_path), progress=False)
    return tmp_path


def open_store(directory, **kwargs):
    backend = CpuBackend()
    try:
        return DiskStore(str(directory), LayerLayout.of(TINY, torch.float32), N_LAYERS, backend, **kwargs)
    finally:
        backend.close()   # the tests below only read: no copies, so no backend is needed after opening


def file_block(directory, store, layer) -> bytes:
    """Layer `layer`'s bytes as a plain read of layers.bin sees them (unpadded)."""
    with open(os.path.join(directory, LAYERS_BIN), "rb") as f:
        f.seek(store._offsets[layer])
        return f.read(store.layout.nbytes)


def test_pieces_cover_the_block_in_whole_blocks(store_dir):
    for reads_in_flight, blocks in [(1, [11]), (3, [4, 4, 3]), (4, [3, 3, 3, 2]), (5, [3, 3, 3, 2]), (20, [1] * 11)]:
        store = open_store(store_dir, reads_in_flight=reads_in_flight)
        assert [(end - start) // BLOCK_ALIGN for start, end in store._pieces] == blocks
        assert [start for start, _ in store._pieces[1:]] == [end for _, end in store._pieces[:-1]]
        assert store._pieces[-1][1] == store.block_nbytes == 11 * BLOCK_ALIGN
        n = len(blocks)
        assert store.io.endswith(f", {n} read{'s' * (n > 1)} in flight (≤ {format_bytes(BLOCK_ALIGN * blocks[0])} each)"), store.io
        store.close()


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("reads_in_flight", [1, 3])
def test_reads_equal_the_store_bytes(store_dir, direct_io, reads_in_flight):
    store = open_store(store_dir, direct_io=direct_io, reads_in_flight=reads_in_flight)
    try:
        assert store.io.endswith(f"{reads_in_flight} read{'s' * (reads_in_flight > 1)} in flight "
                                 f"(≤ {format_bytes((44 if reads_in_flight == 1 else 16) * 1024)} each)")
        assert store.info().io == store.io
        for layer in (3, 0, 6, 3):    # twice for layer 3: the second read skips the crc check
            assert store.read_layer(layer).numpy().tobytes() == file_block(store_dir, store, layer)
            assert store.acquire(layer).block.numpy().tobytes() == file_block(store_dir, store, layer)
    finally:
        store.close()
    if not direct_io:
        assert store.io.startswith("buffered (--disk-io buffered); page cache dropped after each read")
    else:
        refusal = o_direct_refusal(store_dir)
        if refusal:
            pytest.skip(f"{refusal}: the O_DIRECT path cannot run here (the fallback read the right bytes)")
        assert store.io.startswith("O_DIRECT, ")


def test_page_cache_dropping_on_each_read_path(store_dir, monkeypatch):
    dropped = []
    fadvise = os.posix_fadvise

    def spy(fd, offset, n, advice):
        dropped.append((offset, n, advice))
        fadvise(fd, offset, n, advice)
    monkeypatch.setattr(os, "posix_fadvise", spy)
    for direct_io, drop_page_cache in [(False, True), (True, False), (True, True)]:
        dropped.clear()
        store = open_store(store_dir, direct_io=direct_io, drop_page_cache=drop_page_cache, reads_in_flight=2)
        store.read_layer(2)
        store.close()
        if not drop_page_cache:                     # buffered, keeping the page cache: no O_DIRECT either
            assert dropped == [] and store.io.startswith("buffered: page cache kept (drop_page_cache=False), ")
        elif store._direct:
            assert dropped == [], store.io          # O_DIRECT caches nothing
        else:
            start = store._offsets[2]
            assert sorted(dropped) == [(start + a, b - a, os.POSIX_FADV_DONTNEED) for a, b in store._pieces]


def refuse_o_direct(monkeypatch, at: str) -> list[int]:
    """Make the filesystem refuse O_DIRECT with EINVAL at open or at the first read; -> the O_DIRECT fds opened."""
    real_open, real_preadv, direct_fds = os.open, os.preadv, []

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT and at == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *args, **kwargs)
        if flags & os.O_DIRECT:
            direct_fds.append(fd)
        return fd

    def fake_preadv(fd, buffers, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)
    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "preadv", fake_preadv)
    return direct_fds


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
@pytest.mark.parametrize("at,message", [("open", "buffered: O_DIRECT refused by the filesystem (EINVAL)"),
                                        ("read", "buffered: O_DIRECT reads refused by the filesystem (EINVAL)")])
def test_refused_o_direct_falls_back_to_buffered_reads(store_dir, monkeypatch, at, message):
    direct_fds = refuse_o_direct(monkeypatch, at)
    store = open_store(store_dir, reads_in_flight=2)
    try:
        assert store.info().io == (f"{message}; page cache dropped after each read, "
                                   f"2 reads in flight (≤ {format_bytes(24 * 1024)} each)")
        assert not store._direct
        for fd in direct_fds:          # the refused descriptor was closed again
            with pytest.raises(OSError):
                os.fstat(fd)
        for layer in range(N_LAYERS):
            assert store.read_layer(layer).numpy().tobytes() == file_block(store_dir, store, layer)
    finally:
        store.close()


def test_no_o_direct_on_the_platform(store_dir, monkeypatch):
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    store = open_store(store_dir)
    assert store.io.startswith("buffered: no O_DIRECT on this platform; page cache dropped after each read")
    assert store.read_layer(1).numpy().tobytes() == file_block(store_dir, store, 1)
    store.close()


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("regime", REGIMES)
def test_ring_protocol_with_reads_in_flight(tmp_path, direct_io, regime):
    """The ring's staging gates with each block read in 3 pieces at once, into both staging buffers in turn."""
    layout = LayerLayout.of(TINY, torch.uint8)      # a 12 KiB block: 3 pieces of one BLOCK_ALIGN
    prepare_disk_store(filled_layers(TINY), N_LAYERS, layout, str(tmp_path), progress=False)
    backend = TearingBackend(5, REGIMES[regime]["copy_sleep"])
    store = DiskStore(str(tmp_path), layout, N_LAYERS, backend, direct_io=direct_io, reads_in_flight=3)
    assert len(store._pieces) == 3
    assert run_protocol(store, backend, 3, 3, REGIMES[regime]["kernel_sleep"]) == []


@pytest.mark.parametrize("direct_io", [True, False])
def test_streamed_layers_equal_checkpoint_bitwise_with_reads_in_flight(store_dir, direct_io):
    weights = random_layers(TINY)
    backend = CpuBackend()
    store = DiskStore(str(store_dir), LayerLayout.of(TINY, torch.float32), N_LAYERS, backend, direct_io=direct_io,
                      reads_in_flight=3)
    with LayerStreamer(store, backend, N_LAYERS, {}, n_slots=2) as streamer:
        for _ in range(2):
            for i, w in streamer.pass_layers():
                for name in layer_shapes(TINY):
                    assert torch.equal(getattr(w, name), weights[i][name]), (i, name)


def fail_piece(monkeypatch, store, layer, piece, err):
    """os.preadv raises `err` when reading the given piece of `layer`; the piece after it reads slowly, so it
    is still running when the failure comes back. -> a list that gets True once that slow piece finished."""
    real_preadv = os.preadv
    fail_at = store._offsets[layer] + store._pieces[piece][0]
    slow_at = store._offsets[layer] + store._pieces[piece + 1][0]
    slow_done = []

    def fake_preadv(fd, buffers, offset):
        if offset == fail_at:
            raise err
        if offset == slow_at:
            time.sleep(0.2)
            count = real_preadv(fd, buffers, offset)
            slow_done.append(True)
            return count
        return real_preadv(fd, buffers, offset)
    monkeypatch.setattr(os, "preadv", fake_preadv)
    return slow_done


@pytest.mark.parametrize("direct_io", [True, False])
def test_reader_thread_errors_surface_as_one_line(store_dir, monkeypatch, direct_io):
    store = open_store(store_dir, direct_io=direct_io, reads_in_flight=3)
    slow_done = fail_piece(monkeypatch, store, layer=5, piece=1, err=OSError(errno.EIO, "Input/output error"))
    with pytest.raises(StoreError, match=f"^reading layer 5 from .*{LAYERS_BIN} failed: Input/output error$"):
        store.read_layer(5)
    assert slow_done == [True]     # the other pieces had finished before the error was raised
    assert store.read_layer(4).numpy().tobytes() == file_block(store_dir, store, 4)   # the pool still works
    reader_threads = list(store._pool._threads)
    store.close()
    assert reader_threads and not any(t.is_alive() for t in reader_threads)


def test_reader_thread_errors_surface_through_the_streamer(store_dir, monkeypatch):
    backend = CpuBackend()
    store = DiskStore(str(store_dir), LayerLayout.of(TINY, torch.float32), N_LAYERS, backend, reads_in_flight=3)
    fail_piece(monkeypatch, store, layer=4, piece=1, err=OSError(errno.EIO, "Input/output error"))
    streamer = LayerStreamer(store, backend, N_LAYERS, {}, n_slots=2)
    seen = []
    with pytest.raises(StoreError, match="reading layer 4 from .* failed: Input/output error"):
        for i, _ in streamer.pass_layers():
            seen.append(i)
    assert seen == [0, 1, 2, 3]
    reader_threads = list(store._pool._threads)
    streamer.close()
    assert not any(t.is_alive() for t in reader_threads + [streamer._loader])


def test_unexpected_reader_thread_errors_are_not_swallowed(store_dir, monkeypatch):
    backend = CpuBackend()
    store = DiskStore(str(store_dir), LayerLayout.of(TINY, torch.float32), N_LAYERS, backend, reads_in_flight=3)
    fail_piece(monkeypatch, store, layer=2, piece=0, err=ValueError("a bug in a reader"))
    with LayerStreamer(store, backend, N_LAYERS, {}, n_slots=2) as streamer:
        with pytest.raises(RuntimeError, match="layer loader thread failed: ValueError..a bug in a reader"):
            for _ in streamer.pass_layers():
                pass


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("reads_in_flight", [1, 3])
@pytest.mark.parametrize("cut", [0, 1000], ids=["at-a-block", "mid-block"])
def test_file_truncated_after_open(store_dir, direct_io, reads_in_flight, cut):
    """The size check at open cannot see a file cut later: the read must still say the file ends in the layer."""
    store = open_store(store_dir, direct_io=direct_io, reads_in_flight=reads_in_flight)
    try:
        os.truncate(store_dir / LAYERS_BIN, store._offsets[5] + 5 * BLOCK_ALIGN + cut)   # inside piece 1
        with pytest.raises(StoreError, match=f"{LAYERS_BIN} ends inside layer 5: delete .* to rebuild the store"):
            store.read_layer(5)
        assert store.read_layer(4).numpy().tobytes() == file_block(store_dir, store, 4)
    finally:
        store.close()


def test_close_stops_the_reader_threads_and_is_idempotent(store_dir):
    before = set(threading.enumerate())             # other tests' stores in this process may still have theirs
    store = open_store(store_dir, reads_in_flight=4)
    store.read_layer(0)
    threads = [t for t in threading.enumerate() if t.name.startswith("offspec-reader") and t not in before]
    assert 1 <= len(threads) <= 4
    store.close()
    store.close()
    assert not any(t.is_alive() for t in threads)


def test_reads_in_flight_must_be_positive(store_dir):
    with pytest.raises(ValueError, match="reads_in_flight=0"):
        open_store(store_dir, reads_in_flight=0)


def test_reads_run_one_layer_ahead(store_dir, monkeypatch):
    store = open_store(store_dir, reads_in_flight=3)
    try:
        assert store.acquire(2, next_layer=3).block.numpy().tobytes() == file_block(store_dir, store, 2)
        layer, pieces = store._ahead
        assert layer == 3 and len(pieces) == 3
        wait_for = time.monotonic() + 10
        while not all(p.done() for p in pieces) and time.monotonic() < wait_for:
            time.sleep(0.001)
        monkeypatch.setattr(os, "preadv", None)           # layer 3 must need no read any more
        assert store.acquire(3).block.numpy().tobytes() == file_block(store_dir, store, 3)
        monkeypatch.undo()
        store.acquire(4, next_layer=5)
        assert store.acquire(1).block.numpy().tobytes() == file_block(store_dir, store, 1)   # not the one ahead
    finally:
        store.close()


def test_read_ahead_errors_surface_when_that_layer_is_asked_for(store_dir, monkeypatch):
    store = open_store(store_dir, reads_in_flight=3)
    fail_piece(monkeypatch, store, layer=3, piece=0, err=OSError(errno.EIO, "Input/output error"))
    try:
        store.acquire(2, next_layer=3)
        with pytest.raises(StoreError, match="reading layer 3 from .* failed: Input/output error"):
            store.acquire(3)
    finally:
        store.close()


class GatelessReadAhead(DiskStore):
    """The injected bug: reads ahead into a staging buffer without waiting for the copy out of it."""

    def _start(self, layer, out, gate=None):
        return super()._start(layer, out, gate=None)


def test_protocol_test_catches_a_read_ahead_that_skips_the_staging_gate(tmp_path):
    layout = LayerLayout.of(TINY, torch.uint8)
    prepare_disk_store(filled_layers(TINY), N_LAYERS, layout, str(tmp_path), progress=False)
    backend = TearingBackend(5, REGIMES["copy-bound"]["copy_sleep"])
    store = GatelessReadAhead(str(tmp_path), layout, N_LAYERS, backend, reads_in_flight=3)
    assert run_protocol(store, backend, 3, 3, REGIMES["copy-bound"]["kernel_sleep"]) != []
