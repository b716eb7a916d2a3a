"""Layer streaming on CPU: the ring protocol (docs/streaming.md §8), streamed == resident bitwise, the disk store's
validation and crash safety, bounded host memory in disk mode, and the device budget."""
import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch
from drivers import forward_one

from offspec.config import ModelConfig, OffloadConfig
from offspec.engine.load import open_target_layers
from offspec.errors import BudgetError, InputError, StoreError
from offspec.formats.layout import BLOCK_ALIGN, LAYER_PARTS, GlobalWeights, LayerLayout, arena_stride, layer_shapes
from offspec.model.forward import Model, ResidentLayers
from offspec.model.kv_cache import KVCache
from offspec.plan.placement import LayerPlan, place_layers
from offspec.plan.sizes import layer_nbytes
from offspec.stream.disk import (
    LAYERS_BIN,
    MANIFEST,
    DiskStore,
    disk_store_exists,
    prepare_disk_store,
    store_fingerprint,
)
from offspec.stream.ring import LayerStreamer
from offspec.stream.stores import HostArenaStore
from offspec.stream.transfer import PAGE_BYTES, CpuBackend, CpuEvent

CPU = torch.device("cpu")
TINY = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=7,
                   n_heads=2, n_kv_heads=2, head_dim=16)
N_LAYERS = TINY.n_layers   # 7: not a multiple of 2 or 3, so wrap-around needs the global load counter


def random_layers(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {i: {name: torch.randn(shape, generator=g) for name, shape in layer_shapes(cfg).items()}
            for i in range(cfg.n_layers)}


def filled_layers(cfg, dtype=torch.uint8):
    """Layer L's tensors all hold the value L + 1."""
    return lambda i: {name: torch.full(shape, i + 1, dtype=dtype) for name, shape in layer_shapes(cfg).items()}


# ---------------------------------------------------------------- the ring protocol (docs/streaming.md §8)

# Seconds a copy sleeps between its halves, and a kernel between its two reads. Each regime exposes one
# hazard: when copies are slow, compute catches up with the copy queue (a missing RAW wait reads a
# half-copied slot); when kernels are slow, refills catch up with compute (a missing WAR wait overwrites a
# slot still being read).
REGIMES = {
    "copy-bound": dict(copy_sleep=(0.001, 0.003), kernel_sleep=(0.0, 0.0005)),
    "compute-bound": dict(copy_sleep=(0.0, 0.0005), kernel_sleep=(0.0005, 0.002)),
}


class TearingBackend(CpuBackend):
    """Compute runs on its own worker (the host runs ahead, as with a GPU), and every copy lands in two
    halves with a random sleep between: an unordered reader sees a torn or stale block."""

    def __init__(self, seed, copy_sleep, async_compute=True):
        super().__init__(async_compute=async_compute)
        self._rng = random.Random(seed)
        self._copy_sleep = copy_sleep

    def copy_bytes(self, dst, src):
        half = dst.numel() // 2
        dst[:half].copy_(src[:half])
        time.sleep(self._rng.uniform(*self._copy_sleep))
        dst[half:].copy_(src[half:])

    def on_dequant_queue(self, fn):
        """A quantized layer's dequantization starts after a random sleep: a reader of the block or of the dense
        layer that is not ordered against it sees the wrong layer."""
        sleep = self._rng.uniform(0, self._copy_sleep[1])   # at times shorter than a copy, at times longer
        super().on_dequant_queue(lambda: (time.sleep(sleep), fn()))


class SkipWaitEvent(CpuEvent):
    """Drops every wait() on one kind of queue: the injected bug."""
    # True: refills stop waiting for free[k] (WAR); False: compute stops waiting for ready[k] (RAW)
    skip_copy_queue = True

    def wait(self, queue):
        if (queue is self._backend.copy_queue) == self.skip_copy_queue:
            return
        super().wait(queue)


class SkipDequantWaits(CpuEvent):
    """Drops every wait() on the dequantization queue (its RAW on the block and its WAR on the dense layer)."""

    def wait(self, queue):
        if queue is not self._backend.dequant_queue:
            super().wait(queue)


class NoDequantWaitBackend(TearingBackend):
    def new_event(self, timing=False):
        return SkipDequantWaits(self)


class NoWarBackend(TearingBackend):
    def new_event(self, timing=False):
        return SkipWaitEvent(self)


class NoRawBackend(TearingBackend):
    def new_event(self, timing=False):
        event = SkipWaitEvent(self)
        event.skip_copy_queue = False
        return event


def per_pass_slots(base: type = LayerStreamer) -> type:
    """A subclass of `base` (a LayerStreamer) with the bug of docs/streaming.md review #3: each load's slot taken
    from its layer index (slot = layer % n_slots, a per-pass counter) instead of the load counter n % n_slots.
    It overrides the methods of ring.py that map a load number to its slot with their own source, recompiled
    with that one change, so the harness is shown to catch the bug in the code it tests."""
    import __future__

    import inspect
    import textwrap

    from offspec.stream import ring
    correct, buggy = "n % self.n_slots", "self.streamed[n % len(self.streamed)] % self.n_slots"
    methods, changed = {}, 0
    for name, method in vars(ring.LayerStreamer).items():
        source = inspect.getsource(method) if inspect.isfunction(method) else ""
        if correct in source:
            namespace = dict(vars(ring))
            exec(compile(textwrap.dedent(source).replace(correct, buggy), ring.__file__, "exec",
                         __future__.annotations.compiler_flag), namespace)
            methods[name], changed = namespace[name], changed + source.count(correct)
    assert changed == 4, "ring.py computes load n's slot as n % self.n_slots in four places (_take, _release, ...)"
    return type(f"PerPassSlots{base.__name__}", (base,), methods)


class RefillBeforeFree(LayerStreamer):
    def _release(self, n, comp_q):
        k = n % self.n_slots
        self._released = n + 1
        self._post_loads()                 # the bug: the refill is posted before free[k] is recorded ...
        time.sleep(0.002)                  # (widening the window in which the loader binds to the old record)
        self._free[k].record(comp_q)


class FreeBeforeRead(LayerStreamer):
    def _take(self, n, comp_q):
        k = super()._take(n, comp_q)
        self._free[k].record(comp_q)       # the bug: free[k] recorded before the consumer's kernels on slot k
        return k

    def _release(self, n, comp_q):
        self._released = n + 1
        self._post_loads()


def run_protocol(store, backend, n_slots, n_passes, kernel_sleep, resident=(), streamer_cls=LayerStreamer,
                 overlap=True, seed=1, split=False):
    """Stream `n_passes` passes; each "kernel" reads its layer (split: each part of it) in two halves with a
    sleep between, on the compute queue. -> [(pass, layer, values seen)] for every read that was not uniformly
    layer + 1."""
    layout = store.layout
    names = [name for name, _, _ in getattr(layout, "dense", layout).entries]   # what a (dequantized) layer reads
    rng = random.Random(seed)
    bad, seen = [], []
    resident_layers = {i: layout.views(torch.full((layout.nbytes,), i + 1, dtype=torch.uint8)) for i in resident}

    def kernel(pass_no, layer, weights):
        tensors = [getattr(weights, n).flatten() for n in names if getattr(weights, n) is not None]
        first = torch.cat([t[: t.numel() // 2] for t in tensors]).clone()
        time.sleep(rng.uniform(*kernel_sleep))
        second = torch.cat([t[t.numel() // 2:] for t in tensors])
        values = torch.cat([first, second]).unique().tolist()
        seen.append((pass_no, layer))
        if values != [layer + 1]:
            bad.append((pass_no, layer, values))

    streamer = streamer_cls(store, backend, N_LAYERS, resident_layers, n_slots, overlap=overlap, split=split)
    try:
        for pass_no in range(n_passes):
            for layer, weights in streamer.pass_layers():
                backend.compute(lambda p=pass_no, i=layer, w=weights: kernel(p, i, w))
        drained = backend.new_event()
        drained.record(backend.compute_queue())
        drained.synchronize()
        assert streamer.stats().passes == n_passes
    finally:
        streamer.close()
    loads = {i: 1 if i in resident or not split else len(LAYER_PARTS) for i in range(N_LAYERS)}
    assert seen == [(p, i) for p in range(n_passes) for i in range(N_LAYERS) for _ in range(loads[i])]
    return bad


def arena_protocol(regime, n_slots, n_passes=4, seed=1, backend_cls=TearingBackend, resident=(), **kwargs):
    layout = LayerLayout.of(TINY, torch.uint8)
    backend = backend_cls(seed, REGIMES[regime]["copy_sleep"])
    streamed = [i for i in range(N_LAYERS) if i not in resident]
    store = HostArenaStore.build(filled_layers(TINY), layout, streamed, backend, progress=False)
    return run_protocol(store, backend, n_slots, n_passes, REGIMES[regime]["kernel_sleep"], resident=resident,
                        seed=seed, **kwargs)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("n_slots,overlap", [(1, False), (2, True), (3, True), (2, False)])
def test_ring_protocol_arena(regime, n_slots, overlap):
    assert arena_protocol(regime, n_slots, overlap=overlap, seed=n_slots) == []


@pytest.mark.parametrize("regime", REGIMES)
def test_ring_protocol_with_resident_layers(regime):
    assert arena_protocol(regime, 2, resident=(0, 3), seed=7) == []


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("n_slots", [2, 3])
def test_ring_protocol_disk_staging(tmp_path, regime, n_slots):
    """Disk mode adds the staging buffers and their gates (host-side WAR)."""
    layout = LayerLayout.of(TINY, torch.uint8)
    prepare_disk_store(filled_layers(TINY), N_LAYERS, layout, str(tmp_path), progress=False)
    backend = TearingBackend(10 + n_slots, REGIMES[regime]["copy_sleep"])
    store = DiskStore(str(tmp_path), layout, N_LAYERS, backend)
    assert run_protocol(store, backend, n_slots, 3, REGIMES[regime]["kernel_sleep"]) == []


def test_ring_protocol_synchronous_compute():
    """What offspec runs on CPU: compute on the caller's thread (only the copies are torn)."""
    layout = LayerLayout.of(TINY, torch.uint8)
    backend = TearingBackend(3, REGIMES["copy-bound"]["copy_sleep"], async_compute=False)
    store = HostArenaStore.build(filled_layers(TINY), layout, range(N_LAYERS), backend, progress=False)
    assert run_protocol(store, backend, 2, 3, kernel_sleep=(0.0, 0.0005)) == []


# The same harness must fail on each bug docs/streaming.md §8 says it catches: proof that the tests above can fail.

def test_protocol_test_catches_a_missing_war_wait():
    assert arena_protocol("compute-bound", 2, backend_cls=NoWarBackend) != []


def test_protocol_test_catches_a_missing_raw_wait():
    assert arena_protocol("copy-bound", 2, backend_cls=NoRawBackend) != []


def test_protocol_test_catches_a_refill_posted_before_free_is_recorded():
    assert arena_protocol("compute-bound", 2, streamer_cls=RefillBeforeFree) != []


def test_protocol_test_catches_free_recorded_before_the_reader():
    assert arena_protocol("compute-bound", 2, streamer_cls=FreeBeforeRead) != []


def quantized_protocol(regime, n_slots, backend_cls=TearingBackend, n_passes=4, seed=1):
    """The ring with int8-quantized blocks (each layer's int8 values L + 1 and scales 1, so its dequantized layer
    holds L + 1 throughout): copy, dequantization and compute on three queues, each delayed at random."""
    from offspec.formats.quant import QuantizedLayout
    layout = QuantizedLayout.of(TINY, torch.float32, "int8")
    backend = backend_cls(seed, REGIMES[regime]["copy_sleep"])

    def fill(layer, block):
        for name, piece in layout.pieces(block).items():
            piece.fill_(1 if name.endswith(".scale") else layer + 1)
    store = HostArenaStore.filled(fill, layout, range(N_LAYERS), backend, progress=False)
    return run_protocol(store, backend, n_slots, n_passes, REGIMES[regime]["kernel_sleep"], seed=seed)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("n_slots", [2, 3])
def test_ring_protocol_quantized(regime, n_slots):
    """copied[k] orders each copy before its dequantization, free[k] each dequantization after compute has read
    the slot's previous dense layer, ready[k] compute after the dequantization and the next copy into the block
    after it has been read (docs/streaming.md §1)."""
    assert quantized_protocol(regime, n_slots, seed=n_slots) == []


@pytest.mark.parametrize("backend_cls,regime", [(NoDequantWaitBackend, "copy-bound"),
                                                (NoDequantWaitBackend, "compute-bound"),
                                                (NoWarBackend, "copy-bound"), (NoRawBackend, "copy-bound")])
def test_the_harness_catches_a_missing_wait_of_the_quantized_ring(backend_cls, regime):
    """(Timing decides whether one run meets the hazard: three seeds of six passes each, any one catching it.)"""
    assert any(quantized_protocol(regime, 2, backend_cls=backend_cls, n_passes=6, seed=seed) != []
               for seed in range(3))


def test_protocol_test_catches_per_pass_slot_mapping():
    """slot = layer % n_slots breaks at the pass boundary when 7 % n_slots != 0 (docs/streaming.md, review #3).
    (Timing decides whether one run meets the hazard: three seeds of six passes each, any one catching it.)"""
    buggy = per_pass_slots()
    assert any(arena_protocol("compute-bound", 2, n_passes=6, seed=seed, streamer_cls=buggy) != [] for seed in range(3))


@pytest.mark.parametrize("n_slots", [2, 3])
def test_slots_follow_the_load_counter_across_passes(n_slots):
    """The n-th streamed layer yielded, counted across passes, sits in slot n % n_slots: the views of any n_slots
    consecutive layers lie in n_slots different slots, also across a pass boundary (7 layers: 7 % n_slots != 0)."""
    layout = LayerLayout.of(TINY, torch.uint8)
    backend = CpuBackend()
    store = HostArenaStore.build(filled_layers(TINY), layout, range(N_LAYERS), backend, progress=False)
    name = layout.entries[0][0]
    with LayerStreamer(store, backend, N_LAYERS, {}, n_slots) as streamer:
        slots = [getattr(weights, name).data_ptr() for _ in range(3) for _, weights in streamer.pass_layers()]
    assert len(set(slots)) == n_slots
    assert all(len(set(slots[i:i + n_slots])) == n_slots for i in range(len(slots) - n_slots + 1))


# ---------------------------------------------------------------- streamed == resident, bitwise

def budget_for(n_resident, n_slots, dtype=torch.float32):
    return (n_resident + n_slots) * layer_nbytes(TINY, dtype)


def passes_equal_checkpoint(source, weights, passes=3):
    """Each of `passes` passes yields every layer of TINY in order, equal to the checkpoint's bit for bit."""
    for _ in range(passes):
        order = []
        for i, w in source.pass_layers():
            order.append(i)
            for name in layer_shapes(TINY):
                assert torch.equal(getattr(w, name), weights[i][name]), (i, name)
        assert order == list(range(N_LAYERS))


@pytest.mark.parametrize("mode", ["cpu", "disk"])
@pytest.mark.parametrize("n_slots,n_resident", [(2, 0), (3, 0), (2, 2), (3, 1)])
def test_streamed_layers_equal_checkpoint_bitwise(tmp_path, mode, n_slots, n_resident):
    weights = random_layers(TINY)
    budget = budget_for(n_resident, n_slots) if n_resident else None
    offload = OffloadConfig(mode=mode, n_slots=n_slots, gpu_budget=budget)
    with open_target_layers(weights.__getitem__, TINY,
                            LayerPlan.of(TINY, offload, torch.float32, store_dir=str(tmp_path / "store")),
                            CPU, torch.float32, progress=False) as target:
        assert target.placement.resident == tuple(range(n_resident))
        assert target.placement.n_slots == n_slots
        assert isinstance(target.source, LayerStreamer)
        passes_equal_checkpoint(target.source, weights)
        stats = target.stats()
    assert stats.passes == 3
    assert stats.layers >= 3 * (N_LAYERS - n_resident)
    assert stats.bytes == stats.layers * layer_nbytes(TINY, torch.float32)
    assert stats.transfer_s > 0 and stats.wait_s >= 0
    assert (stats.read_s > 0) == (mode == "disk")


@pytest.mark.parametrize("n_host,n_resident,n_slots", [(3, 0, 2), (1, 2, 2), (4, 1, 3), (5, 0, 2)])
def test_tiered_layers_equal_checkpoint_bitwise(tmp_path, n_host, n_resident, n_slots):
    """cpu+disk: the placement's host layers copied from the arena, the others read from the store, through one
    ring, pass after pass: each layer equals the checkpoint's bit for bit, in order, and only the disk tier is
    read from the drive."""
    from offspec.formats.quant import target_layout
    from offspec.stream.stores import TieredStore
    weights = random_layers(TINY)
    stride = arena_stride(target_layout(TINY, torch.float32, "none").nbytes)
    offload = OffloadConfig(mode="cpu+disk", n_slots=n_slots, host_budget=n_host * stride,
                            gpu_budget=budget_for(n_resident, n_slots) if n_resident else None)
    plan = LayerPlan.of(TINY, offload, torch.float32, store_dir=str(tmp_path / "store"))
    p = plan.placement
    assert p.mode == "cpu+disk" and len(p.host_layers) == n_host and p.resident == tuple(range(n_resident))
    assert sorted(p.host_layers + p.disk_layers) == list(p.streamed)
    with open_target_layers(weights.__getitem__, TINY, plan, CPU, torch.float32, progress=False) as target:
        assert isinstance(target.source.store, TieredStore) and target.host.kind == "host arena + disk store"
        passes_equal_checkpoint(target.source, weights)
        stats = target.stats()
    assert stats.passes == 3 and stats.layers >= 3 * len(p.streamed) and stats.read_s > 0


@pytest.mark.parametrize("arch,extra", [("qwen2", dict(attention_bias=True)), ("qwen3", dict(qk_norm=True))])
def test_bf16_cast_on_pack_and_qwen_extras(tmp_path, arch, extra):
    """Qwen2's q/k/v biases and Qwen3's per-head q/k norms are packed, streamed and cast like the matrices."""
    cfg = ModelConfig(arch=arch, vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=5,
                      n_heads=4, n_kv_heads=2, head_dim=8, **extra)
    weights = random_layers(cfg, seed=3)
    for mode in ("cpu", "disk"):
        offload = OffloadConfig(mode=mode, n_slots=2)
        with open_target_layers(weights.__getitem__, cfg,
                                LayerPlan.of(cfg, offload, torch.bfloat16, store_dir=str(tmp_path / "store")),
                                CPU, torch.bfloat16, progress=False) as target:
            for _ in range(2):
                for i, w in target.source.pass_layers():
                    extra = w.q_bias if arch == "qwen2" else w.k_norm
                    assert extra is not None and extra.dtype == torch.bfloat16
                    for name in layer_shapes(cfg):
                        assert torch.equal(getattr(w, name), weights[i][name].to(torch.bfloat16)), (mode, i, name)


def test_streamed_model_logits_equal_resident_bitwise(tmp_path):
    """The whole forward: a streamed target gives exactly the resident target's logits, pass after pass."""
    weights = random_layers(TINY, seed=1)
    g = torch.Generator().manual_seed(2)
    embed = torch.randn(TINY.vocab_size, TINY.hidden_size, generator=g)
    globals_ = GlobalWeights(embed=embed, final_norm=torch.ones(TINY.hidden_size),
                             lm_head=torch.randn(TINY.vocab_size, TINY.hidden_size, generator=g))
    resident = open_target_layers(weights.__getitem__, TINY,
                                  LayerPlan.of(TINY, OffloadConfig(mode="none"), torch.float32),
                                  CPU, torch.float32, progress=False)
    assert isinstance(resident.source, ResidentLayers)
    streamed = open_target_layers(weights.__getitem__, TINY,
                                  LayerPlan.of(TINY, OffloadConfig(mode="disk", n_slots=3), torch.float32,
                                               store_dir=str(tmp_path)),
                                  CPU, torch.float32, progress=False)
    models = [Model(TINY, globals_, resident), Model(TINY, globals_, streamed)]   # TargetLayers is a LayerSource
    caches = [KVCache.for_model(TINY, 16, torch.float32, CPU) for _ in models]
    tokens = torch.randint(0, TINY.vocab_size, (8,), generator=g)
    with streamed:
        for start, end in [(0, 5), (5, 8)]:                 # prefill, then a continuation over the cache
            positions = torch.arange(start, end)            # (T,)
            mask = torch.arange(end)[None, :] <= positions[:, None]      # (T, end) causal
            logits = [forward_one(m, tokens[start:end], positions, positions, mask, c) for m, c in zip(models, caches)]
            assert torch.equal(logits[0], logits[1])


def test_abandoned_pass_is_finished_before_the_next(tmp_path):
    weights = random_layers(TINY)
    with open_target_layers(weights.__getitem__, TINY,
                            LayerPlan.of(TINY, OffloadConfig(mode="cpu", n_slots=3), torch.float32),
                            CPU, torch.float32, progress=False) as target:
        for i, _ in target.source.pass_layers():
            if i == 3:
                break                                       # a consumer that fails mid-pass
        for _ in range(2):
            for i, w in target.source.pass_layers():
                assert torch.equal(w.up_proj, weights[i]["up_proj"]), i
        assert target.stats().passes == 2


def test_arena_pins_in_whole_layer_pieces(monkeypatch):
    """No layer may straddle two pinned registrations, and every piece starts on a page."""
    import offspec.formats.layout as layout_module
    layout = LayerLayout.of(TINY, torch.float32)
    stride = arena_stride(layout.nbytes)
    monkeypatch.setattr(layout_module, "PIN_CHUNK_BYTES", 3 * stride + 1)
    asked = {}

    class Recording(CpuBackend):
        def host_buffer(self, nbytes, host_budget=None, chunk_bytes=None):
            asked.update(nbytes=nbytes, chunk_bytes=chunk_bytes)
            return super().host_buffer(nbytes, host_budget, chunk_bytes)
    backend = Recording()
    weights = random_layers(TINY)
    store = HostArenaStore.build(weights.__getitem__, layout, range(N_LAYERS), backend, progress=False)
    assert asked == {"nbytes": N_LAYERS * stride, "chunk_bytes": 3 * stride}
    base = store.block(0).data_ptr()
    for i in range(N_LAYERS):
        start = store.block(i).data_ptr() - base
        assert start % PAGE_BYTES == 0
        assert start // asked["chunk_bytes"] == (start + layout.nbytes - 1) // asked["chunk_bytes"]
        assert torch.equal(layout.views(store.block(i)).k_proj, weights[i]["k_proj"])
    store.close()
    backend.close()


def test_an_arena_pinned_in_part_stages_its_pinned_layers_as_pinned(monkeypatch):
    """An arena over its pinned budget has its first pieces pinned (transfer.HostBuffer.pinned_nbytes): a layer in
    them is staged pinned (its copy asynchronous), one past them pageable; the store says how much is pinned."""
    import offspec.formats.layout as layout_module
    from offspec.stream.transfer import HostBuffer
    layout = LayerLayout.of(TINY, torch.float32)
    stride = arena_stride(layout.nbytes)
    monkeypatch.setattr(layout_module, "PIN_CHUNK_BYTES", stride)       # a piece a layer

    class PinsWhatFits(CpuBackend):                                      # registers as CUDA would, but nothing
        def host_buffer(self, nbytes, host_budget=None, chunk_bytes=None):
            buffer = HostBuffer(nbytes, pinned=False, reason="", mapping=HostBuffer.map(nbytes))
            fits = (host_budget // chunk_bytes) * chunk_bytes
            buffer.mark_pinned(lambda: None, min(fits, nbytes))
            return buffer
    backend = PinsWhatFits()
    weights = random_layers(TINY)
    store = HostArenaStore.build(weights.__getitem__, layout, range(N_LAYERS), backend, host_budget=2 * stride + 1,
                                 progress=False)
    try:
        assert [store.acquire(i).pinned for i in range(N_LAYERS)] == [True, True] + [False] * (N_LAYERS - 2)
        info = store.info()
        assert not info.pinned and info.pinned_nbytes == 2 * stride and "the first" in info.reason
    finally:
        store.close()
        backend.close()


def test_loader_errors_surface_and_close_is_clean():
    layout = LayerLayout.of(TINY, torch.float32)
    backend = CpuBackend()
    store = HostArenaStore.build(lambda i: random_layers(TINY)[i], layout, range(N_LAYERS), backend, progress=False)
    real_acquire = store.acquire

    def acquire(layer, next_layer=None):
        if layer == 4:
            raise OSError("read error on layer 4")
        return real_acquire(layer, next_layer)
    store.acquire = acquire
    streamer = LayerStreamer(store, backend, N_LAYERS, {}, n_slots=2)
    with pytest.raises(RuntimeError, match="loader thread failed.*layer 4"):
        for _ in streamer.pass_layers():
            pass
    loader = streamer._loader
    streamer.close()
    assert not loader.is_alive() and not backend.copy_queue._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        next(streamer.pass_layers())


def test_one_pass_at_a_time():
    weights = random_layers(TINY)
    with open_target_layers(weights.__getitem__, TINY,
                            LayerPlan.of(TINY, OffloadConfig(mode="cpu"), torch.float32),
                            CPU, torch.float32, progress=False) as target:
        outer = target.source.pass_layers()
        next(outer)
        with pytest.raises(RuntimeError, match="already running"):
            next(target.source.pass_layers())
        outer.close()


def test_stats_reset():
    weights = random_layers(TINY)
    with open_target_layers(weights.__getitem__, TINY,
                            LayerPlan.of(TINY, OffloadConfig(mode="cpu"), torch.float32),
                            CPU, torch.float32, progress=False) as target:
        for _ in target.source.pass_layers():
            pass
        target.source.reset_stats()
        assert target.stats().passes == 0
        for _ in target.source.pass_layers():
            pass
        assert target.stats().passes == 1


# ---------------------------------------------------------------- disk store validation and crash safety

@pytest.fixture
def store_dir(tmp_path):
    layout = LayerLayout.of(TINY, torch.float32)
    prepare_disk_store(random_layers(TINY).__getitem__, N_LAYERS, layout, str(tmp_path), progress=False,
                       source_id="tiny-v1")
    return tmp_path


def open_store(directory, dtype=torch.float32, source_id="tiny-v1"):
    backend = CpuBackend()
    try:
        return DiskStore(str(directory), LayerLayout.of(TINY, dtype), N_LAYERS, backend, source_id=source_id)
    finally:
        backend.close()


def test_store_files_are_aligned(store_dir):
    manifest = json.loads((store_dir / MANIFEST).read_text())
    block = manifest["block_nbytes"]
    assert block % BLOCK_ALIGN == 0 and block >= layer_nbytes(TINY, torch.float32)
    assert [e["offset"] for e in manifest["layers"]] == [i * block for i in range(N_LAYERS)]
    assert (store_dir / LAYERS_BIN).stat().st_size == manifest["file_size"] == N_LAYERS * block
    open_store(store_dir).close()


def test_corrupt_manifest(store_dir):
    (store_dir / MANIFEST).write_text("{not json")
    with pytest.raises(StoreError, match="manifest.json is corrupt.*delete"):
        open_store(store_dir)


def test_incomplete_manifest(store_dir):
    manifest = json.loads((store_dir / MANIFEST).read_text())
    del manifest["layers"]
    (store_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="incomplete"):
        open_store(store_dir)


def test_missing_store(tmp_path):
    with pytest.raises(StoreError, match="no offspec store"):
        open_store(tmp_path)


def test_truncated_layers_bin(store_dir):
    path = store_dir / LAYERS_BIN
    os.truncate(path, path.stat().st_size - BLOCK_ALIGN)
    with pytest.raises(StoreError, match="truncated"):
        open_store(store_dir)


def test_store_of_other_weights_shape_or_dtype(store_dir):
    with pytest.raises(StoreError, match="built from other weights .'tiny-v1', expected 'tiny-v2'"):
        open_store(store_dir, source_id="tiny-v2")
    with pytest.raises(StoreError, match="holds float32 weights, bfloat16 was asked"):
        open_store(store_dir, dtype=torch.bfloat16)
    wider = ModelConfig(**{**TINY.__dict__, "intermediate_size": 96})
    backend = CpuBackend()
    with pytest.raises(StoreError, match="different layer layout"):
        DiskStore(str(store_dir), LayerLayout.of(wider, torch.float32), N_LAYERS, backend, source_id="tiny-v1")
    backend.close()
    manifest = json.loads((store_dir / MANIFEST).read_text())
    manifest["fingerprint"] = "0" * 16
    (store_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="does not match its own fingerprint"):
        open_store(store_dir)


def test_manifest_fingerprint_is_computable_without_a_config(store_dir):
    manifest = json.loads((store_dir / MANIFEST).read_text())
    assert manifest["fingerprint"] == store_fingerprint(LayerLayout.of(TINY, torch.float32), N_LAYERS, "tiny-v1")
    assert manifest["source_id"] == "tiny-v1"


def flip_byte(store_dir, layer, at=100):
    manifest = json.loads((store_dir / MANIFEST).read_text())
    offset = manifest["layers"][layer]["offset"] + at
    with open(store_dir / LAYERS_BIN, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_flipped_byte_fails_the_checksum_when_streamed(store_dir):
    flip_byte(store_dir, layer=3)
    weights = random_layers(TINY)
    with open_target_layers(weights.__getitem__, TINY,
                            LayerPlan.of(TINY, OffloadConfig(mode="disk"), torch.float32, store_dir=str(store_dir)),
                            CPU, torch.float32, progress=False, source_id="tiny-v1") as target:
        seen = []
        with pytest.raises(StoreError, match="layer 3 of the store .* fails its checksum"):
            for i, _ in target.source.pass_layers():
                seen.append(i)
        assert seen == [0, 1, 2]


def test_flipped_byte_in_a_resident_layer(store_dir):
    flip_byte(store_dir, layer=0, at=5000)
    offload = OffloadConfig(mode="disk", gpu_budget=budget_for(2, 2))
    with pytest.raises(StoreError, match="layer 0 of the store"):
        open_target_layers(random_layers(TINY).__getitem__, TINY,
                           LayerPlan.of(TINY, offload, torch.float32, store_dir=str(store_dir)),
                           CPU, torch.float32, progress=False, source_id="tiny-v1")


def test_interrupted_prepare_leaves_no_store(tmp_path):
    weights = random_layers(TINY)

    def dies_at_layer_4(i):
        if i == 4:
            raise KeyboardInterrupt
        return weights[i]
    layout = LayerLayout.of(TINY, torch.float32)
    with pytest.raises(KeyboardInterrupt):
        prepare_disk_store(dies_at_layer_4, N_LAYERS, layout, str(tmp_path), progress=False)
    assert os.listdir(tmp_path) == []
    assert not disk_store_exists(str(tmp_path))
    with pytest.raises(StoreError, match="no offspec store"):
        open_store(tmp_path)


def test_rebuilding_over_a_store_uncommits_it_first(store_dir):
    """An interrupted rebuild must not leave the old manifest describing a half-new layers.bin."""
    weights = random_layers(TINY, seed=9)

    def dies(i):
        if i == 2:
            raise RuntimeError("checkpoint read failed")
        return weights[i]
    with pytest.raises(RuntimeError):
        prepare_disk_store(dies, N_LAYERS, LayerLayout.of(TINY, torch.float32), str(store_dir), progress=False)
    assert not disk_store_exists(str(store_dir))
    assert sorted(os.listdir(store_dir)) == [LAYERS_BIN]   # the old data, uncommitted; no temp files


def test_disk_mode_builds_the_store_once(tmp_path):
    weights = random_layers(TINY)
    calls = []

    def layer_tensors(i):
        calls.append(i)
        return weights[i]
    for _ in range(2):
        with open_target_layers(layer_tensors, TINY,
                                LayerPlan.of(TINY, OffloadConfig(mode="disk"), torch.float32, store_dir=str(tmp_path)),
                                CPU, torch.float32, progress=False) as target:
            assert target.host.kind == "disk store" and target.host.path == str(tmp_path)
            assert not target.host.pinned and target.host.reason == "cpu device"
    assert calls == list(range(N_LAYERS))


def test_disk_mode_needs_a_directory():
    with pytest.raises(InputError, match="store directory"):
        open_target_layers(random_layers(TINY).__getitem__, TINY,
                           LayerPlan.of(TINY, OffloadConfig(mode="disk"), torch.float32),
                           CPU, torch.float32, progress=False)


# ---------------------------------------------------------------- host memory in disk mode

RSS_SCRIPT = r"""
import json, sys
import psutil, torch
from offspec.config import ModelConfig, OffloadConfig
from offspec.engine.load import open_target_layers
from offspec.plan.placement import LayerPlan
cfg = ModelConfig(**json.loads(sys.argv[2]))
def no_checkpoint(i):
    raise AssertionError("the store should exist already")
process = psutil.Process()
base = peak = process.memory_info().rss
offload = OffloadConfig(mode="disk", n_slots=2, drop_page_cache=True)
with open_target_layers(no_checkpoint, cfg,
                        LayerPlan.of(cfg, offload, torch.float32, store_dir=sys.argv[1]),
                        torch.device("cpu"), torch.float32, progress=False) as target:
    for _ in range(2):
        for i, w in target.source.pass_layers():
            total = float(w.down_proj.sum())   # touch the slot
            peak = max(peak, process.memory_info().rss)
print(json.dumps({"growth": peak - base}))
"""


def test_disk_mode_host_memory_follows_the_ring_not_the_model(tmp_path):
    """Peak RSS growth while streaming 12 vs 48 layers of ~8.9 MB: the model grows by 320 MB, the ring
    (2 slots + 2 staging buffers) does not grow at all."""
    growth = {}
    for n_layers in (12, 48):
        cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=512, intermediate_size=768,
                          n_layers=n_layers, n_heads=8, n_kv_heads=8, head_dim=64)
        layout = LayerLayout.of(cfg, torch.float32)
        directory = str(tmp_path / f"store{n_layers}")
        prepare_disk_store(filled_layers(cfg, torch.float32), n_layers, layout, directory, progress=False)
        fields = {k: v for k, v in cfg.__dict__.items()}
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, directory, json.dumps(fields)],
                             check=True, capture_output=True, text=True, timeout=120)
        growth[n_layers] = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
    layer = layer_nbytes(cfg, torch.float32)
    model_difference = 36 * layer
    assert growth[48] - growth[12] < model_difference / 8, (growth, model_difference)
    assert growth[48] < 8 * layer, (growth, layer)   # ring + staging is 4 layers; the rest is slack


# ---------------------------------------------------------------- budget and placement

def test_budget_below_two_slots_is_refused():
    """Under two whole slots the ring splits each layer into parts; under two of its largest part, nothing streams."""
    part = max(p.nbytes for p in LayerLayout.of(TINY, torch.float32).parts(split=True))
    offload = OffloadConfig(mode="cpu", gpu_budget=2 * part - 1)
    needs = r"too small to stream: it needs at least 33 kB \(2 slots of a layer's largest part × 17 kB\)"
    with pytest.raises(BudgetError, match=needs):
        open_target_layers(random_layers(TINY).__getitem__, TINY,
                           LayerPlan.of(TINY, offload, torch.float32), CPU, torch.float32, progress=False)


def test_placement_spends_the_ring_first_then_resident_layers():
    L = 1000
    plan = place_layers(10, L, OffloadConfig(mode="cpu", n_slots=3), 5 * L + 999)
    assert plan.n_slots == 3 and plan.resident == (0, 1) and plan.streamed == tuple(range(2, 10))
    assert plan.device_bytes == 5 * L
    # A budget for 2 slots but not 3: the ring shrinks to what fits.
    plan = place_layers(10, L, OffloadConfig(mode="disk", n_slots=3), 2 * L)
    assert plan.n_slots == 2 and plan.resident == ()
    # Everything fits: nothing streams.
    plan = place_layers(10, L, OffloadConfig(mode="cpu"), 10 * L)
    assert plan.streamed == () and plan.n_slots == 0
    # No budget on a CPU device: stream everything.
    plan = place_layers(10, L, OffloadConfig(mode="cpu"), None)
    assert plan.resident == () and plan.n_slots == 2
    # overlap off allows a single slot.
    plan = place_layers(10, L, OffloadConfig(mode="cpu", n_slots=1, overlap=False), L)
    assert plan.n_slots == 1 and plan.resident == ()


def test_placement_errors():
    with pytest.raises(InputError, match="unknown offload mode"):
        place_layers(10, 1000, OffloadConfig(mode="ram"), None)
    with pytest.raises(InputError, match="at least 2 slots"):
        place_layers(10, 1000, OffloadConfig(mode="cpu", n_slots=1), None)
    with pytest.raises(BudgetError, match="cannot hold all 10 layers"):
        place_layers(10, 1000, OffloadConfig(mode="none"), 5000)


def test_budget_that_holds_everything_gives_resident_layers():
    weights = random_layers(TINY)
    offload = OffloadConfig(mode="cpu", gpu_budget=budget_for(N_LAYERS, 0))
    target = open_target_layers(weights.__getitem__, TINY,
                                LayerPlan.of(TINY, offload, torch.float32), CPU, torch.float32, progress=False)
    assert isinstance(target.source, ResidentLayers) and target.host is None and target.stats() is None
    for i, w in target.source.pass_layers():
        assert torch.equal(w.o_proj, weights[i]["o_proj"])


def test_overlap_off_single_slot_streams_correctly():
    weights = random_layers(TINY)
    offload = OffloadConfig(mode="cpu", n_slots=1, overlap=False)
    with open_target_layers(weights.__getitem__, TINY,
                            LayerPlan.of(TINY, offload, torch.float32), CPU, torch.float32, progress=False) as target:
        for _ in range(2):
            for i, w in target.source.pass_layers():
                assert torch.equal(w.gate_proj, weights[i]["gate_proj"])


# ---------------------------------------------------------------- on a real GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode,split", [("cpu", False), ("disk", False), ("cpu+disk", False), ("cpu", True),
                                        ("disk", True)])
def test_cuda_streamed_equals_checkpoint(tmp_path, mode, split):
    """The CUDA path, under sync-debug mode "error": no hidden synchronization inside a pass (cpu+disk: three
    layers in the pinned arena, the rest read from the store through the same ring; split: each layer's parts
    copied run by run into slots the size of the largest)."""
    from offspec.formats.quant import target_layout
    device = torch.device("cuda")
    weights = random_layers(TINY)
    stride = arena_stride(target_layout(TINY, torch.float32, "none").nbytes)
    offload = OffloadConfig(mode=mode, n_slots=3, gpu_budget=budget_for(1, 3),
                            host_budget=3 * stride if mode == "cpu+disk" else None)
    placement = None
    if split:   # one resident layer beside 3 layers' parts (what the plan makes only where whole slots do not fit)
        part = max(p.nbytes for p in LayerLayout.of(TINY, torch.float32).parts(split=True))
        placement = place_layers(N_LAYERS, layer_nbytes(TINY, torch.float32), offload,
                                 budget_for(1, 0) + 3 * len(LAYER_PARTS) * part, part, split_nbytes=0)
        assert placement.split and placement.resident == (0,)
    plan = LayerPlan.of(TINY, offload, torch.float32, store_dir=str(tmp_path), placement=placement)
    assert mode != "cpu+disk" or (len(plan.placement.host_layers) == 3 and plan.placement.disk_layers)
    with open_target_layers(weights.__getitem__, TINY, plan, device, torch.float32, progress=False) as target:
        assert target.host.pinned, target.host.reason
        expected = {i: {n: t.to(device) for n, t in w.items()} for i, w in weights.items()}
        mismatches = torch.zeros((), dtype=torch.int64, device=device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                for i, w in target.source.pass_layers():
                    for name in layer_shapes(TINY):
                        if getattr(w, name) is not None:      # (a part carries some of them)
                            mismatches += (getattr(w, name) != expected[i][name]).sum()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert int(mismatches) == 0
        assert target.stats().passes == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_arena_pinned_in_part_equals_checkpoint(monkeypatch):
    """An arena over its pinned budget on CUDA: its first pieces registered (a piece a layer here), the others
    copied pageable (synchronously, from the loader thread), every layer as the checkpoint has it."""
    import offspec.formats.layout as layout_module
    from offspec.formats.quant import target_layout
    device = torch.device("cuda")
    weights = random_layers(TINY)
    stride = arena_stride(target_layout(TINY, torch.float32, "none").nbytes)
    monkeypatch.setattr(layout_module, "PIN_CHUNK_BYTES", stride)
    offload = OffloadConfig(mode="cpu", n_slots=3, host_budget=3 * stride)
    with open_target_layers(weights.__getitem__, TINY, LayerPlan.of(TINY, offload, torch.float32), device,
                            torch.float32, progress=False) as target:
        assert not target.host.pinned and target.host.pinned_nbytes == 3 * stride
        for _ in range(3):
            for i, w in target.source.pass_layers():
                for name in layer_shapes(TINY):
                    assert torch.equal(getattr(w, name), weights[i][name].to(device)), (i, name)
        assert target.stats().passes == 3


def test_the_next_pass_prefetched_while_the_consumer_was_away_is_counted():
    """The wrap-around prefetch at work: layers of the next pass copied while the consumer did other things
    (drafting) are already in their slots when the pass begins, and StreamStats counts them."""
    weights = random_layers(TINY)
    with open_target_layers(weights.__getitem__, TINY,
                            LayerPlan.of(TINY, OffloadConfig(mode="cpu", n_slots=3), torch.float32),
                            CPU, torch.float32, progress=False) as target:
        for _ in target.pass_layers():
            pass
        time.sleep(0.3)                                  # "drafting": the copy worker fills the ring meanwhile
        before = target.stats()
        for _ in target.pass_layers():
            pass
        after = target.stats()
    assert after.prefetched_layers - before.prefetched_layers == 3
    assert after.prefetched_bytes - before.prefetched_bytes == 3 * layer_nbytes(TINY, torch.float32)


def test_a_store_that_cannot_fit_on_its_drive_is_refused_before_packing(tmp_path, monkeypatch):
    import collections
    import shutil
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    packed = []
    with pytest.raises(StoreError, match=r"the packed store needs .* but its drive has 1 kB free"):
        prepare_disk_store(lambda i: packed.append(i) or random_layers(TINY)[i], N_LAYERS,
                           LayerLayout.of(TINY, torch.float32), str(tmp_path / "store"), progress=False)
    assert packed == [] and not disk_store_exists(str(tmp_path / "store"))
