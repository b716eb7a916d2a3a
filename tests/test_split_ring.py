"""A split ring: slots the size of a layer's largest part (attention, gate, up, down), each streamed layer moved
in its parts in turn. The same protocol as whole slots (the harness of test_offload, torn copies included), every
part bitwise as the checkpoint has it, the forward's logits bitwise those of the resident model, the plan choosing
it only where whole slots do not fit, and `offspec generate` running it end to end."""
import json
from dataclasses import replace

import pytest
import torch
from drivers import forward_one
from shapes import headers_only_checkpoint
from test_offload import (
    N_LAYERS,
    REGIMES,
    TINY,
    NoRawBackend,
    NoWarBackend,
    TearingBackend,
    filled_layers,
    random_layers,
    run_protocol,
)

from offspec.config import ModelConfig, OffloadConfig, RunLimits, RuntimeConfig
from offspec.engine.load import open_target_layers
from offspec.errors import BudgetError
from offspec.formats.layout import LAYER_PARTS, WHOLE, GlobalWeights, LayerLayout, layer_shapes
from offspec.model.forward import Model
from offspec.model.kv_cache import KVCache
from offspec.plan.machine import Machine
from offspec.plan.placement import LayerPlan, choose_placement, place_layers, split_tiers
from offspec.plan.search import make_plan
from offspec.plan.sizes import ModelSpec, TargetLayerSizes, layer_nbytes, split_activation_nbytes
from offspec.stream.disk import DiskStore, prepare_disk_store
from offspec.stream.ring import LayerStreamer
from offspec.stream.stores import HostArenaStore

CPU = torch.device("cpu")
PARTS = tuple(LAYER_PARTS)


def part_budget(cfg, n_slots, dtype=torch.float32, n_resident=0):
    """Device bytes for n_slots part slots (and n_resident whole layers): less than two whole slots."""
    part = TargetLayerSizes.of(cfg, dtype, "none").part
    return n_slots * part + n_resident * layer_nbytes(cfg, dtype)


# ---------------------------------------------------------------- the parts

@pytest.mark.parametrize("extra", [{}, dict(attention_bias=True), dict(qk_norm=True)])
def test_the_parts_hold_every_tensor_once_with_its_bytes(extra):
    """Every tensor of a layer lies in exactly one part, byte for byte; the parts' bytes add up to the layer's
    (Qwen2's biases and Qwen3's norms sit after the MLP in the block: their part copies two runs)."""
    cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=96, n_layers=1, n_heads=4,
                      n_kv_heads=2, head_dim=8, **extra)
    layout = LayerLayout.of(cfg, torch.bfloat16)
    block = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack({name: torch.randn(shape) for name, shape in layer_shapes(cfg).items()}, block)
    whole = layout.views(block)
    parts = layout.parts(split=True)
    assert [p.part for p in parts] == list(PARTS) and sum(p.nbytes for p in parts) == layout.nbytes
    assert len(parts[0].runs) == (2 if extra else 1)
    seen = []
    for part in parts:
        slot = torch.zeros(max(p.nbytes for p in parts), dtype=torch.uint8)
        for src, dst, nbytes in part.runs:
            slot[dst:dst + nbytes] = block[src:src + nbytes]
        w = part.views(slot)
        assert w.part == part.part
        for name in layer_shapes(cfg):
            if name in LAYER_PARTS[part.part]:
                assert torch.equal(getattr(w, name), getattr(whole, name)), name
                seen.append(name)
            else:
                assert getattr(w, name) is None, name
    assert sorted(seen) == sorted(layer_shapes(cfg))
    (one,) = layout.parts(split=False)
    assert one.part == WHOLE and one.runs == ((0, 0, layout.nbytes),)


# ---------------------------------------------------------------- the protocol, in parts

@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("n_slots,resident", [(2, ()), (3, ()), (2, (0, 3))])
def test_split_ring_protocol_arena(regime, n_slots, resident):
    layout = LayerLayout.of(TINY, torch.uint8)
    backend = TearingBackend(20 + n_slots, REGIMES[regime]["copy_sleep"])
    streamed = [i for i in range(N_LAYERS) if i not in resident]
    store = HostArenaStore.build(filled_layers(TINY), layout, streamed, backend, progress=False)
    assert run_protocol(store, backend, n_slots, 4, REGIMES[regime]["kernel_sleep"], resident=resident,
                        split=True) == []


@pytest.mark.parametrize("regime", REGIMES)
def test_split_ring_protocol_disk_staging(tmp_path, regime):
    """A layer read into a staging buffer once, its parts copied out in turn, the buffer's gate after the last."""
    layout = LayerLayout.of(TINY, torch.uint8)
    prepare_disk_store(filled_layers(TINY), N_LAYERS, layout, str(tmp_path), progress=False)
    backend = TearingBackend(31, REGIMES[regime]["copy_sleep"])
    store = DiskStore(str(tmp_path), layout, N_LAYERS, backend)
    assert run_protocol(store, backend, 3, 3, REGIMES[regime]["kernel_sleep"], split=True) == []


@pytest.mark.parametrize("backend_cls,regime", [(NoWarBackend, "compute-bound"), (NoRawBackend, "copy-bound")])
def test_the_harness_catches_a_missing_wait_in_parts(backend_cls, regime):
    layout = LayerLayout.of(TINY, torch.uint8)
    backend = backend_cls(5, REGIMES[regime]["copy_sleep"])
    store = HostArenaStore.build(filled_layers(TINY), layout, range(N_LAYERS), backend, progress=False)
    assert run_protocol(store, backend, 2, 4, REGIMES[regime]["kernel_sleep"], split=True) != []


# ---------------------------------------------------------------- bitwise, through open_target_layers

def split_plan(cfg, mode, store_dir=None, n_slots=2, n_resident=0, host_layers=None):
    """A split ring of n_slots layers' parts beside n_resident resident layers (a placement the plan itself
    makes only on a device too small for two whole slots, where nothing stays resident; the loader obeys it)."""
    L, part = layer_nbytes(cfg, torch.float32), TargetLayerSizes.of(cfg, torch.float32, "none").part
    offload = OffloadConfig(mode=mode, n_slots=n_slots)
    placement = place_layers(cfg.n_layers, L, offload, part_budget(cfg, n_slots * len(PARTS), n_resident=n_resident),
                             part, split_nbytes=0)
    if host_layers is not None:
        placement = split_tiers(placement, host_layers)
    assert placement.split and placement.resident == tuple(range(n_resident))
    return LayerPlan.of(cfg, offload, torch.float32, store_dir=store_dir, placement=placement)


def parts_equal_checkpoint(source, weights, passes=3):
    """Each pass yields every streamed layer as its parts in order (a resident one whole), each tensor equal to
    the checkpoint's bit for bit."""
    for _ in range(passes):
        order = []
        for i, w in source.pass_layers():
            order.append((i, w.part))
            for name in (layer_shapes(TINY) if w.part == WHOLE else LAYER_PARTS[w.part]):
                if name in weights[i]:
                    assert torch.equal(getattr(w, name), weights[i][name]), (i, name)
        resident = source.resident
        assert order == [(i, p) for i in range(N_LAYERS) for p in ((WHOLE,) if i in resident else PARTS)]


@pytest.mark.parametrize("mode,n_resident,host_layers", [("cpu", 0, None), ("disk", 0, None), ("cpu", 2, None),
                                                         ("cpu+disk", 1, 3)])
def test_split_layers_equal_checkpoint_bitwise(tmp_path, mode, n_resident, host_layers):
    weights = random_layers(TINY)
    plan = split_plan(TINY, mode, str(tmp_path / "store"), n_resident=n_resident, host_layers=host_layers)
    with open_target_layers(weights.__getitem__, TINY, plan, CPU, torch.float32, progress=False) as target:
        assert isinstance(target.source, LayerStreamer) and target.placement.mode == mode
        parts_equal_checkpoint(target.source, weights)
        stats = target.stats()
    streamed = N_LAYERS - n_resident
    assert stats.passes == 3 and stats.layers >= 3 * streamed * len(PARTS)
    assert stats.bytes >= 3 * streamed * layer_nbytes(TINY, torch.float32)   # every layer's bytes, once a pass
    assert (stats.read_s > 0) == (mode != "cpu")


@pytest.mark.parametrize("arch,extra", [("llama", {}), ("qwen2", dict(attention_bias=True)),
                                        ("qwen3", dict(qk_norm=True))])
@pytest.mark.parametrize("chunk", [None, 3])
def test_split_model_logits_equal_resident_bitwise(tmp_path, arch, extra, chunk):
    """The whole forward: a target streamed in parts gives the resident target's logits bit for bit, pass after
    pass, over one chunk or several (the MLP's intermediates kept for every chunk between parts)."""
    cfg = ModelConfig(arch=arch, vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=5, n_heads=4,
                      n_kv_heads=2, head_dim=8, **extra)
    weights = random_layers(cfg, seed=4)
    g = torch.Generator().manual_seed(5)
    globals_ = GlobalWeights(embed=torch.randn(64, 32, generator=g), final_norm=torch.ones(32),
                             lm_head=torch.randn(64, 32, generator=g))
    resident = open_target_layers(weights.__getitem__, cfg, LayerPlan.of(cfg, OffloadConfig(), torch.float32),
                                  CPU, torch.float32, progress=False)
    streamed = open_target_layers(weights.__getitem__, cfg, split_plan(cfg, "cpu", n_resident=1),
                                  CPU, torch.float32, progress=False)
    models = [Model(cfg, globals_, resident), Model(cfg, globals_, streamed)]
    caches = [KVCache.for_model(cfg, 16, torch.float32, CPU) for _ in models]
    tokens = torch.randint(0, 64, (9,), generator=g)
    with streamed:
        for start, end in [(0, 7), (7, 9)]:
            positions = torch.arange(start, end)
            mask = torch.arange(end)[None, :] <= positions[:, None]
            logits = [forward_one(m, tokens[start:end], positions, positions, mask, c, chunk=chunk)
                      for m, c in zip(models, caches)]
            assert torch.equal(logits[0], logits[1])


# ---------------------------------------------------------------- the plan

def test_the_plan_splits_only_where_whole_slots_do_not_fit():
    L, part, extra = 10**6, 3 * 10**5, 5 * 10**4
    offload = OffloadConfig(mode="cpu", n_slots=2)
    roomy = choose_placement(10, L, offload, 2 * L, split=(part, extra))
    assert not roomy.split and roomy.n_slots == 2
    short = choose_placement(10, L, offload, 2 * L - 1, split=(part, extra))
    assert short.split and short.ring_slot_nbytes == part and short.resident == ()
    assert short.n_slots == (2 * L - 1 - extra) // part and short.device_bytes <= 2 * L - 1
    # offload.n_slots counts layers: a split ring with room for them takes that many layers' parts.
    wide = place_layers(10, L, offload, 5 * L, part, split_nbytes=extra)
    assert wide.n_slots == 2 * len(PARTS) and wide.resident == (0, 1)       # 5 - 8 × 0.3 - 0.05 = 2 layers
    kept = r"\(2 slots of a layer's largest part × 300 kB \+ 50 kB kept between parts\)"
    with pytest.raises(BudgetError, match=kept):
        choose_placement(10, L, offload, 2 * part + extra - 1, split=(part, extra))


def test_a_70b_on_a_small_gpu_streams_in_parts(tmp_path):
    """Llama-3.1-70B in bf16 on a 6 GB GPU beside a 1B draft in nf4: two whole slots (3.4 GB) do not fit, two
    of its parts do; the plan counts the MLP intermediates they keep, and the device holds everything."""
    from offspec.formats.checkpoint import Checkpoint
    target, draft = (ModelSpec.of(Checkpoint(headers_only_checkpoint(tmp_path, name), headers_only=True))
                     for name in ("Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct"))
    runtime = RuntimeConfig(device=torch.device("cuda"), dtype=torch.bfloat16, draft_quant="nf4")
    machine = Machine.given(6 * 10**9, 64 * 10**9)
    limits = RunLimits(context=4096, tree_budget=64, concurrency=1)
    plan = make_plan(target, draft, OffloadConfig(mode="auto"), runtime, limits, machine)
    p = plan.placement
    assert p.split and p.n_slots >= 2 and p.ring_slot_nbytes < p.layer_nbytes / 3
    assert p.split_nbytes == split_activation_nbytes(target.cfg, torch.bfloat16, 4096)
    assert plan.total("device") <= machine.device_bytes
    assert "MLP intermediates between parts" in plan.describe() and "slots of a layer's parts" in plan.layers_line()
    assert plan.to_dict()["placement"]["split"] is True
    # With room for whole slots, the plan keeps them.
    roomy = make_plan(target, draft, OffloadConfig(mode="auto"), runtime, limits, Machine.given(24 * 10**9, 64 * 10**9))
    assert not roomy.placement.split
    # nf4 on the same 6 GB: a compact ring (1.71 GB scratch) does not fit; a split one, compact too, does.
    nf4 = make_plan(target, draft, OffloadConfig(mode="auto"), replace(runtime, target_quant="nf4"), limits, machine)
    q = nf4.placement
    assert q.split and q.compact and q.scratch_nbytes == 0 and nf4.total("device") <= machine.device_bytes
    assert q.split_nbytes == q.layer_nbytes * 0 + split_activation_nbytes(target.cfg, torch.bfloat16, 4096) + \
        TargetLayerSizes.of(target.cfg, torch.bfloat16, "nf4").part_scratch
    assert "dequantization scratch" in nf4.describe()
    # On 12 GB the whole-layer compact ring fits, and is kept.
    twelve = make_plan(target, draft, OffloadConfig(mode="auto"), replace(runtime, target_quant="nf4"), limits,
                       Machine.given(12 * 10**9, 64 * 10**9))
    assert not twelve.placement.split


def test_a_cpu_run_without_a_budget_plans_whole_slots_only(tmp_path):
    """With no --gpu-budget a CPU run streams everything through whole slots (choose_placement never makes that
    ring smaller), so the plan's room check and the auto tree budget count whole slots, not a split ring."""
    from offspec.formats.checkpoint import Checkpoint
    target, draft = (ModelSpec.of(Checkpoint(headers_only_checkpoint(tmp_path, name), headers_only=True))
                     for name in ("Llama-3.1-8B-Instruct", "Llama-3.2-1B-Instruct"))
    runtime = RuntimeConfig(device=CPU, dtype=torch.bfloat16)
    with pytest.raises(BudgetError, match="too little for 2 streaming slots of 436 MB; lower") as refused:
        make_plan(target, draft, OffloadConfig(mode="disk"), runtime, RunLimits(context=4096),
                  Machine.given(None, 8_800_000_000))
    assert "split" not in str(refused.value)


# ---------------------------------------------------------------- end to end

def test_generate_streams_in_parts_and_keeps_the_targets_tokens(tmp_path):
    """`offspec generate` with a --gpu-budget under two whole layers on the CPU path: the plan splits the ring,
    the report says so, and the greedy tokens (float32, with trees) are the resident target's own."""
    from click.testing import CliRunner
    from tiny import hf_config, make_model, perturbed_copy, save_checkpoint

    from offspec.cli.main import main
    from offspec.formats.checkpoint import Checkpoint
    target = make_model(hf_config("qwen2", n_layers=3), seed=7, scale=3.0)
    t = save_checkpoint(target, tmp_path / "target")
    d = save_checkpoint(perturbed_copy(target, noise=0.02), tmp_path / "draft")
    cfg = Checkpoint(t).config
    context = 64
    budget = part_budget(cfg, 2) + split_activation_nbytes(cfg, torch.float32, context)
    assert budget < 2 * layer_nbytes(cfg, torch.float32)
    common = ["--target", t, "--draft", d, "--device", "cpu", "--dtype", "float32", "--max-new-tokens", 12,
              "--context", context, "--raw"]
    runs = {}
    for name, extra in [("resident", ["--offload", "none", "--tree", "none"]),
                        ("split", ["--offload", "cpu", "--gpu-budget", f"{budget}B"])]:
        out = tmp_path / f"{name}.json"
        result = CliRunner().invoke(main, ["generate", *map(str, common + extra), "--json", str(out), "abcab"])
        assert result.exit_code == 0, (result.output, result.exception)
        runs[name] = json.loads(out.read_text())
    plan = runs["split"]["memory_plan"]
    assert plan["placement"]["split"] and "slots of a layer's parts" in plan["layers_line"]
    assert runs["split"]["tokens"] == runs["resident"]["tokens"]

