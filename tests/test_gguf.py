"""GGUF files read as they are: each type's dequantization equals gguf-py's (llama.cpp's Python reference) bit for
bit; a whole file's weights equal transformers' GGUF loader's; streamed or resident, the output is exactly that of
those weights; speculative greedy equals its plain greedy; split files, the tokenizer from the file, plans, and one
line for what is not supported."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from drivers import (
    assert_logits_as_published,
    assert_speculative_greedy_is_plain,
    loaded_prompt_logits,
    on_a_side_stream_without_syncs,
)
from tiny import hf_config, make_model, perturbed_copy, save_gguf

from offspec.config import OffloadConfig, TreeConfig
from offspec.errors import CheckpointError
from offspec.formats import gguf_blocks, published
from offspec.formats.checkpoint import Checkpoint
from offspec.formats.open import open_checkpoint, same_tokenizer_files

gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
PROMPT = tuple(range(5, 25))
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# Every supported type in one file, two of them differing between layers (as Q4_K_M's attn_v and ffn_down do).
MIXED = {"q_proj": "Q4_K", "k_proj": "Q5_K", "v_proj": ["Q6_K", "Q8_0", "F16"], "o_proj": "Q4_0",
         "gate_proj": ["Q5_0", "BF16", "Q5_0"], "up_proj": "Q4_1", "down_proj": ["Q5_1", "Q6_K", "Q4_K"]}
FIELDS = {"q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
          "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight", "gate_proj": "mlp.gate_proj.weight",
          "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight", "input_norm": "input_layernorm.weight",
          "post_norm": "post_attention_layernorm.weight"}


@pytest.fixture(autouse=True)
def offspec_home(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSPEC_HOME", str(tmp_path / "home"))


def random_blocks(type_name: str, rows: int, K: int, seed: int = 0) -> np.ndarray:
    """(rows, row bytes) uint8 of this type: random fields, float16 scales of a sane size."""
    w = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed))
    from tiny import _gguf_blocks
    blocks = _gguf_blocks(w, type_name, torch.Generator().manual_seed(seed))
    return np.ascontiguousarray(blocks).view(np.uint8).reshape(rows, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", TYPES)
def test_dequantization_equals_gguf_py_bitwise(type_name, dtype, monkeypatch):
    """Several chunks of rows (a small DEQUANT_ELEMENTS), each type's exact float32 arithmetic, then one rounding
    into the compute dtype, as transformers' loader casts gguf-py's float32."""
    monkeypatch.setattr(gguf_blocks, "DEQUANT_ELEMENTS", {"cpu": 2 * 512})
    blocks = random_blocks(type_name, 6, 512)
    qtype = gguf.GGMLQuantizationType[type_name]
    want = (blocks.view(np.float32) if type_name == "F32" else blocks.view(np.float16).astype(np.float32)
            if type_name == "F16" else gguf.quants.dequantize(blocks, qtype))
    out = torch.empty(6, 512, dtype=dtype)
    gguf_blocks.dequantize(type_name, torch.from_numpy(blocks.reshape(-1).copy()), out)
    assert torch.equal(out, torch.from_numpy(np.ascontiguousarray(want)).to(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dequantization_equals_gguf_py_without_a_sync():
    """On the device, on a side stream as the ring's copy queue runs it: every type's values, bit for bit, and no
    hidden synchronization (a host tensor made inside a kernel would be one)."""
    device = torch.device("cuda")
    cases = [(name, random_blocks(name, 8, 512)) for name in TYPES]
    on_device = [(name, torch.from_numpy(blocks.reshape(-1).copy()).to(device),
                  torch.empty(8, 512, dtype=torch.bfloat16, device=device)) for name, blocks in cases]
    on_a_side_stream_without_syncs(lambda: [gguf_blocks.dequantize(name, raw, out) for name, raw, out in on_device])
    for (name, raw, out) in on_device:
        want = torch.empty(8, 512, dtype=torch.bfloat16)
        gguf_blocks.dequantize(name, raw.cpu(), want)
        assert torch.equal(out.cpu(), want), name


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(tmp_path_factory, request):
    """A GGUF target of every type (llama's q and k rows permuted as llama.cpp's converter does), a Q8_0 GGUF draft
    that often agrees with it, and transformers' own reading of the target (its GGUF loader, dequantizing with
    gguf-py) saved as a dense float32 folder: the reference."""
    from transformers import AutoModelForCausalLM

    from offspec.formats.demo import convert_gguf
    root = tmp_path_factory.mktemp(request.param)
    model = make_model(hf_config(request.param, n_layers=3, hidden=256, heads=4, kv_heads=2, vocab=300), seed=7,
                       scale=3.0)
    target = save_gguf(model, root / "target.gguf", MIXED)
    convert_gguf(target, root / "reference", torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(root / "reference", dtype=torch.float32)
    draft = save_gguf(perturbed_copy(reference, noise=0.02), root / "draft.gguf")
    return target, draft, root / "reference"


def test_the_weights_are_transformers_gguf_loaders(pair):
    """Every layer and global tensor, dequantized here, equals transformers' reading of the file; the config is the
    one transformers makes of its metadata."""
    target, _, reference = pair
    ckpt, ref = open_checkpoint(target), Checkpoint(reference)
    assert ckpt.config == ref.config and ckpt.quant.startswith("gguf:")
    for i in range(ckpt.config.n_layers):
        got, want = ckpt.layer_weights(i, CPU, torch.float32), ref.layer_weights(i, CPU, torch.float32)
        for field in FIELDS:
            assert torch.equal(getattr(got, field), getattr(want, field)), (i, field)
    got, want = ckpt.global_weights(CPU, torch.float32), ref.global_weights(CPU, torch.float32)
    assert all(torch.equal(getattr(got, k), getattr(want, k)) for k in ("embed", "lm_head", "final_norm"))


def test_the_output_is_exactly_that_of_its_weights(pair):
    """Resident (dequantized at load, or held as its blocks), streamed from RAM or from the store, the logits are
    the reference folder's bit for bit: each layer's blocks dequantized with that layer's types."""
    target, _, reference = pair
    assert_logits_as_published(target, reference, PROMPT)


@pytest.mark.parametrize("policy,budget", [("dyspec", 16), ("heap", 16), ("chain", 4), ("static", 8)])
def test_speculative_greedy_equals_its_plain_greedy(pair, policy, budget):
    target, draft, _ = pair
    assert_speculative_greedy_is_plain(target, draft, PROMPT, TreeConfig(policy=policy, budget=budget))


def test_generate_reads_the_files_and_their_tokenizer(pair, tmp_path):
    """`offspec generate --target x.gguf --draft y.gguf`: the tokenizer comes from the file (converted once, then
    cached; both files' are one), the tokens are the reference folder's, and the report names the format."""
    from click.testing import CliRunner

    from offspec.cli.main import main
    target, draft, reference = pair
    runner, tokens = CliRunner(), []
    for model, extra in ((reference, []), (target, ["--draft", str(draft), "--offload", "cpu"])):
        out = tmp_path / "report.json"
        result = runner.invoke(main, ["generate", "--target", str(model), *extra, "--device", "cpu", "--dtype",
                                      "float32", "--max-new-tokens", "8", "--tree-budget", "8", "--json", str(out),
                                      "hello"])
        assert result.exit_code == 0, result.output
        tokens.append(json.loads(out.read_text())["tokens"])
    assert tokens[0] == tokens[1]
    assert "GGUF: Q4_K (q), Q5_K (k)" in result.output, result.output
    assert same_tokenizer_files(target, draft) and same_tokenizer_files(target, reference)


def test_models_info_plans_it_from_its_blocks(pair):
    """Bytes per layer from the file's types, each matrix at its largest type over the layers (v: F16 in one
    layer, gate: BF16 in one, down: Q6_K in one)."""
    from click.testing import CliRunner

    from offspec.cli.main import main
    from offspec.plan.sizes import TargetLayerSizes
    ckpt = open_checkpoint(pair[0])
    cfg = ckpt.config
    sizes = TargetLayerSizes.of(cfg, torch.float32, ckpt.quant)
    D, F = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    largest = {"q_proj": 144 / 256 * q * D, "k_proj": 176 / 256 * kv * D, "v_proj": 2 * kv * D,
               "o_proj": 18 / 32 * D * q, "gate_proj": 2 * F * D, "up_proj": 20 / 32 * F * D,
               "down_proj": 210 / 256 * D * F}
    vectors = 4 * (2 * D + (q + 2 * kv if cfg.attention_bias else 0)       # norms, biases, head norms in float32
                   + (2 * cfg.head_dim if cfg.qk_norm else 0))
    assert 0 <= sizes.block - sum(largest.values()) - vectors < 12 * 256       # each entry aligned to 256 bytes
    result = CliRunner().invoke(main, ["models", "info", str(pair[0]), "--device-memory", "1GB", "--host-memory",
                                       "8GB", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    short = published.short(ckpt.quant)
    assert f"quantization:    {published.describe(ckpt.quant)}, read as published ({short})" in result.output
    assert short == "gguf-bf16+f16+q4_0+q4_1+q4_k+q5_0+q5_1+q5_k+q6_k+q8_0" and ckpt.quant not in result.output


def test_split_files_read_as_one(tmp_path):
    """llama.cpp's gguf-split parts (`-00001-of-00002.gguf` ...) load as the model they split."""
    model = make_model(hf_config("qwen2", n_layers=2, hidden=256, heads=4, kv_heads=2, vocab=300), seed=3)
    whole = save_gguf(model, tmp_path / "whole.gguf", {"down_proj": "Q6_K"})
    parts = save_gguf(model, tmp_path / "split.gguf", {"down_proj": "Q6_K"}, split_max_tensors=12)
    first = tmp_path / "split-00001-of-00003.gguf"
    assert parts == first and first.is_file()
    a, b = open_checkpoint(whole), open_checkpoint(first)
    assert a.quant == b.quant and a.config == b.config
    for i in range(2):
        assert all(torch.equal(x, y) for x, y in zip(a.layer_tensors(i).values(), b.layer_tensors(i).values()))
    (tmp_path / "split-00002-of-00003.gguf").unlink()
    with pytest.raises(CheckpointError, match="split-00002-of-00003.gguf is missing"):
        open_checkpoint(first)


def test_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path):
    """llama.cpp keeps llama 3's rope scaling as per-frequency divisors: the parameters that make them are found."""
    cfg = hf_config("llama", n_layers=1, hidden=256, heads=4, kv_heads=2, vocab=300,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    model = make_model(cfg)
    head_dim, theta = 64, 10000.0
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (8192 / wavelen - 1) / 3
    freqs = torch.where(wavelen < 2048, 1.0, torch.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8 + smooth)))
    ckpt = open_checkpoint(save_gguf(model, tmp_path / "l3.gguf", rope_freqs=freqs))
    assert ckpt.config.rope_scaling.kind == "llama3" and ckpt.config.rope_scaling.factor == 8.0
    with pytest.raises(CheckpointError, match="rope_freqs.weight is not llama 3's rope scaling"):
        open_checkpoint(save_gguf(model, tmp_path / "odd.gguf", rope_freqs=freqs * 1.5))


def _rewrite(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    path.write_bytes(data.replace(old, new))


@pytest.mark.parametrize("case,needle", [
    ("type", "tensor blk.0.ffn_up.weight has GGML type Q2_K, which offspec does not read (supported: F32, F16"),
    ("name", "tensor blk.0.ffn_XX.weight is not one offspec runs in a qwen2 model"),
    ("arch", "GGUF architecture 'gemma' is not supported"),
    ("truncated", "truncated or corrupt"),
    ("magic", "not a GGUF file"),
    ("big-endian", "big-endian GGUF files are not supported"),
    ("alignment", "corrupt GGUF header (general.alignment 0)"),
    ("extra", "tensor blk.0.attn_q_norm.weight is not one offspec runs in a qwen2 model"),
    ("number", "GGUF metadata qwen2.attention.head_count is 'four', not a positive integer"),
    ("partial rotary", "GGUF metadata qwen2.rope.dimension_count is 32, not the head size 64: not supported"),
])
def test_what_is_not_supported_is_one_line(tmp_path, case, needle):
    """A type, a tensor or an architecture offspec does not read, a truncated or foreign file: one line naming it,
    and `offspec generate` exits non-zero with it."""
    from click.testing import CliRunner

    from offspec.cli.main import main
    model = make_model(hf_config("qwen3" if case == "extra" else "qwen2", n_layers=1, hidden=256, heads=4, kv_heads=2,
                                 vocab=300))
    meta = {"number": {"qwen2.attention.head_count": "four"}, "partial rotary": {"qwen2.rope.dimension_count": 32},
            "alignment": {"general.alignment": 64}}.get(case)
    path = save_gguf(model, tmp_path / "m.gguf", {"up_proj": "Q5_K"}, meta=meta)
    if case == "extra":          # a qwen3 file (its q and k norms) that says it is qwen2
        path.write_bytes(path.read_bytes().replace(b"qwen3", b"qwen2"))
    elif case == "alignment":
        _rewrite(path, b"general.alignment\x04\x00\x00\x00\x40\x00\x00\x00",
                 b"general.alignment\x04\x00\x00\x00\x00\x00\x00\x00")
    elif case == "big-endian":
        _rewrite(path, b"GGUF\x03\x00\x00\x00", b"GGUF\x00\x00\x00\x03")
    elif case == "type":         # the tensor info's type id (13, Q5_K) -> 10 (Q2_K, whose blocks are as long)
        name = b"blk.0.ffn_up.weight"
        data = bytearray(path.read_bytes())
        at = data.index(name) + len(name) + 4 + 2 * 8
        assert data[at:at + 4] == (13).to_bytes(4, "little")
        data[at:at + 4] = (10).to_bytes(4, "little")
        path.write_bytes(bytes(data))
    elif case == "name":
        _rewrite(path, b"blk.0.ffn_up.weight", b"blk.0.ffn_XX.weight")
    elif case == "arch":
        path.write_bytes(path.read_bytes().replace(b"qwen2", b"gemma"))
    elif case == "truncated":
        path.write_bytes(path.read_bytes()[:-1000])
    elif case == "magic":
        path.write_bytes(b"GGUX" + path.read_bytes()[4:])
    with pytest.raises(CheckpointError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        open_checkpoint(path)
    result = CliRunner().invoke(main, ["generate", "--target", str(path), "--device", "cpu", "--max-new-tokens", "2",
                                       "hi"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert needle.split(" (")[0] in result.output, result.output


def test_each_layer_moves_its_own_bytes_whole_or_split(pair):
    """A matrix whose type differs between layers reserves its largest type's bytes in every block, but a load
    copies only what the layer's own type takes: whole, or part by part through a split ring, whose layers (each
    dequantized with its own types) equal the checkpoint's."""
    from offspec.engine.load import open_target_layers
    from offspec.formats.quant import target_layout
    from offspec.plan.placement import LayerPlan
    from offspec.plan.sizes import TargetLayerSizes
    ckpt = open_checkpoint(pair[0])
    cfg, quant = ckpt.config, ckpt.quant
    layout = target_layout(cfg, torch.float32, quant)
    shapes = {name: shape for name, shape, _ in layout.dense.entries if len(shape) == 2}
    for i in range(cfg.n_layers):
        unused = sum(gguf_blocks.matrix_nbytes(quant, f, s) - s[0] * gguf_blocks.row_nbytes(
            gguf_blocks.type_of(quant, f, i), s[1]) for f, s in shapes.items())
        assert unused > 0           # every layer has a matrix of a smaller type than another layer's
        assert layout.nbytes - unused - 7 * 256 <= layout.moved_nbytes(i) <= layout.nbytes - unused   # (alignment)
        assert sum(n for part in layout.parts(split=True) for _, _, n in part.runs_for(i)) == layout.moved_nbytes(i)
    sizes = TargetLayerSizes.of(cfg, torch.float32, quant)
    assert sizes.moved == tuple(layout.moved_nbytes(i) for i in range(cfg.n_layers))
    budget = 2 * sizes.part + sizes.part_scratch           # room for a split ring alone
    plan = LayerPlan.of(cfg, OffloadConfig(mode="cpu", gpu_budget=budget), torch.float32, quant=quant)
    assert plan.placement.split and not plan.placement.resident
    with open_target_layers(ckpt.layer_tensors, cfg, plan, CPU, torch.float32, progress=False) as layers:
        for _ in range(2):
            for i, w in layers.pass_layers():
                want = ckpt.layer_weights(i, CPU, torch.float32)
                for name in (n for n in FIELDS if getattr(w, n) is not None):
                    assert torch.equal(getattr(w, name), getattr(want, name)), (i, w.part, name)
        copied = layers.stats().bytes - 2 * sum(sizes.moved)      # two passes, and the next one's first loads
        assert 0 <= copied <= plan.placement.n_slots * sizes.part


def test_a_tied_model_without_output_weight(tmp_path):
    """llama.cpp writes no output.weight for a model whose lm_head is its embedding (Qwen2.5's small models): read
    tied, its logits are those of transformers' reading of the file."""
    from offspec.formats.demo import convert_gguf
    model = make_model(hf_config("qwen2", n_layers=2, hidden=256, heads=4, kv_heads=2, vocab=300, tie=True), seed=4)
    path = save_gguf(model, tmp_path / "tied.gguf", {"down_proj": "Q6_K"})
    ckpt = open_checkpoint(path)
    assert ckpt.config.tie_word_embeddings and not ckpt.has_lm_head
    convert_gguf(path, tmp_path / "reference", torch.float32)
    want, _ = loaded_prompt_logits(tmp_path / "reference", PROMPT)
    got, _ = loaded_prompt_logits(path, PROMPT, OffloadConfig(mode="cpu", n_slots=2))
    assert torch.equal(got, want)
