"""The CUDA path on a real GPU (docs/streaming.md §8); every test here is skipped without CUDA.

  ring tearing   the CPU protocol tests of test_offload.py, on CUDA streams: layer L holds the value L+1 in
                 every byte; the consumer's "kernel" sleeps on the compute stream (torch.cuda._sleep) before
                 and between its two half-reads, and copies sleep on the copy stream before each of their two
                 halves, so a missing RAW or WAR wait reads a torn or stale layer. 29 layers through 2 and 3
                 slots (29 % N != 0: the wrap-around into the next pass is exercised), several passes.
                 Broken streamers must fail the same harness: proof that it can.
  bitwise        a random 28-layer fp32 model: streamed logits == resident logits, bit for bit, across slot
                 counts, resident-layer budgets, cpu and disk modes, and passes that wrap around.
  sync-debug     a streamed pass under torch.cuda.set_sync_debug_mode("error"): no hidden synchronization.
  sanitizer      under TORCH_CUDA_SANITIZER=1 (scripts/gpu_check.py runs the ring tests so), the CUDA Stream
                 Sanitizer checks every access; the last tests prove it sees the loader thread's copies.

Nothing here touches torch.cuda at import time. Each test takes seconds on a GPU.
"""
import contextlib
import functools
import os
from dataclasses import dataclass

import pytest
import test_offload
import torch
from drivers import forward_one

from offspec.config import ModelConfig, OffloadConfig
from offspec.engine.load import open_target_layers
from offspec.formats.layout import GlobalWeights, LayerLayout, layer_shapes
from offspec.model.forward import Model, ResidentLayers
from offspec.model.kv_cache import KVCache
from offspec.plan.placement import LayerPlan
from offspec.plan.sizes import layer_nbytes
from offspec.stream.ring import LayerStreamer
from offspec.stream.stores import HostArenaStore
from offspec.stream.transfer import PAGE_BYTES, CudaBackend, CudaEvent, check_copy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device "
                                 "(torch.cuda.is_available() is False)")]

SANITIZER = "TORCH_CUDA_SANITIZER" in os.environ   # torch/__init__.py enables CSAN at import when this is set


def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@functools.cache
def cycles_per_ms() -> float:
    """torch.cuda._sleep(cycles) queues a one-thread kernel that spins for `cycles` GPU clock cycles
    (aten/src/ATen/cuda/Sleep.cu) on the current stream; how many cycles make a millisecond here."""
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(1_000_000)                              # warm-up: module load, clocks up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    torch.cuda._sleep(20_000_000)
    end.record(stream)
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)               # elapsed_time is in milliseconds


def sleep_ms(ms: float) -> None:
    """Spin the *current* stream for about `ms` milliseconds (no host wait)."""
    if ms > 0:
        torch.cuda._sleep(int(ms * cycles_per_ms()))


# ---------------------------------------------------------------- ring tearing on CUDA streams

RING = ModelConfig(arch="llama", vocab_size=64, hidden_size=1024, intermediate_size=2048, n_layers=29,
                   n_heads=8, n_kv_heads=8, head_dim=128)   # uint8 layers of ~10.5 MB, no padding inside
N_RING = RING.n_layers   # 29: not a multiple of 2 or 3, so the wrap-around needs the global load counter


@dataclass(frozen=True)
class Regime:
    copy_ms: float   # the copy stream sleeps this long before each half of every layer copy
    read_ms: float   # the compute stream sleeps this long before each half-read of a layer


# Slow copies let compute catch up with the copy stream (a missing RAW wait reads a half-copied or stale
# slot); slow reads let refills catch up with compute (a missing WAR wait overwrites a slot being read).
REGIMES = {"copy-bound": Regime(copy_ms=0.5, read_ms=0.0), "compute-bound": Regime(copy_ms=0.0, read_ms=0.5)}


class SlowCopyBackend(CudaBackend):
    """Each layer copy lands in two halves, with a spin kernel on the copy stream before each half."""

    def __init__(self, device, copy_ms):
        super().__init__(device)
        self.copy_ms = copy_ms

    def copy_async(self, dst, src, *, src_pinned):
        check_copy(dst, src)
        if src_pinned and not src.is_pinned():
            raise RuntimeError("async layer copy from host memory that is not pinned")
        half = dst.numel() // 2
        with torch.cuda.stream(self.copy_queue):   # current stream of the loader thread: copy_s
            sleep_ms(self.copy_ms)
            dst[:half].copy_(src[:half], non_blocking=src_pinned)
            sleep_ms(self.copy_ms)
            dst[half:].copy_(src[half:], non_blocking=src_pinned)


class SkipWaitEvent(CudaEvent):
    """Drops every wait() on one side: the injected bug."""

    def __init__(self, timing, backend, skip_copy_queue):
        super().__init__(timing)
        self._backend = backend
        self._skip_copy_queue = skip_copy_queue   # True: refills skip free[k] (WAR); False: compute skips ready[k]

    def wait(self, queue):
        if (queue is self._backend.copy_queue) == self._skip_copy_queue:
            return
        super().wait(queue)


class NoWarBackend(SlowCopyBackend):
    def new_event(self, timing=False):
        return SkipWaitEvent(timing, self, skip_copy_queue=True)


class NoRawBackend(SlowCopyBackend):
    def new_event(self, timing=False):
        return SkipWaitEvent(timing, self, skip_copy_queue=False)


def sanitizer_mode():
    """CSAN's dispatch mode when TORCH_CUDA_SANITIZER enabled it, else None."""
    if not SANITIZER:
        return None
    from torch.cuda import _sanitizer
    return _sanitizer.cuda_sanitizer.dispatch if _sanitizer.cuda_sanitizer.enabled else None


class SanitizedLoader(LayerStreamer):
    """LayerStreamer whose loader thread is seen by the CUDA Stream Sanitizer.

    CSAN is a TorchDispatchMode entered on the importing thread, and dispatch modes are thread-local: without
    this, the copies the loader thread issues on copy_s never reach CSAN, and it could only check compute."""

    def _loader_main(self):
        mode = sanitizer_mode()
        with mode if mode is not None else contextlib.nullcontext():
            super()._loader_main()


# The broken streamers of the CPU protocol tests (tests/test_offload.py), with the sanitized loader: each
# overrides steps of the ring, SanitizedLoader the loader thread's entry, so they combine.
PerPassSlots = test_offload.per_pass_slots(SanitizedLoader)


class RefillBeforeFree(test_offload.RefillBeforeFree, SanitizedLoader):
    pass


class FreeBeforeRead(test_offload.FreeBeforeRead, SanitizedLoader):
    pass


def filled_layers(cfg):
    """Layer L's tensors all hold the value L + 1."""
    return lambda i: {name: torch.full(shape, i + 1, dtype=torch.uint8) for name, shape in layer_shapes(cfg).items()}


def ring_protocol(regime: str, n_slots: int, n_passes: int = 3, resident=(), backend_cls=SlowCopyBackend,
                  streamer_cls=SanitizedLoader, side_stream: bool = False) -> list:
    """Stream `n_passes` passes of RING through `n_slots` slots. For each layer the compute stream sleeps,
    reads the first half of the layer's tensors (min and max), sleeps, reads the second half; results stay on
    the GPU until the end (no synchronization inside the loop). -> [(pass, layer, [min1, max1, min2, max2])]
    for every read that was not uniformly layer + 1.

    side_stream: the consumer computes on a stream of its own instead of the default stream (the streamer
    must take whatever stream is current on the consumer's thread as its compute queue)."""
    device, r = cuda(), REGIMES[regime]
    cycles_per_ms()                                  # calibrate before the streamer starts
    layout = LayerLayout.of(RING, torch.uint8)
    names = [name for name, _, _ in layout.entries]
    halves = (names[: len(names) // 2], names[len(names) // 2:])
    backend = backend_cls(device, r.copy_ms)
    streamed = [i for i in range(N_RING) if i not in resident]
    store = HostArenaStore.build(filled_layers(RING), layout, streamed, backend, progress=False)
    streamer = None
    try:
        assert store.info().pinned, store.info().reason   # a pageable source copies synchronously: nothing to catch
        compute = torch.cuda.stream(torch.cuda.Stream(device)) if side_stream else contextlib.nullcontext()
        with compute:   # everything the consumer allocates or runs, on its own stream
            resident_layers = {i: layout.views(torch.full((layout.nbytes,), i + 1, dtype=torch.uint8, device=device))
                               for i in resident}
            seen = torch.zeros((n_passes, N_RING, 4), dtype=torch.int16, device=device)   # (pass, layer, 4 reads)
            streamer = streamer_cls(store, backend, N_RING, resident_layers, n_slots)
            consume(streamer, n_passes, halves, r.read_ms, seen)
            torch.cuda.synchronize()
            assert streamer.stats().passes == n_passes
    finally:
        if streamer is not None:
            streamer.close()           # the loader, then the backend (copy stream drained), then the store
        else:
            backend.close()
            store.close()
    seen = seen.cpu()
    return [(p, i, seen[p, i].tolist()) for p in range(n_passes) for i in range(N_RING)
            if not bool((seen[p, i] == i + 1).all())]


def consume(streamer, n_passes, halves, read_ms, seen):
    """The slow consumer; seen (n_passes, N_RING, 4) int16 gets each read's min and max."""
    for p in range(n_passes):
        for layer, w in streamer.pass_layers():
            reads = []
            for half in halves:
                sleep_ms(read_ms)
                values = torch.cat([getattr(w, name).flatten() for name in half])   # one kernel reads the half
                reads += [values.amin(), values.amax()]
            seen[p, layer] = torch.stack(reads)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("n_slots,resident,side_stream", [(2, (), False), (3, (), False), (2, (0, 5), False),
                                                         (3, (0,), True)])
def test_cuda_ring_holds(regime, n_slots, resident, side_stream):
    assert ring_protocol(regime, n_slots, resident=resident, side_stream=side_stream) == []


# The same harness must fail on each bug it claims to catch; a broken streamer that passes fails the test.

def test_cuda_ring_harness_catches_a_missing_raw_wait():
    assert ring_protocol("copy-bound", 2, backend_cls=NoRawBackend) != [], "RAW bug not detected"


def test_cuda_ring_harness_catches_a_missing_war_wait():
    assert ring_protocol("compute-bound", 2, backend_cls=NoWarBackend) != [], "WAR bug not detected"


def test_cuda_ring_harness_catches_free_recorded_before_the_reads():
    assert ring_protocol("compute-bound", 2, streamer_cls=FreeBeforeRead) != [], "early free[k] not detected"


def test_cuda_ring_harness_catches_a_refill_posted_before_free_is_recorded():
    assert ring_protocol("compute-bound", 2, streamer_cls=RefillBeforeFree) != [], "early refill not detected"


def test_cuda_ring_harness_catches_per_pass_slot_mapping():
    """slot = layer % n_slots breaks at the pass boundary when 29 % 3 != 0 (docs/streaming.md, review #3)."""
    assert ring_protocol("compute-bound", 3, streamer_cls=PerPassSlots) != [], "per-pass slots not detected"


# ---------------------------------------------------------------- streamed == resident, bitwise, fp32

MODEL = ModelConfig(arch="llama", vocab_size=256, hidden_size=128, intermediate_size=256, n_layers=28,
                    n_heads=4, n_kv_heads=2, head_dim=32)


def random_model(device):
    g = torch.Generator().manual_seed(0)
    layers = {i: {name: torch.randn(shape, generator=g) * shape[-1] ** -0.5
                  for name, shape in layer_shapes(MODEL).items()} for i in range(MODEL.n_layers)}
    globals_ = GlobalWeights(embed=torch.randn(MODEL.vocab_size, MODEL.hidden_size, generator=g).to(device),
                             final_norm=torch.ones(MODEL.hidden_size, device=device),
                             lm_head=torch.randn(MODEL.vocab_size, MODEL.hidden_size, generator=g).to(device))
    return layers, globals_


def steps(device):
    """(tokens, positions, slots, mask) of a 6-token prefill and two 1-token steps: three passes."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, MODEL.vocab_size, (8,), generator=g).to(device)
    out = []
    for start, end in [(0, 6), (6, 7), (7, 8)]:
        positions = torch.arange(start, end, device=device)                     # (T,) also the slots
        mask = torch.arange(end, device=device)[None, :] <= positions[:, None]  # (T, end) causal
        out.append((tokens[start:end], positions, positions, mask))
    return out


@pytest.mark.parametrize("mode", ["cpu", "disk"])
@pytest.mark.parametrize("n_slots,n_resident", [(2, 0), (3, 0), (2, 3), (3, 2)])
def test_cuda_streamed_logits_equal_resident_bitwise(tmp_path, mode, n_slots, n_resident):
    device = cuda()
    layers, globals_ = random_model(device)
    budget = (n_resident + n_slots) * layer_nbytes(MODEL, torch.float32)
    resident = open_target_layers(layers.__getitem__, MODEL,
                                  LayerPlan.of(MODEL, OffloadConfig(mode="none"), torch.float32),
                                  device, torch.float32, progress=False)
    offload = OffloadConfig(mode=mode, n_slots=n_slots, gpu_budget=budget)
    streamed = open_target_layers(layers.__getitem__, MODEL,
                                  LayerPlan.of(MODEL, offload, torch.float32, store_dir=str(tmp_path)),
                                  device, torch.float32, progress=False)
    with streamed:
        assert isinstance(resident.source, ResidentLayers) and isinstance(streamed.source, LayerStreamer)
        assert streamed.placement.resident == tuple(range(n_resident)) and streamed.placement.n_slots == n_slots
        assert streamed.host.pinned, streamed.host.reason
        models = [Model(MODEL, globals_, resident), Model(MODEL, globals_, streamed)]
        caches = [KVCache.for_model(MODEL, 16, torch.float32, device) for _ in models]
        for _ in range(2):                          # the second round re-runs the passes: wrap-around again
            for tokens, positions, slots, mask in steps(device):
                logits = [forward_one(m, tokens, positions, slots, mask, c) for m, c in zip(models, caches)]
                assert torch.equal(logits[0], logits[1])
        assert streamed.stats().passes == 6


# ---------------------------------------------------------------- no hidden synchronization

@contextlib.contextmanager
def sync_debug_error():
    """Every synchronizing CUDA call raises inside (torch.cuda.set_sync_debug_mode; process-wide, all threads).
    Not flagged by design: cudaEventSynchronize (pt c10/cuda/CUDAEvent.h), which disk mode's staging gates
    use on the loader thread. Flagged, so kept outside: start-up and close (torch.cuda.synchronize), and the
    pageable fallback's blocking copy."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_cuda_stream_loop_does_no_hidden_synchronization(tmp_path, mode):
    device = cuda()
    layers, _ = random_model(device)
    offload = OffloadConfig(mode=mode, n_slots=3, gpu_budget=4 * layer_nbytes(MODEL, torch.float32))
    with open_target_layers(layers.__getitem__, MODEL,
                            LayerPlan.of(MODEL, offload, torch.float32, store_dir=str(tmp_path)),
                            device, torch.float32, progress=False) as target:
        assert target.host.pinned, target.host.reason
        total = torch.zeros((), device=device)
        with sync_debug_error():
            for _ in range(3):
                for _, w in target.source.pass_layers():
                    total += w.down_proj.sum()
            stats = target.stats()                  # harvesting: Event.query and elapsed_time only
        assert torch.isfinite(total).item() and stats.passes == 3


def test_cuda_streamed_forward_does_no_hidden_synchronization():
    device = cuda()
    layers, globals_ = random_model(device)
    offload = OffloadConfig(mode="cpu", n_slots=2, gpu_budget=3 * layer_nbytes(MODEL, torch.float32))
    with open_target_layers(layers.__getitem__, MODEL,
                            LayerPlan.of(MODEL, offload, torch.float32),
                            device, torch.float32, progress=False) as target:
        model = Model(MODEL, globals_, target)
        cache = KVCache.for_model(MODEL, 16, torch.float32, device)
        passes = steps(device)
        forward_one(model, *passes[0], cache)        # warm-up outside: first-call library set-up may synchronize
        with sync_debug_error():
            for tokens, positions, slots, mask in passes:
                logits = forward_one(model, tokens, positions, slots, mask, cache)
        assert torch.isfinite(logits).all().item()


def test_cuda_embedding_and_lm_head_in_host_memory_equal_them_on_the_device(monkeypatch):
    """The plan's embed_on_host / lm_head_on_host: the embedding looked up on the host and the lm_head crossing
    in chunks (four here) give the on-device logits (the chunks' matmuls may round differently: close, not
    bitwise), pass after pass through the streamed target."""
    from dataclasses import replace

    import offspec.model.forward as model_module
    device = cuda()
    layers, globals_ = random_model(device)
    monkeypatch.setattr(model_module, "LM_HEAD_CHUNK_BYTES", MODEL.vocab_size * MODEL.hidden_size)  # float32: 4
    host = replace(globals_, embed=globals_.embed.cpu(), lm_head=globals_.lm_head.cpu())
    offload = OffloadConfig(mode="cpu", n_slots=2, gpu_budget=3 * layer_nbytes(MODEL, torch.float32))
    with open_target_layers(layers.__getitem__, MODEL, LayerPlan.of(MODEL, offload, torch.float32),
                            device, torch.float32, progress=False) as target:
        outs = []
        for g in (globals_, host):
            model = Model(MODEL, g, target)
            assert model.device == device
            cache = KVCache.for_model(MODEL, 16, torch.float32, device)
            outs.append([forward_one(model, *step, cache) for step in steps(device)])
    for on_device, on_host in zip(*outs):
        assert on_host.device == device
        torch.testing.assert_close(on_host, on_device, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- pinned host memory

def test_cuda_host_buffer_is_pinned_and_copies_asynchronously():
    """offspec's exactly-sized pinning (mmap + cudaHostRegister in page-aligned pieces): CUDA sees both pieces
    as pinned, so the async copies' assertion passes, and the bytes arrive. Each copy stays inside one piece,
    as the arena's copies do (a piece holds whole layers): one copy spanning two registrations is refused by
    CUDA with "invalid argument" (docs/streaming.md §4).

    Tensor.is_pinned() asks about its *storage's* first byte (aten/src/ATen/native/Memory.cpp), so a slice
    of the arena always reports piece 0; a tensor whose storage starts in piece 1 asks about piece 1."""
    backend = CudaBackend(cuda())
    piece = 2 * PAGE_BYTES
    nbytes = 3 * PAGE_BYTES + 100
    buffer = backend.host_buffer(nbytes, chunk_bytes=piece)
    try:
        assert buffer.pinned, buffer.reason
        second_piece = torch.frombuffer(memoryview(buffer._mapping)[piece:], dtype=torch.uint8)
        assert buffer.tensor.is_pinned() and second_piece.is_pinned()
        del second_piece
        buffer.tensor.copy_(torch.arange(nbytes) % 251)
        dst = backend.device_buffer(nbytes)
        done = backend.new_event()
        for start in (0, piece):
            backend.copy_async(dst[start:start + piece], buffer.tensor[start:start + piece], src_pinned=True)
        done.record(backend.copy_queue)
        done.synchronize()
        assert torch.equal(dst.cpu(), buffer.tensor)
    finally:
        backend.close()
        buffer.close()
    assert not buffer.pinned


# ---------------------------------------------------------------- the sanitizer sees both threads
# Only under TORCH_CUDA_SANITIZER=1. CSAN keys accesses by data_ptr(), so it checks the slot through the views
# that start at its first byte (input_norm here, as in a real layer); it does not depend on timing at all.

def raised_by_sanitizer(err: BaseException) -> bool:
    from torch.cuda._sanitizer import CUDASanitizerErrors
    while err is not None:
        if isinstance(err, CUDASanitizerErrors):
            return True
        err = err.__cause__
    return False


@pytest.mark.skipif(not SANITIZER, reason="needs TORCH_CUDA_SANITIZER=1")
@pytest.mark.parametrize("backend_cls", [NoRawBackend, NoWarBackend], ids=["raw", "war"])
def test_cuda_sanitizer_catches_a_missing_wait(backend_cls):
    with pytest.raises(Exception) as info:
        ring_protocol("compute-bound", 2, n_passes=1, backend_cls=backend_cls)
    assert raised_by_sanitizer(info.value), info.value
