"""The int8 copy of the draft's matrices: close to the weight, used only for narrow calls, and an int8 draft
leaves speculative output exactly the target's."""
import pytest
import torch
import torch.nn.functional as F
from drivers import forward_one
from tiny import hf_config, make_model, save_agreeing_pair, save_checkpoint

from offspec.config import OffloadConfig, RuntimeConfig, TreeConfig
from offspec.engine.generate import GenerationRequest, run
from offspec.engine.load import load_engine
from offspec.formats.weights import FUSED_MAX_ROWS, Int8Weight, RowKernels, linear, narrow_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_error_is_half_a_step_per_row(dtype):
    w = (torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]).to(dtype)   # rows of very different scales
    qw = Int8Weight.quantize(w)
    assert qw.q.dtype == torch.int8 and qw.scale.shape == (48,) and qw.full is w
    step = qw.scale.float()
    err = (qw.q.float() * step[:, None] - w.float()).abs().amax(dim=1)
    cast = 127 * step * torch.finfo(dtype).eps                         # the scale rounded to `dtype`
    assert torch.all(err <= step * 0.5 + cast + 1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_narrow_sequences_read_the_int8_copy_whatever_shares_the_call(dtype):
    """A packed call of three sequences: the two narrow ones read the int8 copy, the wide one the weight, and each
    sequence's rows are bit for bit what it gets in a call of its own."""
    torch.manual_seed(0)
    w, bias = torch.randn(40, 64, dtype=dtype), torch.randn(40, dtype=dtype)
    qw = Int8Weight.quantize(w)
    widths, cpu = [3, FUSED_MAX_ROWS + 1, 1], torch.device("cpu")
    x = torch.randn(sum(widths), 64, dtype=dtype)
    narrow = narrow_rows(widths, cpu)
    assert narrow.tolist() == [True] * 3 + [False] * (FUSED_MAX_ROWS + 1) + [True]
    got = linear(x, qw, bias, RowKernels(narrow))
    ref = F.linear(x[narrow].float(), qw.dequantize().float(), bias.float())
    assert (got[narrow].float() - ref).norm() / ref.norm() < 0.01
    assert not torch.equal(got[narrow], F.linear(x[narrow], w, bias))     # it really took the int8 path
    assert torch.equal(got[~narrow], F.linear(x[~narrow], w, bias))
    at = 0
    for width in widths:
        alone = linear(x[at:at + width], qw, bias, RowKernels(narrow_rows([width], cpu)))
        assert torch.equal(alone, got[at:at + width]), width
        at += width
    assert torch.equal(linear(x, w, bias, RowKernels(narrow)), F.linear(x, w, bias))   # plain weights: F.linear
    assert torch.equal(linear(x, qw, bias), F.linear(x, w, bias))              # no narrow rows: the weight
    assert narrow_rows([FUSED_MAX_ROWS + 1], cpu) is None
    assert narrow_rows(widths, torch.device("cuda")) is None                   # the fused kernel is a CPU one


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_agreeing_pair(tmp_path_factory.mktemp("qpair"), n_layers=4, seed=3, tie=True)[:2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy,budget", [("dyspec", 8), ("dyspec", 64), ("chain", 4)])
def test_int8_draft_leaves_greedy_output_unchanged(pair, dtype, policy, budget):
    def tokens(draft_quant, tree):
        loaded = load_engine(pair[0], pair[1], OffloadConfig(),
                             RuntimeConfig(device=torch.device("cpu"), dtype=dtype, draft_quant=draft_quant),
                             progress=False)
        report, _ = run(loaded.engine, GenerationRequest(prompt_ids=tuple(range(5, 25)), max_new_tokens=40,
                                                          tree=tree, ignore_eos=True))
        return report

    plain = tokens("none", TreeConfig(policy="none"))
    # Raw trees: this checks the int8 draft; with n-gram branches a 4-node chain shares its budget with n-gram
    # nodes this random model rarely repeats (tests/test_generate.py covers the levers).
    spec = tokens("int8", TreeConfig(policy=policy, budget=budget, ngram=False, calibrate=False))
    if dtype == torch.float32:
        assert spec.tokens == plain.tokens
    else:   # bf16: a many-token pass may round a near-tie otherwise than a one-token pass
        #     (docs/notes/2026-11-22-reading-the-peer-numbers.md, "Token agreement")
        assert len(spec.tokens) == len(plain.tokens) and spec.tokens[:8] == plain.tokens[:8]
    assert spec.tokens_per_pass > 1.5, "an int8 copy of a close draft must still get trees accepted"


def test_int8_draft_weights(pair):
    loaded = load_engine(pair[0], pair[1], OffloadConfig(),
                         RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32, draft_quant="int8"),
                         progress=False)
    draft, target = loaded.engine.draft, loaded.engine.target
    assert isinstance(draft.layers.layers[0].q_proj, Int8Weight) and isinstance(draft.globals.lm_head, Int8Weight)
    assert isinstance(draft.globals.embed, torch.Tensor)              # lookups read the embedding as it is
    assert not isinstance(target.layers.layers[0].q_proj, Int8Weight)  # never the target


# ---------------------------------------------------------------- the draft held quantized (int8-held, nf4)

@pytest.mark.parametrize("quant", ["int8", "nf4"])
@pytest.mark.parametrize("rows", [1, FUSED_MAX_ROWS + 3])
def test_a_held_weight_is_the_dequantized_matrix_and_keeps_no_dense_copy(quant, rows):
    from offspec.formats.weights import HeldWeight
    torch.manual_seed(0)
    w, bias = torch.randn(40, 64), torch.randn(40)
    held = HeldWeight.quantize(w, quant)
    assert held.nbytes < 0.3 * w.numel() * w.element_size()          # fp32: int8 0.27x, nf4 0.14x
    assert all(p.dtype in (torch.int8, torch.uint8, torch.float32) and p.data_ptr() != w.data_ptr()
               for p in held.pieces.values())
    x = torch.randn(rows, 64)
    got = linear(x, held, bias, RowKernels(narrow_rows([rows], torch.device("cpu"))))
    assert torch.allclose(got, F.linear(x, held.dequantize(), bias), atol=1e-4)
    assert not torch.allclose(got, F.linear(x, w, bias), atol=1e-4)   # it really is quantized ...
    exact = F.linear(x, w, bias)
    assert (got - exact).norm() / exact.norm() < {"int8": 0.02, "nf4": 0.15}[quant]     # ... and close


def draft_logits(ckpt_dir, quant):
    """The draft alone over the prompt, one forward: (T, V) float32."""
    from offspec.formats.checkpoint import Checkpoint
    from offspec.model.draft import load_resident
    from offspec.model.kv_cache import KVCache
    model = load_resident(Checkpoint(ckpt_dir), torch.device("cpu"), torch.float32, quant)
    T = 20
    cache = KVCache.for_model(model.cfg, T, torch.float32, torch.device("cpu"))
    mask = torch.arange(T)[:, None] >= torch.arange(T)[None]
    return model, forward_one(model, torch.arange(5, 5 + T), torch.arange(T), torch.arange(T), mask, cache)


@pytest.fixture(scope="module")
def unit_scale_draft(tmp_path_factory):
    """A draft whose weights have unit gain (scale 1): quantization errors add up over its layers instead of
    being amplified 3x a matrix, as in `pair`, whose random model turns any 10% change into another model."""
    return save_checkpoint(make_model(hf_config("qwen2", n_layers=4, tie=True), seed=3),
                           tmp_path_factory.mktemp("unit") / "draft")


@pytest.mark.parametrize("quant,most_rel,most_kl", [("int8-held", 0.03, 1e-3), ("nf4", 0.3, 0.05)])
def test_held_draft_logits_are_close_to_the_dense_drafts(unit_scale_draft, quant, most_rel, most_kl):
    """Measured: int8-held 0.015 relative error, KL 1.3e-4; nf4 0.20, KL 0.022 (bitsandbytes nf4 keeps a
    weight within ~10% of its block's spread, over 28 matrices here)."""
    from offspec.formats.weights import HeldWeight
    _, dense = draft_logits(unit_scale_draft, "none")
    model, held = draft_logits(unit_scale_draft, quant)
    layer = model.layers.layers[0]
    assert isinstance(layer.q_proj, HeldWeight) and isinstance(layer.down_proj, HeldWeight)
    assert isinstance(layer.input_norm, torch.Tensor) and isinstance(model.globals.lm_head, torch.Tensor)
    assert not torch.equal(held, dense)                                  # the control: it is quantized
    assert ((held - dense).norm() / dense.norm()).item() < most_rel
    kl = F.kl_div(held.log_softmax(-1), dense.log_softmax(-1), log_target=True, reduction="batchmean").item()
    assert kl < most_kl


@pytest.mark.parametrize("quant,policy,budget", [("nf4", "dyspec", 16), ("nf4", "chain", 4),
                                                 ("int8-held", "dyspec", 16), ("int8-held", "chain", 4)])
def test_held_draft_leaves_greedy_output_unchanged(pair, quant, policy, budget):
    def tokens(draft_quant, tree):
        loaded = load_engine(pair[0], pair[1], OffloadConfig(),
                             RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32, draft_quant=draft_quant),
                             progress=False)
        report, _ = run(loaded.engine, GenerationRequest(prompt_ids=tuple(range(5, 25)), max_new_tokens=40,
                                                          tree=tree, ignore_eos=True))
        return report

    plain = tokens("none", TreeConfig(policy="none"))
    spec = tokens(quant, TreeConfig(policy=policy, budget=budget, ngram=False, calibrate=False))
    assert spec.tokens == plain.tokens
    # nf4 moves this draft further (its random weights amplify every change 3x a matrix): fewer accepted
    assert spec.tokens_per_pass > (1.5 if quant == "int8-held" else 1.2), "trees must still get accepted"


def test_unknown_draft_quant_is_one_line(pair):
    from offspec.errors import InputError
    with pytest.raises(InputError, match="unknown draft quantization 'fp8'"):
        load_engine(pair[0], pair[1], OffloadConfig(), RuntimeConfig(draft_quant="fp8"), progress=False)


def test_the_help_and_the_readme_quote_the_int8_copys_bound():
    from pathlib import Path

    from click.testing import CliRunner

    from offspec.cli.main import main
    help_text = " ".join(CliRunner().invoke(main, ["generate", "--help"]).output.split())
    assert f"covers at most {FUSED_MAX_ROWS} of that prompt's tokens" in help_text
    readme = (Path(__file__).resolve().parents[1] / "docs" / "options.md").read_text()
    assert f"covers ≤ {FUSED_MAX_ROWS} of that prompt's tokens" in readme


def test_int8_rows_leaves_its_input_alone_and_matches_the_whole_matrix_formula():
    """int8_rows works a block of rows at a time, in place on a float32 copy: a float32 input is not touched, and
    q and scale equal the formula applied to the whole matrix at once (several blocks and a partial one)."""
    from offspec.formats.quant import INT8_ROWS_AT_ONCE, int8_rows
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(2 * INT8_ROWS_AT_ONCE + 37, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
        before = w.clone()
        q, scale = int8_rows(w)
        assert torch.equal(w, before)
        wf = w.float()
        want_scale = wf.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        assert torch.equal(scale, want_scale)
        assert torch.equal(q, torch.round(wf / want_scale[:, None]).clamp(-127, 127).to(torch.int8))
