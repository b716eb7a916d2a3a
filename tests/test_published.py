"""Published 4-bit checkpoints (AutoAWQ's GEMM layout) read as they are: the dequantization equals AutoAWQ's own
bit for bit (pinned by scripts/awq_reference.py), the model's output is exactly that of its dequantized weights,
streamed == resident, speculative greedy == its plain greedy, plans from headers, and one line for what is not
supported."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from offspec import published
from offspec.checkpoint import Checkpoint
from offspec.config import OffloadConfig, RuntimeConfig, TreeConfig
from offspec.errors import CheckpointError, InputError
from offspec.generate import GenerationRequest, run
from offspec.kv_cache import KVCache
from offspec.load import load_engine
from drivers import forward_one
from tiny import hf_config, make_model, perturbed_copy, save_awq_checkpoint, save_checkpoint

CPU = torch.device("cpu")
F32 = RuntimeConfig(device=CPU, dtype=torch.float32)
PROMPT = tuple(range(5, 25))
REFERENCE = Path(__file__).parent / "data" / "awq_reference.safetensors"


def test_dequantization_equals_autoawq_bitwise():
    """AutoAWQ's dequantize_gemm on seeded random words (every nibble value), pinned in tests/data."""
    pinned = load_file(REFERENCE)
    cases = sorted({name.split(".")[0] for name in pinned})
    assert len(cases) == 3
    for case in cases:
        group = int(case.split("_g")[1])
        want = pinned[f"{case}.weight"]                                          # (N, K) float16
        for dtype in (torch.float16, torch.float32):
            out = torch.empty(want.shape, dtype=dtype)
            published.dequantize(f"awq-g{group}", {s: pinned[f"{case}.{s}"] for s in ("qweight", "qzeros", "scales")},
                                 out)
            assert torch.equal(out, want.to(dtype)), (case, dtype)


def test_quantize_packs_what_dequantize_reads():
    w = torch.randn(64, 256)
    pieces = published.quantize("awq-g64", w)
    assert pieces["qweight"].shape == (256, 8) and pieces["qzeros"].shape == (4, 8) and pieces["scales"].shape == (4, 64)
    out = torch.empty(64, 256)
    published.dequantize("awq-g64", pieces, out)
    step = (w.reshape(64, 4, 64).amax(-1) - w.reshape(64, 4, 64).amin(-1)) / 15          # (N, groups)
    assert ((out - w).abs().reshape(64, 4, 64) <= step[..., None] * 0.51 + 1e-3).all()   # within half a level


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """An AWQ target (qwen2-shaped: biases stay dense), a dense draft that often agrees with it, and the dense
    checkpoint of exactly the AWQ target's weights, dequantized (its reference)."""
    root = tmp_path_factory.mktemp("awq")
    model = make_model(hf_config("qwen2", n_layers=3), seed=7, scale=3.0)
    awq = save_awq_checkpoint(model, root / "awq", group=32)
    ckpt = Checkpoint(awq)
    reference = model.half().float()
    with torch.no_grad():
        for i, layer in enumerate(reference.model.layers):
            dense = ckpt.layer_tensors(i, dense=True)
            for field, module in (("q_proj", layer.self_attn.q_proj), ("k_proj", layer.self_attn.k_proj),
                                  ("v_proj", layer.self_attn.v_proj), ("o_proj", layer.self_attn.o_proj),
                                  ("gate_proj", layer.mlp.gate_proj), ("up_proj", layer.mlp.up_proj),
                                  ("down_proj", layer.mlp.down_proj)):
                module.weight.copy_(dense[field].float())
    draft = save_checkpoint(perturbed_copy(reference, noise=0.02), root / "draft")     # agrees with the AWQ model
    return awq, draft, save_checkpoint(reference, root / "dequantized")


def prompt_logits(target_dir, offload=OffloadConfig()):
    loaded = load_engine(target_dir, None, offload, F32, progress=False)
    try:
        eng = loaded.engine
        T = len(PROMPT)
        cache = KVCache.for_model(eng.target.cfg, T, eng.target.dtype, CPU)
        mask = torch.arange(T)[:, None] >= torch.arange(T)[None]
        return forward_one(eng.target, torch.tensor(PROMPT), torch.arange(T), torch.arange(T), mask, cache), loaded
    finally:
        loaded.engine.close()


@pytest.fixture(autouse=True)
def offspec_home(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSPEC_HOME", str(tmp_path / "home"))


def test_the_output_is_exactly_that_of_its_dequantized_weights(pair):
    """Loaded with no flag as the published quantization, resident or streamed (from RAM or from the store),
    the logits are those of the dense checkpoint holding its dequantized weights, bit for bit."""
    awq, _, reference = pair
    want, _ = prompt_logits(reference)
    for offload in (OffloadConfig(), OffloadConfig(mode="cpu", n_slots=2), OffloadConfig(mode="disk", n_slots=2)):
        got, loaded = prompt_logits(awq, offload)
        assert loaded.plan.target_quant == "awq-g32" and loaded.engine.target_quant == "awq-g32"
        assert torch.equal(got, want), offload.mode


@pytest.mark.parametrize("policy,budget", [("dyspec", 16), ("chain", 4), ("heap", 16)])
def test_speculative_greedy_equals_its_plain_greedy(pair, policy, budget):
    awq, draft, _ = pair
    loaded = load_engine(awq, draft, OffloadConfig(mode="cpu", n_slots=2), F32, progress=False)
    try:
        request = lambda tree: GenerationRequest(prompt_ids=PROMPT, max_new_tokens=30, tree=tree, ignore_eos=True)  # noqa: E731
        plain, _ = run(loaded.engine, request(TreeConfig(policy="none")))
        spec, _ = run(loaded.engine, request(TreeConfig(policy=policy, budget=budget)))
        assert spec.tokens == plain.tokens and spec.target_quant == "awq-g32"
        assert spec.tokens_per_pass > 1.2
    finally:
        loaded.engine.close()


def test_an_awq_draft_runs_dequantized(pair):
    """An AWQ folder as the draft: its layers dequantized at load (the draft only proposes: the output stays the
    target's)."""
    awq, draft, reference = pair
    loaded = load_engine(reference, awq, OffloadConfig(), F32, progress=False)
    try:
        request = lambda tree: GenerationRequest(prompt_ids=PROMPT, max_new_tokens=20, tree=tree, ignore_eos=True)  # noqa: E731
        plain, _ = run(loaded.engine, request(TreeConfig(policy="none")))
        spec, _ = run(loaded.engine, request(TreeConfig(policy="dyspec", budget=16)))
        assert spec.tokens == plain.tokens and spec.tokens_per_pass > 1.5
    finally:
        loaded.engine.close()


def test_target_quant_on_a_published_checkpoint_is_one_line(pair):
    with pytest.raises(InputError, match=r"already quantized \(AWQ int4 \(GEMM\), groups of 32\): --target-quant nf4"):
        load_engine(pair[0], None, OffloadConfig(), RuntimeConfig(device=CPU, dtype=torch.float32, target_quant="nf4"),
                    progress=False)


@pytest.mark.parametrize("change,needle", [
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
    ({"bits": 8}, "AWQ with 8 bits is not supported"),
    ({"version": "exllama"}, "AWQ version 'exllama' is not supported"),
    ({"zero_point": False}, "without zero points"),
    ({"group_size": 48}, "not a multiple of the group size 48"),
])
def test_what_is_not_supported_is_one_line(pair, tmp_path, change, needle):
    folder = shutil.copytree(pair[0], tmp_path / "changed")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=needle):
        Checkpoint(folder)


def test_models_info_plans_it_from_its_pieces(pair):
    """Bytes per layer come from the packed pieces: about 0.28x of float16 at group 32 (4 bits + a float16
    scale and a 4-bit zero every 32 weights)."""
    from click.testing import CliRunner
    from offspec.cli import main
    from offspec.plan import ModelSpec, TargetLayerSizes
    ckpt = Checkpoint(pair[0])
    spec = ModelSpec.of(ckpt)
    assert spec.quant == "awq-g32" and ckpt.parameter_count() == Checkpoint(pair[2]).parameter_count()
    sizes = TargetLayerSizes.of(ckpt.config, torch.float16, "awq-g32")
    assert sizes.block < 0.40 * sizes.resident
    result = CliRunner().invoke(main, ["models", "info", str(pair[0]), "--device-memory", "1GB", "--host-memory",
                                       "8GB", "--dtype", "float16"])
    assert result.exit_code == 0, result.output
    assert "quantization:    AWQ int4 (GEMM), groups of 32, read as published (awq-g32)" in result.output
    assert "awq-g32 layer:" in result.output and "as stored" not in result.output, result.output


def test_models_prepare_and_generate_from_the_store(pair, tmp_path):
    """`offspec models prepare` on an AWQ folder stores its layers as published; `generate --offload disk` streams
    them from that store and gives the tokens of the resident run."""
    from click.testing import CliRunner
    from offspec.cli import main
    from offspec.stores import MANIFEST
    store = tmp_path / "store"
    runner = CliRunner()
    prepared = runner.invoke(main, ["models", "prepare", str(pair[0]), "--dtype", "float32", "--store-dir", str(store)])
    assert prepared.exit_code == 0, prepared.output
    assert json.loads((store / MANIFEST).read_text())["quant"] == "awq-g32"
    tokens = []
    for extra in (["--offload", "none"], ["--offload", "disk", "--store-dir", str(store)]):
        out = tmp_path / f"{extra[1]}.json"
        result = runner.invoke(main, ["generate", "--target", str(pair[0]), "--draft", str(pair[1]), "--device", "cpu",
                                      "--dtype", "float32", "--max-new-tokens", "8", "--raw", *extra, "--json",
                                      str(out), "abc"])
        assert result.exit_code == 0, result.output
        report = json.loads(out.read_text())
        assert report["target_quant"] == "awq-g32"
        tokens.append(report["tokens"])
    assert tokens[0] == tokens[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dequantization_equals_autoawq_without_a_sync():
    """On the device, on a side stream as the ring's copy queue runs it: AutoAWQ's values, no hidden sync."""
    pinned = load_file(REFERENCE)
    device = torch.device("cuda")
    cases = sorted({name.split(".")[0] for name in pinned})
    pieces = {case: {s: pinned[f"{case}.{s}"].to(device) for s in ("qweight", "qzeros", "scales")} for case in cases}
    outs = {case: torch.empty(pinned[f"{case}.weight"].shape, dtype=torch.bfloat16, device=device) for case in cases}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            for case in cases:
                published.dequantize(f"awq-g{int(case.split('_g')[1])}", pieces[case], outs[case])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side.synchronize()
    for case, out in outs.items():
        assert torch.equal(out.cpu(), pinned[f"{case}.weight"].to(torch.bfloat16)), case
