"""Published quantized checkpoints (AutoAWQ's GEMM layout, GPTQ 4/8-bit with act-order, v1 and v2 zeros) read as
they are: the dequantization equals the format's own reference bit for bit (AutoAWQ's, GPTQModel's; pinned by
scripts/awq_reference.py and scripts/gptq_reference.py), the model's output is exactly that of its dequantized
weights, streamed == resident, speculative greedy == its plain greedy, plans from headers, and one line for what is
not supported."""
import json
from pathlib import Path

import pytest
import torch
from drivers import assert_logits_as_published, assert_speculative_greedy_is_plain, on_a_side_stream_without_syncs
from safetensors.torch import load_file
from tiny import hf_config, make_model, perturbed_copy, save_checkpoint, save_published_checkpoint

from offspec.config import OffloadConfig, RuntimeConfig, TreeConfig
from offspec.engine.generate import GenerationRequest, run
from offspec.engine.load import load_engine
from offspec.errors import CheckpointError, InputError
from offspec.formats import published
from offspec.formats.checkpoint import Checkpoint

CPU = torch.device("cpu")
F32 = RuntimeConfig(device=CPU, dtype=torch.float32)
PROMPT = tuple(range(5, 25))
REFERENCE = Path(__file__).parent / "data" / "awq_reference.safetensors"
GPTQ_REFERENCE = Path(__file__).parent / "data" / "gptq_reference.safetensors"
CT_REFERENCE = Path(__file__).parent / "data" / "ct_reference.safetensors"
# (gptq v1 zeros with act-order; v2 zeros in order; compressed-tensors asymmetric with bfloat16 scales)
QUANTS = ["awq-g32", "gptq-b4-g32", "gptq-b8-g64-v2", "ct-b4-g32-asym-bf16"]


def reference_cases(path: Path, quant_of):
    """(quant, pieces, the reference's (N, K) float16 weight) for each case pinned in the file."""
    pinned = load_file(path)
    for case in sorted({name.split(".")[0] for name in pinned}):
        pieces = {name.split(".")[1]: t for name, t in pinned.items() if name.startswith(f"{case}.")}
        yield quant_of(case), pieces, pieces.pop("weight")


@pytest.fixture(params=["one chunk", "small chunks"])
def chunks(request, monkeypatch):
    """Dequantize a matrix at once, or in chunks of a group or a word's rows (their boundaries crossing groups)."""
    if request.param == "small chunks":
        monkeypatch.setattr(published, "DEQUANT_ELEMENTS", 1)


def test_dequantization_equals_autoawq_bitwise(chunks):
    """AutoAWQ's dequantize_gemm on seeded random words (every nibble value), pinned in tests/data."""
    cases = list(reference_cases(REFERENCE, lambda case: f"awq-g{int(case.split('_g')[1])}"))
    assert len(cases) == 3
    for quant, pieces, want in cases:
        for dtype in (torch.float16, torch.float32):
            out = torch.empty(want.shape, dtype=dtype)
            published.dequantize(quant, pieces, out)
            assert torch.equal(out, want.to(dtype)), (quant, dtype)


def test_dequantization_equals_compressed_tensors_bitwise(chunks):
    """compressed-tensors' PackedQuantizationCompressor.decompress on values its pack_to_int32 packed: 4 and 8 bits,
    grouped and per channel, symmetric and not, bfloat16 and float16 scales."""
    def quant_of(case):
        bits, group, sym, scale = case.split("_")
        return f"ct-{bits}-{group}" + ("-asym" if sym == "asym" else "") + f"-{scale}"
    cases = list(reference_cases(CT_REFERENCE, quant_of))
    assert len(cases) == 5
    for quant, pieces, want in cases:
        out = torch.empty(want.shape, dtype=want.dtype)
        published.dequantize(quant, pieces, out)
        assert torch.equal(out, want), quant


def test_dequantization_equals_gptqmodel_bitwise(chunks):
    """GPTQModel's dequantize_weight (and its v1 -> v2 zero conversion, a word sum whose carries it keeps) on seeded
    random words with act-order g_idx: 4 and 8 bits, grouped and one group, v1 and v2 zeros."""
    def quant_of(case):
        bits, group, zeros = case.split("_")
        return f"gptq-{bits}-{group}" + ("-v2" if zeros == "v2" else "")
    cases = list(reference_cases(GPTQ_REFERENCE, quant_of))
    assert {q for q, _, _ in cases} == {"gptq-b4-g32", "gptq-b4-g32-v2", "gptq-b8-g64-v2", "gptq-b4-g0",
                                        "gptq-b8-g32"}
    for quant, pieces, want in cases:
        out = torch.empty(want.shape, dtype=torch.float32)
        published.dequantize(quant, pieces, out)
        assert torch.equal(out, want.float()), quant


def test_quantize_packs_what_dequantize_reads():
    w = torch.randn(64, 256)
    pieces = published.quantize("awq-g64", w)
    assert pieces["qweight"].shape == (256, 8) and pieces["qzeros"].shape == (4, 8)
    assert pieces["scales"].shape == (4, 64)
    out = torch.empty(64, 256)
    published.dequantize("awq-g64", pieces, out)
    step = (w.reshape(64, 4, 64).amax(-1) - w.reshape(64, 4, 64).amin(-1)) / 15          # (N, groups)
    assert ((out - w).abs().reshape(64, 4, 64) <= step[..., None] * 0.51 + 1e-3).all()   # within half a level


@pytest.fixture(scope="module", params=QUANTS)
def pair(tmp_path_factory, request):
    """A published target (qwen2-shaped: biases stay dense), a dense draft that often agrees with it, and the dense
    checkpoint of exactly the target's weights, dequantized (its reference)."""
    root = tmp_path_factory.mktemp(request.param)
    model = make_model(hf_config("qwen2", n_layers=3), seed=7, scale=3.0)
    awq = save_published_checkpoint(model, root / "published", request.param,
                                    act_order=request.param == "gptq-b4-g32")
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


def generation(tree: TreeConfig, new_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt_ids=PROMPT, max_new_tokens=new_tokens, tree=tree, ignore_eos=True)


@pytest.fixture(autouse=True)
def offspec_home(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSPEC_HOME", str(tmp_path / "home"))


def test_the_output_is_exactly_that_of_its_dequantized_weights(pair):
    """Loaded with no flag as the published quantization, resident (dequantized at load, or held as published),
    or streamed (from RAM or from the store), the logits are those of the dense checkpoint holding its
    dequantized weights, bit for bit."""
    awq, _, reference = pair
    assert_logits_as_published(awq, reference, PROMPT)


@pytest.mark.parametrize("policy,budget", [("dyspec", 16), ("chain", 4), ("heap", 16), ("static", 8)])
def test_speculative_greedy_equals_its_plain_greedy(pair, policy, budget):
    awq, draft, _ = pair
    assert_speculative_greedy_is_plain(awq, draft, PROMPT, TreeConfig(policy=policy, budget=budget))


def test_a_published_draft_runs_dequantized(pair):
    """A published folder as the draft: its layers dequantized at load (the draft only proposes: the output stays
    the target's)."""
    awq, draft, reference = pair
    loaded = load_engine(reference, awq, OffloadConfig(), F32, progress=False)
    try:
        plain, _ = run(loaded.engine, generation(TreeConfig(policy="none"), 20))
        spec, _ = run(loaded.engine, generation(TreeConfig(policy="dyspec", budget=16), 20))
        assert spec.tokens == plain.tokens and spec.tokens_per_pass > 1.5
    finally:
        loaded.engine.close()


def test_target_quant_on_a_published_checkpoint_is_one_line(pair):
    described = published.describe(Checkpoint(pair[0]).quant).replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(InputError, match=rf"already quantized \({described}\): --target-quant nf4"):
        load_engine(pair[0], None, OffloadConfig(), RuntimeConfig(device=CPU, dtype=torch.float32, target_quant="nf4"),
                    progress=False)


@pytest.mark.parametrize("quant,change,needle", [
    ("awq-g32", {"quant_method": "fp8"}, "quant_method 'fp8' is not supported"),
    ("awq-g32", {"bits": 8}, "AWQ with 8 bits is not supported"),
    ("awq-g32", {"version": "exllama"}, "AWQ version 'exllama' is not supported"),
    ("awq-g32", {"zero_point": False}, "without zero points"),
    ("awq-g32", {"group_size": 48}, "not a multiple of the group size 48"),
    ("gptq-b4-g32", {"bits": 3}, "GPTQ with 3 bits is not supported"),
    ("gptq-b4-g32", {"checkpoint_format": "marlin"}, "GPTQ checkpoint format 'marlin' is not supported"),
    ("gptq-b4-g32", {"bits": 8}, r"has shape .* config implies"),
    ("awq-g32", {"modules_to_not_convert": ["mlp.down_proj"]}, r"leaves model.layers.0.mlp.down_proj .* unquantized"),
    ("ct-b4-g32-asym-bf16", {"format": "float-quantized"}, "format 'float-quantized' is not supported"),
    ("ct-b4-g32-asym-bf16", {"ignore": ["lm_head", "re:.*self_attn.o_proj"]},
     r"ignore list leaves model.layers.0.self_attn.o_proj"),
    ("ct-b4-g32-asym-bf16", {"ignore": ["re:model.layers.0.mlp"]}, r"ignore list leaves model.layers.0.mlp.gate_proj"),
    ("ct-b4-g32-asym-bf16", {"ignore": ["re:(["]}, "not a valid pattern"),
    ("ct-b4-g32-asym-bf16", {"weights": {"actorder": "group"}}, "actorder 'group' .* not supported"),
    ("ct-b4-g32-asym-bf16", {"transform_config": {"config_groups": {"u": {}}}}, "transform_config"),
    ("ct-b4-g32-asym-bf16", {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ("gptq-b4-g32", {"rotation": "hadamard"}, r"rotation='hadamard' \(an online rotation\)"),
])
def test_what_is_not_supported_is_one_line(tmp_path, quant, change, needle):
    folder = save_published_checkpoint(make_model(hf_config("qwen2", n_layers=1)), tmp_path / "changed", quant)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(change)
    group = config["quantization_config"].get("config_groups", {}).get("group_0", {})
    if quant.startswith("ct-") and "format" in change:
        group["format"] = change["format"]
    if "weights" in change:
        group["weights"].update(config["quantization_config"].pop("weights"))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=needle):
        Checkpoint(folder)


def test_gptq_format_wins_over_checkpoint_format():
    """As GPTQModel reads a config that names both: "format" decides which zeros the file holds."""
    raw = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "format": "gptq_v2",
                                   "checkpoint_format": "gptq"}}
    assert published.quant_of_config(raw, "here") == "gptq-b4-g128-v2"
    del raw["quantization_config"]["format"]
    assert published.quant_of_config(raw, "here") == "gptq-b4-g128"


def test_models_info_plans_it_from_its_pieces(pair):
    """Bytes per layer come from the packed pieces: 4 bits a weight (8 for GPTQ int8), plus a float16 scale and a
    packed zero a group (and GPTQ's g_idx)."""
    from click.testing import CliRunner

    from offspec.cli.main import main
    from offspec.plan.sizes import ModelSpec, TargetLayerSizes
    ckpt = Checkpoint(pair[0])
    quant = ckpt.quant
    assert ModelSpec.of(ckpt).quant == quant and ckpt.parameter_count() == Checkpoint(pair[2]).parameter_count()
    sizes = TargetLayerSizes.of(ckpt.config, torch.float16, quant)
    assert sizes.block < (0.40 if "b4" in quant or "awq" in quant else 0.65) * sizes.resident
    result = CliRunner().invoke(main, ["models", "info", str(pair[0]), "--device-memory", "1GB", "--host-memory",
                                       "8GB", "--dtype", "float16"])
    assert result.exit_code == 0, result.output
    assert f"quantization:    {published.describe(quant)}, read as published ({quant})" in result.output
    assert f"{quant} layer:" in result.output and "as stored" not in result.output, result.output
    assert "options (the target as published: its output exactly):" in result.output


def test_models_prepare_and_generate_from_the_store(pair, tmp_path):
    """`offspec models prepare` on an AWQ folder stores its layers as published; `generate --offload disk` streams
    them from that store and gives the tokens of the resident run."""
    from click.testing import CliRunner

    from offspec.cli.main import main
    from offspec.stream.disk import MANIFEST
    store = tmp_path / "store"
    runner = CliRunner()
    prepared = runner.invoke(main, ["models", "prepare", str(pair[0]), "--dtype", "float32", "--store-dir", str(store)])
    assert prepared.exit_code == 0, prepared.output
    quant = Checkpoint(pair[0]).quant
    assert json.loads((store / MANIFEST).read_text())["quant"] == quant
    tokens = []
    for extra in (["--offload", "none"], ["--offload", "disk", "--store-dir", str(store)]):
        out = tmp_path / f"{extra[1]}.json"
        result = runner.invoke(main, ["generate", "--target", str(pair[0]), "--draft", str(pair[1]), "--device", "cpu",
                                      "--dtype", "float32", "--max-new-tokens", "8", "--raw", *extra, "--json",
                                      str(out), "abc"])
        assert result.exit_code == 0, result.output
        report = json.loads(out.read_text())
        assert report["target_quant"] == quant
        tokens.append(report["tokens"])
    assert tokens[0] == tokens[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dequantization_equals_the_references_without_a_sync():
    """On the device, on a side stream as the ring's copy queue runs it: AutoAWQ's, GPTQModel's and
    compressed-tensors' values, no hidden synchronization."""
    device = torch.device("cuda")
    cases = [*reference_cases(REFERENCE, lambda case: f"awq-g{int(case.split('_g')[1])}"),
             *reference_cases(GPTQ_REFERENCE, lambda case: "gptq-{}-{}".format(*case.split("_")[:2])
                              + ("-v2" if case.endswith("v2") else "")),
             *reference_cases(CT_REFERENCE, lambda case: "ct-{}-{}".format(*case.split("_")[:2])
                              + ("-asym" if "_asym_" in case else "") + "-" + case.split("_")[-1])]
    on_device = [(quant, {k: t.to(device) for k, t in pieces.items()},
                  torch.empty(want.shape, dtype=torch.bfloat16, device=device)) for quant, pieces, want in cases]
    on_a_side_stream_without_syncs(lambda: [published.dequantize(quant, pieces, out)
                                            for quant, pieces, out in on_device])
    for (quant, _, want), (_, _, out) in zip(cases, on_device):
        assert torch.equal(out.cpu(), want.to(torch.bfloat16)), quant      # (the references are float16 or bfloat16)


def test_a_70b_awq_with_a_1b_draft_plans_on_24gb_and_64gb(tmp_path):
    """From headers alone (a folder shaped as hugging-quants' Meta-Llama-3.1-70B-Instruct-AWQ-INT4): 445 MB a layer as
    published; on a 24 GB GPU with 64 GB of RAM the plan holds 18 layers resident as published and streams the other
    62 from pinned RAM, 27.6 GB a pass (PREDICTED 1.15 s at 24 GB/s: the copies, with each streamed layer's
    dequantization, 0.07 s in all as measured on an H200, beside them)."""
    from shapes import headers_only_checkpoint

    from offspec.config import RunLimits
    from offspec.plan.costmodel import LINK_GB_PER_S as LINK_GBPS
    from offspec.plan.costmodel import dequant_seconds
    from offspec.plan.machine import Machine
    from offspec.plan.passtime import predicted_pass_seconds, streamed_dequant_seconds
    from offspec.plan.search import make_plan
    from offspec.plan.sizes import ModelSpec
    target, draft = (ModelSpec.of(Checkpoint(headers_only_checkpoint(tmp_path, name), headers_only=True))
                     for name in ("Meta-Llama-3.1-70B-Instruct-AWQ-INT4", "Llama-3.2-1B-Instruct"))
    assert target.quant == "awq-g128"
    plan = make_plan(target, draft, OffloadConfig(mode="auto"), RuntimeConfig(device=torch.device("cuda"),
                     dtype=torch.float16), RunLimits(context=4096), Machine.given(24 * 10**9, 64 * 10**9))
    p = plan.placement
    assert plan.target_quant == "awq-g128" and plan.mode == "cpu" and plan.host_pinned
    assert 440e6 < plan.block_nbytes < 450e6 and p.resident_held and len(p.resident) == 18
    assert plan.total("device") <= 24 * 10**9
    dequant = streamed_dequant_seconds(plan)
    assert dequant == pytest.approx(62 * dequant_seconds("awq-g128", plan.placement.layer_nbytes))
    assert 1.1 < predicted_pass_seconds(plan, LINK_GBPS) < 1.2 and 0.06 < dequant < 0.08
