"""The memory plan (offspec/plan/) for machines and models that are not here: 7B–72B checkpoints as config +
safetensors headers only (tests/shapes.py), on 8/24/48/80 GB GPUs with 16/64/256 GB of host RAM; and
`offspec models info` printing those plans, refusing in one line what cannot fit."""
from __future__ import annotations

import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from shapes import MODELS, headers_only_checkpoint

from offspec.cli.main import main
from offspec.config import OffloadConfig, RunLimits, RuntimeConfig
from offspec.errors import BudgetError
from offspec.formats.open import open_checkpoint
from offspec.plan.machine import GB, PINNED_FRACTION, Machine, host_memory_limit
from offspec.plan.search import AUTO_CONCURRENCY, make_plan
from offspec.plan.sizes import ModelSpec, activation_nbytes, kv_bytes_per_token, layer_nbytes

BF16 = RuntimeConfig(dtype=torch.bfloat16)
PAIRS = [("Llama-2-7b-chat-hf", "TinyLlama-1.1B-Chat-v1.0"), ("Llama-2-13b-chat-hf", "TinyLlama-1.1B-Chat-v1.0"),
         ("Llama-2-70b-chat-hf", "TinyLlama-1.1B-Chat-v1.0"), ("Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct"),
         ("Qwen2.5-72B-Instruct", "Qwen2.5-0.5B-Instruct")]
DEVICES, HOSTS = (8, 24, 48, 80), (16, 64, 256)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return {name: headers_only_checkpoint(root, name) for name in MODELS}


@pytest.fixture(scope="module")
def specs(folders):
    return {name: ModelSpec.of(open_checkpoint(folder, headers_only=True)) for name, folder in folders.items()}


def plan_for(specs, target, draft, device_gb, host_gb, offload=OffloadConfig(mode="auto"), limits=RunLimits(context=4096)):
    return make_plan(specs[target], specs[draft] if draft else None, offload, BF16, limits,
                     Machine.given(int(device_gb * GB), host_gb * GB))


def test_headers_are_enough_and_sizes_are_the_real_ones(specs):
    # Llama-2-70B: 80 layers of 0.86 B parameters -> 1.71 GB each in bf16 (+ alignment), 32000-row vocab.
    cfg = specs["Llama-2-70b-chat-hf"].cfg
    assert 1.70 * GB < layer_nbytes(cfg, torch.bfloat16) < 1.72 * GB
    # KV per token: 80 layers x 2 (k, v) x 8 kv heads x 128 x 2 bytes = 327,680 bytes
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 327_680
    assert specs["Llama-3.2-1B-Instruct"].lm_head_stored is False and specs["Llama-3.1-70B-Instruct"].lm_head_stored


@pytest.mark.parametrize("target,draft", PAIRS, ids=[t for t, _ in PAIRS])
@pytest.mark.parametrize("device_gb", DEVICES)
@pytest.mark.parametrize("host_gb", HOSTS)
def test_plans_fit_the_machine_or_refuse_in_one_line(specs, target, draft, device_gb, host_gb):
    try:
        plan = plan_for(specs, target, draft, device_gb, host_gb)
    except BudgetError as e:
        message = str(e)
        assert "\n" not in message and len(message) < 600
        assert re.search(r"lower --context|--offload|smaller draft", message), message
        return
    p = plan.placement
    assert plan.total("device") <= device_gb * GB
    assert plan.total("host") <= host_gb * GB
    assert sorted(p.resident + p.streamed) == list(range(specs[target].cfg.n_layers))
    assert p.resident == tuple(range(len(p.resident)))          # the first layers stay resident
    assert (p.n_slots >= 2) == bool(p.streamed)
    if plan.mode == "cpu":
        arena = next(i for i in plan.items if i.what.startswith("host arena"))
        assert plan.host_pinned == (arena.nbytes <= PINNED_FRACTION * host_gb * GB)
    # What the device holds besides the layers leaves no room for one more resident layer (no waste).
    if p.streamed:
        assert plan.total("device") + p.layer_nbytes > device_gb * GB


def test_the_issues_cases(specs):
    # 70B with an untied 128k vocabulary on an 80 GB GPU: the lm_head (2.1 GB) is counted before layers, and the
    # embedding (as much again) stays in host memory, since the target streams.
    plan = plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 80, 256)
    assert plan.mode == "cpu" and plan.host_pinned and 30 <= len(plan.placement.resident) < 80
    items = {(i.where, i.what): i.nbytes for i in plan.items}
    assert 2 * GB < items["device", "target norm, lm_head"] < 2.2 * GB
    assert 2 * GB < items["host", "target embedding"] < 2.2 * GB and plan.layers.embed_on_host
    # The old README example: 70B + 7B fp16 draft on 24 GB with --gpu-budget 20GB cannot fit, and says why.
    with pytest.raises(BudgetError, match=r"--gpu-budget 20.00 GB is more than the device leaves"):
        make_plan(specs["Llama-2-70b-chat-hf"], specs["Llama-2-7b-chat-hf"],
                  OffloadConfig(mode="cpu", gpu_budget=20 * GB), RuntimeConfig(dtype=torch.float16),
                  RunLimits(context=4096), Machine.given(24 * GB, 192 * GB))
    # A host too small for the arena: auto keeps what fits in RAM and reads the rest from the disk store; an
    # explicit cpu is refused with the way out.
    assert plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 64).mode == "cpu+disk"
    with pytest.raises(BudgetError, match="use --offload auto"):
        plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 64, OffloadConfig(mode="cpu"))
    # Everything fits: nothing streams.
    assert plan_for(specs, "Llama-2-7b-chat-hf", "TinyLlama-1.1B-Chat-v1.0", 24, 64).mode == "none"


def test_more_device_memory_never_means_fewer_resident_layers(specs):
    resident = [len(plan_for(specs, "Qwen2.5-72B-Instruct", "Qwen2.5-0.5B-Instruct", gb, 256).placement.resident)
                for gb in (16, 24, 32, 48, 64, 80)]
    assert resident == sorted(resident) and resident[0] < resident[-1]


def test_kv_caches_and_activations_are_sized_by_the_context(specs):
    short = plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 256, limits=RunLimits(context=1024))
    long = plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 256, limits=RunLimits(context=8192))
    kv = {p.context: next(i.nbytes for i in p.items if i.what == "target KV cache") for p in (short, long)}
    assert kv[8192] == 8 * kv[1024]
    assert len(short.placement.resident) > len(long.placement.resident)
    # A context longer than the models' is capped at it (Llama-2: 4096).
    capped = plan_for(specs, "Llama-2-13b-chat-hf", "TinyLlama-1.1B-Chat-v1.0", 48, 64, limits=RunLimits(context=10**6))
    assert capped.context == 2048          # TinyLlama's context is the shorter one
    # Chunked prefill bounds the activations: a 32k-token prompt in 1024-row chunks costs far less than unchunked,
    # and the attention scores stay within config.ATTENTION_SCORE_BYTES whatever the context: it costs KV cache.
    cfg = specs["Qwen2.5-72B-Instruct"].cfg
    chunked = activation_nbytes(cfg, torch.bfloat16, 32768, 1024, 32768)
    assert chunked * 6 < activation_nbytes(cfg, torch.bfloat16, 32768, 32768, 32768)
    assert chunked < 2 * GB


def test_auto_tree_budget_shrinks_on_a_short_device(specs):
    roomy = plan_for(specs, "Qwen2.5-7B-Instruct", "Qwen2.5-0.5B-Instruct", 80, 64)
    assert roomy.tree_budget == 1024 and not any("tree budget" in n for n in roomy.notes)
    tight = plan_for(specs, "Qwen2.5-72B-Instruct", "Qwen2.5-0.5B-Instruct", 9, 256)   # (a split ring's 2 GB)
    assert tight.tree_budget < 1024 and any("auto tree budget capped" in n for n in tight.notes)
    # An explicit budget is never changed: too large is a clear refusal.
    with pytest.raises(BudgetError, match="lower --context or --tree-budget"):
        plan_for(specs, "Qwen2.5-72B-Instruct", "Qwen2.5-0.5B-Instruct", 7, 256,
                 limits=RunLimits(context=4096, tree_budget=1024))


def test_gpu_budget_and_host_budget_are_checked(specs):
    args = ("Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 256)
    plan = plan_for(*(specs, *args), offload=OffloadConfig(mode="cpu", gpu_budget=5 * GB))
    assert plan.placement.device_bytes <= 5 * GB and plan.placement.n_slots == 2
    with pytest.raises(BudgetError, match=r"use --gpu-budget \d+(\.\d)?GB or less"):
        plan_for(*(specs, *args), offload=OffloadConfig(mode="cpu", gpu_budget=23 * GB))
    with pytest.raises(BudgetError, match="--host-budget 300.00 GB is more than the host memory"):
        plan_for(*(specs, *args), offload=OffloadConfig(mode="cpu", host_budget=300 * GB))
    # A pinned budget below the arena: pageable, said in the notes.
    pageable = plan_for(*(specs, *args), offload=OffloadConfig(mode="cpu", host_budget=64 * GB))
    assert not pageable.host_pinned and any("pageable" in n for n in pageable.notes)


def test_host_memory_limit_is_at_most_memavailable():
    import psutil
    limit, source = host_memory_limit()
    assert 0 < limit <= psutil.virtual_memory().available * 1.01 and source in ("MemAvailable", "cgroup memory limit")


def test_cgroup_limit_below_memavailable_wins(tmp_path, monkeypatch):
    """A container's cgroup (v2) with a 2 GB limit: the plan's host memory is what the cgroup leaves."""
    import offspec.plan.machine as plan_mod
    cg = tmp_path / "sys" / "fs" / "cgroup"
    (cg / "job").mkdir(parents=True)
    (cg / "job" / "memory.max").write_text(f"{2 * GB}\n")
    (cg / "job" / "memory.current").write_text(f"{GB}\n")
    (cg / "job" / "memory.stat").write_text(f"anon 1\ninactive_file {GB // 2}\n")
    (tmp_path / "cgroup").write_text("0::/job\n")
    real_path = Path

    def fake_path(p, *rest):
        text = str(p)
        if text == "/proc/self/cgroup":
            return real_path(tmp_path / "cgroup")
        if text.startswith("/sys/fs/cgroup"):
            return real_path(str(tmp_path) + text, *rest)
        return real_path(p, *rest)

    monkeypatch.setattr(plan_mod, "Path", fake_path)
    assert plan_mod.host_memory_limit() == (2 * GB - (GB - GB // 2), "cgroup memory limit")


# ---------------------------------------------------------------- offspec models info

def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], prog_name="offspec")


def test_models_info_prints_the_plan_without_weights(folders):
    r = cli("models", "info", folders["Llama-3.1-70B-Instruct"], "--draft", folders["Llama-3.2-1B-Instruct"],
            "--device-memory", "24GB", "--host-memory", "192GB")
    assert r.exit_code == 0, r.output
    for needle in ("parameters:      70.554 B", "draft:", "memory plan: a 24 GB GPU, offload cpu",
                   "target KV cache", "tree logits", "activations of the largest forward", "ring: 2 slots",
                   "host arena", "(pinned)", "streamed from host RAM (pinned) through 2 slots", "PREDICTED pass:",
                   "weights incomplete (enough to plan, not to run)"):
        assert needle in r.output, needle


def test_models_info_too_small_is_one_line(folders):
    r = cli("models", "info", folders["Qwen2.5-72B-Instruct"], "--draft", folders["Qwen2.5-0.5B-Instruct"],
            "--device-memory", "4GB", "--host-memory", "64GB")
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offspec: error: ") and "lower --context" in lines[0]
    assert "cannot hold the run" in lines[0] and lines[0].endswith("fits: --context 1280")


def readme_text() -> str:
    """README.md and docs/planning.md, where the README's GPU examples' plans are shown."""
    root = Path(__file__).parent.parent
    return (root / "README.md").read_text() + "\n" + (root / "docs" / "planning.md").read_text()


def readme_info_commands() -> list[str]:
    readme = readme_text()
    return [line.strip() for line in readme.splitlines() if line.strip().startswith("offspec models info ~/models/")]


def test_readme_names_plans_for_its_gpu_examples():
    readme = readme_text()
    commands = readme_info_commands()
    assert commands, "the README shows no `offspec models info` plan for its GPU examples"
    for line in readme.splitlines():
        if line.strip().startswith("offspec generate --target ~/models/"):
            target = re.search(r"--target ~/models/(\S+)", line).group(1)
            assert any(f"info ~/models/{target} " in c for c in commands), f"no plan shown for {line.strip()}"


@pytest.mark.parametrize("command", readme_info_commands())
def test_every_readme_example_is_a_plan_that_fits(folders, command):
    args = shlex.split(command)[1:]
    for i, a in enumerate(args):
        if a.startswith("~/models/"):
            name = a.removeprefix("~/models/")
            assert name in folders, f"README names {name}: add its shape to tests/shapes.py"
            args[i] = str(folders[name])
    r = cli(*args)
    assert r.exit_code == 0, r.output


def test_the_readmes_predicted_passes_are_what_models_info_prints(folders):
    """Each row of the README's consumer-GPU table shows the pass `models info` predicts for the command in the same
    place of the block under it: the all-in pass (copies or compute, plus the held layers' dequantization)."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("## What to expect on a consumer GPU"):readme.index("## Your own models")]
    rows = [line for line in section.splitlines() if line.startswith("| ") and " s |" in line]
    commands = [line for line in section.splitlines() if line.startswith("offspec models info ~/models/")]
    assert len(rows) == len(commands) == 6
    for row, command in zip(rows, commands):
        args = [str(folders[a.removeprefix("~/models/")]) if a.startswith("~/models/") else a
                for a in shlex.split(command)[1:]]
        out = cli(*args).output
        assert "PREDICTED for:   NVIDIA GeForce RTX 4090" in out, out
        all_in = re.search(r"PREDICTED pass, all in: ([\d.]+) s", out) or re.search(r"PREDICTED pass:  ([\d.]+) s", out)
        assert row.endswith(f"| {float(all_in.group(1)):.2f} s |"), (row, all_in.group(0))


def test_the_readmes_twin_figures_are_what_models_info_prints(folders):
    """The README's `--draft self` paragraph: a 70B's twin does not fit a 24 GB card (one line) and leaves 13 layers
    resident on an 80 GB H100; an 8B's fits a 12 GB card beside 4 resident layers."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for needle in ("42.8 GB", "does not fit a 24 GB GPU", "13 of the 80 layers resident", "(4.4 GB)", "4 resident"):
        assert needle in readme, needle
    info = lambda name, gpu, host: cli("models", "info", folders[name], "--draft", "self", "--gpu", gpu,  # noqa: E731
                                       "--host-memory", host)
    refused = info("Llama-3.1-70B-Instruct", "rtx4090", "64GB")
    assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1
    assert "cannot hold the run" in refused.output and "draft weights 42.78 GB" in refused.output
    h100, small = info("Llama-3.1-70B-Instruct", "h100", "192GB"), info("Llama-3.1-8B-Instruct", "rtx4070ti", "32GB")
    assert h100.exit_code == 0 and "layers 0–12 resident" in h100.output, h100.output
    assert small.exit_code == 0 and "layers 0–3 resident" in small.output, small.output
    assert "self: the target's layers held int4, 4.36 GB on the device" in small.output


def test_models_info_predicts_for_a_named_card(folders):
    """--gpu NAME plans for the card's memory and names it; an unknown card is one line naming the known ones."""
    args = (folders["Meta-Llama-3.1-70B-Instruct-AWQ-INT4"], "--draft", folders["Llama-3.2-1B-Instruct"],
            "--host-memory", "64GB", "--dtype", "float16")
    small, big = cli("models", "info", *args, "--gpu", "rtx4070ti"), cli("models", "info", *args, "--gpu", "5090")
    assert small.exit_code == 0 and big.exit_code == 0, small.output + big.output
    assert "a 12 GB GPU" in small.output and "PREDICTED for:   NVIDIA GeForce RTX 4070 Ti (504 GB/s" in small.output
    assert "a 32 GB GPU" in big.output and "link 50 GB/s (assumed: the NVIDIA GeForce RTX 5090's slot)" in big.output
    r = cli("models", "info", *args, "--gpu", "rtx9999")
    assert r.exit_code == 1 and r.output.strip().splitlines() == [
        "offspec: error: --gpu rtx9999: not a card offspec has figures for (one of rtx3090, rtx4060ti, rtx4070ti, "
        "rtx4080, rtx4090, rtx5090, h100, h200)"]


def test_a_70b_in_nf4_streams_from_64gb_of_host_ram(specs, folders):
    """Quantized layer sizes in the plan: the 70B's nf4 arena (≈ 37 GB) is pinned in 64 GB where most of the bf16
    one (130 GB) has to be read from disk, and a pass moves ≤ 0.30x the bf16 bytes (int8: ≤ 0.52x)."""
    args = ("Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct")
    dense = plan_for(specs, *args, 24, 64)
    nf4 = make_plan(specs[args[0]], specs[args[1]], OffloadConfig(mode="auto"),
                    RuntimeConfig(dtype=torch.bfloat16, target_quant="nf4"), RunLimits(context=4096),
                    Machine.given(24 * GB, 64 * GB))
    int8 = make_plan(specs[args[0]], specs[args[1]], OffloadConfig(mode="disk"),
                     RuntimeConfig(dtype=torch.bfloat16, target_quant="int8"), RunLimits(context=4096),
                     Machine.given(24 * GB, 64 * GB))
    assert dense.mode == "cpu+disk" and nf4.mode == "cpu" and nf4.host_pinned
    per_layer = lambda p: p.streamed_bytes / len(p.placement.streamed)     # noqa: E731
    assert per_layer(nf4) <= 0.30 * per_layer(dense) and per_layer(int8) <= 0.52 * per_layer(dense)
    ring = next(i for i in nf4.items if i.what.startswith("ring"))
    assert ring.nbytes == 2 * (nf4.block_nbytes + nf4.placement.layer_nbytes)   # each slot: the block + the dense layer
    assert nf4.total("device") <= 24 * GB

    r = cli("models", "info", folders[args[0]], "--draft", folders[args[1]], "--device-memory", "24GB",
            "--host-memory", "64GB", "--target-quant", "nf4")
    assert r.exit_code == 0, r.output
    for needle in ("nf4 layer:", "(0.28x)", "offload cpu, target nf4", "streamed from host RAM (pinned)",
                   "nf4: 481 MB moved per layer", "PREDICTED pass:", "PREDICTED speed:"):
        assert needle in r.output, needle


@pytest.mark.parametrize("quant,at_least", [("int8", 1.8), ("nf4", 3.2)])
def test_held_quantized_resident_layers_fit_about_2x_int8_and_3_5x_nf4(specs, folders, quant, at_least):
    """--resident-quant: a --gpu-budget whose resident room holds N dense layers holds about 2N int8 / 3.5N nf4
    layers held as blocks (minus the one dense scratch layer they dequantize into), so fewer layers stream;
    off keeps N dense ones, and auto takes the held placement because it holds more."""
    target, draft = "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct"
    cfg = specs[target].cfg
    L = layer_nbytes(cfg, torch.bfloat16)
    N = 16

    def plan(resident_quant):
        runtime = RuntimeConfig(dtype=torch.bfloat16, target_quant=quant, resident_quant=resident_quant)
        slot = L + make_plan(specs[target], specs[draft], OffloadConfig(mode="cpu"), runtime, RunLimits(context=4096),
                             Machine.given(80 * GB, 256 * GB)).block_nbytes
        return make_plan(specs[target], specs[draft], OffloadConfig(mode="cpu", gpu_budget=2 * slot + N * L), runtime,
                         RunLimits(context=4096), Machine.given(80 * GB, 256 * GB))

    dense, held, auto = plan("off"), plan("on"), plan("auto")
    assert len(dense.placement.resident) == N and not dense.placement.resident_held
    assert held.placement.resident_held and len(held.placement.resident) == (N - 1) * L // held.block_nbytes
    assert len(held.placement.resident) >= at_least * N      # int8 29 and nf4 53 for N = 16 (one went to the scratch)
    assert auto.placement == held.placement
    assert held.streamed_bytes < dense.streamed_bytes
    items = {i.what: i.nbytes for i in held.items}
    assert items[f"resident target layers ({len(held.placement.resident)}, {quant})"] == \
        len(held.placement.resident) * held.block_nbytes
    assert items["dequantization scratch"] == L
    assert held.placement.device_bytes <= 2 * (L + held.block_nbytes) + N * L     # within --gpu-budget
    assert f"resident (held {quant}, each dequantized every pass)" in held.layers_line()

    r = cli("models", "info", folders[target], "--draft", folders[draft], "--device-memory", "80GB",
            "--host-memory", "256GB", "--target-quant", quant, "--gpu-budget", str(2 * (L + held.block_nbytes) + N * L))
    assert r.exit_code == 0, r.output
    assert "dequantization scratch" in r.output and "held layers:" in r.output
    assert f"resident (held {quant}" in r.output


def test_resident_quant_auto_keeps_dense_layers_when_they_all_fit(specs):
    """A tie (every layer fits dense) stays dense: held layers would only add a dequantization per pass."""
    runtime = RuntimeConfig(dtype=torch.bfloat16, target_quant="nf4")
    plan = make_plan(specs["Llama-2-7b-chat-hf"], specs["TinyLlama-1.1B-Chat-v1.0"], OffloadConfig(mode="auto"),
                     runtime, RunLimits(context=4096), Machine.given(80 * GB, 256 * GB))
    assert plan.mode == "none" and not plan.placement.resident_held
    squeezed = make_plan(specs["Llama-2-7b-chat-hf"], specs["TinyLlama-1.1B-Chat-v1.0"], OffloadConfig(mode="auto"),
                         runtime, RunLimits(context=4096), Machine.given(12 * GB, 256 * GB))
    assert squeezed.placement.resident_held     # 12 GB: the dense 7B (13 GB) must stream, held layers need not


def test_resident_quant_on_needs_a_quantized_target():
    from offspec.errors import InputError
    from offspec.plan.placement import choose_placement
    with pytest.raises(InputError, match="needs --target-quant int8 or nf4"):
        choose_placement(4, 1000, OffloadConfig(mode="cpu"), None, resident_quant="on")
    with pytest.raises(InputError, match="unknown --resident-quant 'yes'"):
        choose_placement(4, 1000, OffloadConfig(mode="cpu"), None, held_bytes=300, resident_quant="yes")


def test_a_held_draft_is_counted_at_its_quantized_size(specs, folders):
    """--draft-quant int8-held / nf4: the plan's draft weights shrink (its layers' matrices 0.50x / 0.28x, lm_head
    and embedding dense) and a dense matrix for the call's dequantization is counted; int8 adds its copy."""
    target, draft = "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct"

    def draft_items(draft_quant):
        plan = make_plan(specs[target], specs[draft], OffloadConfig(mode="cpu"),
                         RuntimeConfig(dtype=torch.bfloat16, draft_quant=draft_quant), RunLimits(context=4096),
                         Machine.given(24 * GB, 256 * GB))
        return {i.what: i.nbytes for i in plan.items if i.what.startswith("draft") and "KV" not in i.what}, plan

    dense, _ = draft_items("none")
    copy, _ = draft_items("int8")
    int8, _ = draft_items("int8-held")
    nf4, nf4_plan = draft_items("nf4")
    cfg = specs[draft].cfg
    globals_ = (2 if specs[draft].lm_head_stored else 1) * cfg.vocab_size * cfg.hidden_size * 2     # embed (+ lm_head)
    layers = lambda items: items["draft weights"] - globals_ - cfg.hidden_size * 2       # noqa: E731
    assert copy["draft weights"] == dense["draft weights"] and "draft int8 copy" in copy
    assert 0.49 < layers(int8) / layers(dense) < 0.51 and 0.27 < layers(nf4) / layers(dense) < 0.29
    assert int8["draft dequantization temporary"] == cfg.intermediate_size * cfg.hidden_size * 2
    assert nf4["draft weights"] + nf4["draft dequantization temporary"] < dense["draft weights"]
    assert "layers held nf4" in nf4_plan.describe()


def test_auto_concurrency_is_the_most_rows_that_fit_halving_from_the_cap(specs):
    """RunLimits(concurrency=None): the plan takes the most requests in flight, up to AUTO_CONCURRENCY and
    concurrency_cap (the job's prompts), whose plan fits, halving until one does, and records that it was auto;
    when not even one row fits, the refusal is the one-row plan's."""
    args = ("Llama-2-7b-chat-hf", "TinyLlama-1.1B-Chat-v1.0")
    auto = RunLimits(context=2048, concurrency=None)
    roomy = plan_for(specs, *args, 24, 64, limits=auto)
    assert roomy.concurrency == AUTO_CONCURRENCY and roomy.concurrency_auto
    assert roomy.to_dict()["concurrency"] == AUTO_CONCURRENCY and roomy.to_dict()["concurrency_auto"] is True
    assert f"{AUTO_CONCURRENCY} requests in flight (auto)" in roomy.describe()
    assert plan_for(specs, *args, 24, 64, limits=replace(auto, concurrency_cap=3)).concurrency == 3
    fixed = plan_for(specs, *args, 24, 64, limits=RunLimits(context=2048, concurrency=4))
    assert fixed.concurrency == 4 and not fixed.concurrency_auto and "(auto)" not in fixed.describe()

    def fits(rows: int) -> bool:
        try:
            plan_for(specs, *args, 8, 64, limits=RunLimits(context=2048, concurrency=rows))
            return True
        except BudgetError:
            return False
    most = next(rows for rows in (16, 8, 4, 2, 1) if fits(rows))
    assert 1 < most < AUTO_CONCURRENCY                      # this machine is short of 16 rows, not of every row
    tight = plan_for(specs, *args, 8, 64, limits=auto)
    assert tight.concurrency == most and tight.concurrency_auto
    with pytest.raises(BudgetError) as one_row:
        plan_for(specs, *args, 3, 64, limits=RunLimits(context=2048, concurrency=1))
    with pytest.raises(BudgetError, match=re.escape(str(one_row.value))):
        plan_for(specs, *args, 3, 64, limits=auto)


# ---------------------------------------------------------------- tiers: host RAM for what fits, disk for the rest

def test_a_70b_on_a_gaming_pc_keeps_what_fits_in_ram_and_reads_the_rest_from_disk(specs):
    """bf16 Llama-3.1-70B (133 GB of layers) on a 24 GB GPU beside 128 GB of RAM: one tier for all layers put every
    streamed layer on the disk; now the pinned budget's worth stays in RAM, pinned, a few more pageable, and only
    the rest is read, spread through the pass; the predicted pass is the slower of the copies and the drive."""
    from offspec.formats.layout import arena_stride, pinned_arena_layers
    from offspec.plan.costmodel import DISK_GBPS, PAGEABLE_GB_PER_S
    from offspec.plan.costmodel import LINK_GB_PER_S as LINK_GBPS
    from offspec.plan.passtime import predicted_pass_seconds
    from offspec.plan.placement import split_tiers
    plan = plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 128)
    p = plan.placement
    assert plan.mode == p.mode == "cpu+disk" and 0 < plan.pinned_layers < len(p.host_layers) and not plan.host_pinned
    assert set(p.host_layers) | set(p.disk_layers) == set(p.streamed) and not set(p.host_layers) & set(p.disk_layers)
    staging = next(i for i in plan.items if i.what == "disk staging buffers")
    pinned = plan.pinned_layers * arena_stride(plan.block_nbytes)
    assert pinned + staging.nbytes <= plan.pinned_budget < pinned + staging.nbytes + arena_stride(plan.block_nbytes)
    assert plan.total("host") <= 128 * GB
    gaps = [b - a for a, b in zip(p.disk_layers, p.disk_layers[1:])]
    assert max(gaps) - min(gaps) <= 1                       # disk layers spread evenly through the pass
    disk_only = plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 128, OffloadConfig(mode="disk"))
    tiered_s = predicted_pass_seconds(plan, LINK_GBPS, DISK_GBPS)
    assert tiered_s < predicted_pass_seconds(disk_only, LINK_GBPS, DISK_GBPS) / 6
    pageable = len(p.host_layers) - plan.pinned_layers
    copies = ((len(p.streamed) - pageable) / LINK_GBPS + pageable / PAGEABLE_GB_PER_S) * plan.block_nbytes / GB
    assert tiered_s == pytest.approx(max(copies, len(p.disk_layers) * plan.block_nbytes / (DISK_GBPS * GB)))
    # one layer more or fewer in RAM (the others from disk) is predicted no faster
    for n in (len(p.host_layers) - 1, len(p.host_layers) + 1):
        moved = split_tiers(replace(p, mode="cpu+disk", in_host=()), n)
        other = replace(plan, layers=replace(plan.layers, placement=moved),
                        pinned_layers=pinned_arena_layers(n, plan.block_nbytes, plan.pinned_budget - staging.nbytes))
        assert predicted_pass_seconds(other, LINK_GBPS, DISK_GBPS) >= tiered_s
    d = plan.to_dict()["placement"]
    assert d["host"] == list(p.host_layers) and d["disk"] == list(p.disk_layers)
    assert "disk store" in plan.layers_line() and "host RAM" in plan.layers_line()


def test_an_arena_just_over_the_pinned_budget_pins_what_fits_instead_of_going_pageable(specs):
    """160 GB of RAM: the whole arena fits the host, and with no disk staging to pin beside it, the pinned
    budget too: all of it pinned (a whole pageable arena, once). With a pinned budget far too small, the arena's
    first pieces are pinned, many more layers are pageable (a sixth of the pinned rate, measured), and the rest
    come from the drive: faster than all of them pageable."""
    from offspec.plan.costmodel import DISK_GBPS
    from offspec.plan.costmodel import LINK_GB_PER_S as LINK_GBPS
    from offspec.plan.passtime import predicted_pass_seconds
    plan = plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 160)
    assert plan.mode == "cpu" and plan.host_pinned and plan.pinned_layers == len(plan.placement.streamed)
    small_pin = plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 160,
                         OffloadConfig(mode="auto", host_budget=8 * GB))
    assert small_pin.mode == "cpu+disk" and 0 < small_pin.pinned_layers < len(small_pin.placement.host_layers)
    all_pageable = plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 160,
                            OffloadConfig(mode="cpu", host_budget=8 * GB))
    assert all_pageable.mode == "cpu" and all_pageable.pinned_layers > 0 and not all_pageable.host_pinned
    assert (predicted_pass_seconds(small_pin, LINK_GBPS, DISK_GBPS)
            < predicted_pass_seconds(all_pageable, LINK_GBPS, DISK_GBPS))


def test_tiers_forced_and_their_limits(specs):
    """--offload cpu+disk with everything fitting in RAM is plain cpu; with no room for one layer, plain disk;
    cpu and disk still force one tier."""
    roomy = plan_for(specs, "Llama-2-13b-chat-hf", "TinyLlama-1.1B-Chat-v1.0", 8, 256, OffloadConfig(mode="cpu+disk"))
    assert roomy.mode == "cpu" and roomy.placement.host_layers == roomy.placement.streamed
    tight = plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 8,
                     OffloadConfig(mode="cpu+disk", host_budget=1 * GB))
    assert tight.mode == "disk" and not tight.placement.host_layers
    assert any("cpu+disk -> disk" in n for n in tight.notes)
    for mode in ("disk", "cpu"):
        forced = plan_for(specs, "Llama-2-13b-chat-hf", "TinyLlama-1.1B-Chat-v1.0", 8, 256, OffloadConfig(mode=mode))
        assert forced.mode == mode


def test_the_goals_for_small_gpus_and_long_contexts(specs):
    """A 70B with a 1B draft: an 8 GB GPU with 64 GB of RAM plans nf4 at 4,096 tokens of context (the embedding
    in host memory, a split compact ring: each nf4 layer's parts in turn), and a 24 GB GPU plans 32,768 tokens
    (the embedding in host memory; the attention scores bounded, so the context costs KV cache)."""
    from dataclasses import replace
    target, draft = specs["Llama-3.1-70B-Instruct"], specs["Llama-3.2-1B-Instruct"]
    nf4 = replace(BF16, target_quant="nf4", draft_quant="nf4")
    small = make_plan(target, draft, OffloadConfig(mode="auto"), nf4, RunLimits(context=4096),
                      Machine.given(8 * GB, 64 * GB))
    assert small.layers.embed_on_host and not small.layers.lm_head_on_host
    assert small.placement.compact and small.placement.split
    assert small.total("device") <= 8 * GB and small.host_pinned and small.mode == "cpu"
    long = make_plan(target, draft, OffloadConfig(mode="auto"), BF16, RunLimits(context=32768),
                     Machine.given(24 * GB, 64 * GB))
    assert long.context == 32768 and long.layers.embed_on_host and not long.layers.lm_head_on_host
    activations = next(i.nbytes for i in long.items if i.what == "activations of the largest forward")
    assert activations < 2 * GB and long.total("device") <= 24 * GB
    # Where the device holds everything, nothing moves to the host.
    roomy = plan_for(specs, "Llama-3.1-8B-Instruct", "Llama-3.2-1B-Instruct", 80, 256)
    assert roomy.mode == "none" and not roomy.layers.embed_on_host


def test_a_gpu_twin_reads_the_targets_lm_head_where_the_plan_keeps_it_on_the_device(specs):
    """draft_quant.draft_lm_head in the plan: on a GPU, an int4 twin of Llama-3.1-8B holds its layers only where
    the target's lm_head is on the device (it reads that one, no bytes of its own), and an int4 copy of it on the
    device where the lm_head stays in host memory."""
    from offspec.formats import int4
    from offspec.plan import search
    from offspec.plan.sizes import draft_weights_nbytes
    target = specs["Llama-3.1-8B-Instruct"]
    args = (target, target.as_twin(), OffloadConfig(mode="auto"), replace(BF16, draft_quant="int4"),
            RunLimits(context=4096, concurrency=1))
    layers_only = draft_weights_nbytes(target.as_twin(), torch.bfloat16, "int4", "as is")
    head_int4 = int4.nbytes((target.cfg.vocab_size, target.cfg.hidden_size), torch.bfloat16)
    shared = "the target's lm_head shared"
    for on_host, device_gb, head, nbytes, words in (((), 24, "as is", layers_only, shared),
                                                    (("embed",), 8, "as is", layers_only, shared),
                                                    (("embed", "lm_head"), 8, "int4", layers_only + head_int4,
                                                     "lm_head held int4")):
        plan = search._plan_with(*args, Machine.given(device_gb * GB, 64 * GB), None, on_host=on_host)
        item = next(i for i in plan.items if i.what == "draft weights")
        assert plan.draft_head == head and item.nbytes == nbytes and words in item.note


def test_a_refusal_names_what_would_fit(specs):
    import re

    from offspec.plan.search import CONTEXT_STEP
    args = (specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 64)
    with pytest.raises(BudgetError) as refused:
        plan_for(*args, limits=RunLimits(context=131072))
    advice = r"a context of (\d+) tokens \(prompt, output and a tree\) fits: --context \1$"
    fits = int(re.search(advice, str(refused.value)).group(1))
    assert fits % CONTEXT_STEP == 0 and plan_for(*args, limits=RunLimits(context=fits)).context == fits
    with pytest.raises(BudgetError):
        plan_for(*args, limits=RunLimits(context=fits + CONTEXT_STEP))
    # Where no shorter context fits, the target and draft held in nf4 may: that is named instead.
    with pytest.raises(BudgetError, match=r"; --target-quant nf4 --draft-quant nf4 fits \(that quantized"):
        plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 4.4, 64,
                 limits=RunLimits(context=2048, tree_budget=64))
    # Where nothing would fit, the refusal is as it was.
    with pytest.raises(BudgetError) as hopeless:
        plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 4, 64)
    assert "fits" not in str(hopeless.value)


def test_streamed_layers_dequantization_runs_beside_the_copies(specs):
    """A streamed quantized layer is dequantized on its own queue while the next layer is copied, so the predicted
    pass is the longer of the copies and the streamed layers' measured dequantization (on a slow card's scaled
    figures, the dequantization can be the longer); a compact ring's layers dequantize on the compute queue
    instead (counted in line, not here), and a dense target has none."""
    from dataclasses import replace

    from offspec.plan.costmodel import LINK_GB_PER_S as LINK_GBPS
    from offspec.plan.costmodel import dequant_seconds, find_gpu
    from offspec.plan.passtime import predicted_pass_seconds, streamed_dequant_seconds
    target, draft = specs["Llama-3.1-70B-Instruct"], specs["Llama-3.2-1B-Instruct"]
    nf4 = replace(BF16, target_quant="nf4", draft_quant="nf4")
    whole = make_plan(target, draft, OffloadConfig(mode="auto"), nf4, RunLimits(context=4096),
                      Machine.given(24 * GB, 64 * GB))
    p = whole.placement
    assert not p.compact and len(p.streamed) > 50
    assert streamed_dequant_seconds(whole) == pytest.approx(len(p.streamed) * dequant_seconds("nf4", p.layer_nbytes))
    copies = whole.streamed_bytes / (LINK_GBPS * GB)
    assert predicted_pass_seconds(whole, LINK_GBPS) == pytest.approx(max(copies, streamed_dequant_seconds(whole)))
    assert streamed_dequant_seconds(whole) < copies
    slow = find_gpu("rtx4060ti")           # 288 GB/s: nf4's 1 ms on an H200 becomes 16.4 ms a layer
    assert streamed_dequant_seconds(whole, slow) == pytest.approx(streamed_dequant_seconds(whole) * 4800 / 288)
    assert predicted_pass_seconds(whole, 200.0, card=slow) == pytest.approx(streamed_dequant_seconds(whole, slow))
    small = make_plan(target, draft, OffloadConfig(mode="auto"), nf4, RunLimits(context=4096),
                      Machine.given(8 * GB, 64 * GB))
    assert small.placement.compact and streamed_dequant_seconds(small) == 0.0
    dense = plan_for(specs, "Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct", 24, 192)
    assert dense.target_quant == "none" and streamed_dequant_seconds(dense) == 0.0
