"""The generation loop on tiny models: speculative greedy == plain greedy (every policy and budget), cache
bookkeeping, stops inside a block, and plain greedy == transformers' generate."""
import pytest
import torch

from offspec.checkpoint import Checkpoint
from offspec.config import OffloadConfig, RuntimeConfig, SamplingConfig, TreeConfig
from offspec.generate import GenerationRequest, run
from offspec.load import load_engine
from tiny import hf_config, make_model, perturbed_copy, save_checkpoint

RUNTIME = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target and a draft that agrees with it often (a noisy copy), both with peaked distributions."""
    root = tmp_path_factory.mktemp("pair")
    target = make_model(hf_config("qwen2", n_layers=5), seed=7, scale=3.0)
    draft = perturbed_copy(target, noise=0.02)
    return save_checkpoint(target, root / "target"), save_checkpoint(draft, root / "draft"), target


def engine(pair, offload=OffloadConfig(), draft=True):
    return load_engine(pair[0], pair[1] if draft else None, offload, RUNTIME, progress=False).engine


PROMPT = tuple(range(5, 25))


def tokens_of(eng, tree, sampling=SamplingConfig(), n=40, prompt=PROMPT, ignore_eos=True, stops=()):
    req = GenerationRequest(prompt_ids=prompt, max_new_tokens=n, tree=tree, sampling=sampling, ignore_eos=ignore_eos,
                            stop_strings=stops)
    report, steps = run(eng, req)
    return report, steps


def test_plain_greedy_matches_transformers(pair):
    eng = engine(pair, draft=False)
    report, steps = tokens_of(eng, TreeConfig(policy="none"), n=30)
    with torch.no_grad():
        ref = pair[2].generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(PROMPT):].tolist()
    assert report.tokens == ref
    assert report.passes == 30 and report.tokens_per_pass == 1.0


@pytest.mark.parametrize("policy", ["dyspec", "heap", "chain", "static"])
@pytest.mark.parametrize("budget", [1, 8, 64, 256])
def test_speculative_greedy_equals_plain(pair, policy, budget):
    eng = engine(pair)
    plain, _ = tokens_of(eng, TreeConfig(policy="none"))
    spec, steps = tokens_of(eng, TreeConfig(policy=policy, budget=budget))
    assert spec.tokens == plain.tokens
    assert max(s.tree_size for s in steps) <= budget
    if budget >= 8:
        assert spec.tokens_per_pass > 1.5, "the draft agrees often: trees must get accepted"


@pytest.mark.parametrize("threshold", [0.3, 0.05, 0.001])
def test_fixed_thresholds_equal_plain(pair, threshold):
    eng = engine(pair)
    plain, _ = tokens_of(eng, TreeConfig(policy="none"))
    spec, _ = tokens_of(eng, TreeConfig(policy="dyspec", budget=64, threshold=threshold))
    assert spec.tokens == plain.tokens


def test_auto_budget_equals_plain(pair):
    eng = engine(pair)
    plain, _ = tokens_of(eng, TreeConfig(policy="none"), n=60)
    spec, steps = tokens_of(eng, TreeConfig(policy="dyspec", budget=None), n=60)
    assert spec.tokens == plain.tokens
    assert len({s.tree_size for s in steps}) > 1, "auto explores budgets"


def test_stop_string_inside_block_cuts_exactly(pair):
    eng = engine(pair)
    plain, _ = tokens_of(eng, TreeConfig(policy="none"), n=40)
    text = plain.text
    stop = text[12:14]
    cut = text[: text.find(stop)]
    for tree in (TreeConfig(policy="none"), TreeConfig(policy="dyspec", budget=32)):
        report, _ = tokens_of(eng, tree, n=40, stops=(stop,))
        assert report.text == cut
        assert report.finish_reason == "stop"
        assert plain.tokens[: len(report.tokens)] == report.tokens


def test_eos_inside_block_stops_before_it(pair):
    eng = engine(pair)
    plain, _ = tokens_of(eng, TreeConfig(policy="none"), n=40)
    eos = plain.tokens[15]
    first = plain.tokens.index(eos)
    eng.eos_ids = (eos,)
    spec, steps = tokens_of(eng, TreeConfig(policy="dyspec", budget=32), n=40, ignore_eos=False)
    assert spec.tokens == plain.tokens[:first]
    assert spec.finish_reason == "eos"


def test_max_tokens_inside_block(pair):
    eng = engine(pair)
    plain, _ = tokens_of(eng, TreeConfig(policy="none"), n=17)
    spec, _ = tokens_of(eng, TreeConfig(policy="dyspec", budget=64), n=17)
    assert spec.tokens == plain.tokens and len(spec.tokens) == 17
    assert spec.finish_reason == "length"


def test_sampling_runs_and_is_seeded(pair):
    eng = engine(pair)
    s = SamplingConfig(temperature=0.8, top_p=0.9, seed=3)
    a, _ = tokens_of(eng, TreeConfig(policy="dyspec", budget=16), sampling=s)
    b, _ = tokens_of(eng, TreeConfig(policy="dyspec", budget=16), sampling=s)
    assert a.tokens == b.tokens and len(a.tokens) == 40


@pytest.mark.parametrize("offload", [
    OffloadConfig(mode="cpu", n_slots=2),
    OffloadConfig(mode="cpu", n_slots=3, gpu_budget=None),
    OffloadConfig(mode="disk", n_slots=2),
])
def test_streamed_target_equals_resident(pair, tmp_path, offload):
    from dataclasses import replace
    resident = engine(pair)
    if offload.mode == "disk":
        offload = replace(offload, store_dir=str(tmp_path / "store"))
    streamed = engine(pair, offload)
    try:
        for tree in (TreeConfig(policy="none"), TreeConfig(policy="dyspec", budget=16)):
            a, _ = tokens_of(resident, tree)
            b, steps = tokens_of(streamed, tree)
            assert a.tokens == b.tokens
            assert sum(s.bytes_streamed for s in steps) > 0
        assert "arena" in streamed.weights_source() or "disk" in streamed.weights_source()
    finally:
        streamed.close()


def test_streamed_with_resident_layers_bitwise(pair):
    """Logits of a streamed target with some layers resident equal the all-resident logits bitwise."""
    from offspec.model import LayerLayout
    layer_bytes = LayerLayout.of(Checkpoint(pair[0]).config, torch.float32).nbytes
    streamed = engine(pair, OffloadConfig(mode="cpu", n_slots=2, gpu_budget=4 * layer_bytes))
    resident = engine(pair)
    try:
        from offspec.kv_cache import KVCache
        cfg = resident.target.cfg
        toks = torch.tensor([PROMPT])
        T = toks.shape[1]
        mask = (torch.arange(T)[:, None] >= torch.arange(T)[None])[None]
        outs = []
        for eng in (resident, streamed):
            cache = KVCache.for_model(cfg, T, torch.float32, torch.device("cpu"))
            outs.append(eng.target.forward(toks, torch.arange(T)[None], torch.arange(T), mask, cache))
        assert torch.equal(outs[0], outs[1])
        assert len(streamed.target.layers.placement.resident) == 2
    finally:
        streamed.close()


def test_engine_sampling_is_lossless(tmp_path):
    """End to end through the Engine (draft forward over the tree, caches, compaction): the second emitted token
    (reached through an accepted draft token or a residual sample) follows the target's own distribution.

    The target is made nearly context-free (the exact next-token distribution depends only on the last token:
    attention and MLP outputs are zeroed), so the exact law of token 2 is a matrix product. 3000 runs; a
    total-variation error of 0.05 over <= 20 support tokens is caught with power > 0.95 at alpha = 0.001."""
    import numpy as np
    from scipy.stats import chisquare

    from offspec.sampling import process_logits

    target = make_model(hf_config("llama", n_layers=2, vocab=24), seed=11, scale=3.0)
    with torch.no_grad():
        for layer in target.model.layers:        # residual stream = embedding: logits depend on the last token only
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    draft = perturbed_copy(target, noise=0.3)
    from tiny import make_tokenizer
    tok = make_tokenizer(n_tokens=24)            # one id per embedding row
    t_dir = save_checkpoint(target, tmp_path / "t", tok)
    d_dir = save_checkpoint(draft, tmp_path / "d", tok)
    eng = load_engine(t_dir, d_dir, OffloadConfig(), RUNTIME, progress=False).engine
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    with torch.no_grad():
        Q = process_logits(target(torch.arange(24)[:, None]).logits[:, 0], sampling).double()   # (V, V) next | last
    prompt = (5, 9, 7)
    law2 = (Q[prompt[-1]] @ Q).numpy()                                                      # token 2's exact law
    second, widest = [], 0
    for seed in range(3000):
        req = GenerationRequest(prompt_ids=prompt, max_new_tokens=2, ignore_eos=True, sampling=replace_seed(sampling, seed),
                                tree=TreeConfig(policy="dyspec", budget=6, threshold=None, branching=3, max_depth=3))
        steps = list(eng.generate(req))
        tokens = [t for s in steps for t in s.tokens]
        second.append(tokens[1])
        widest = max(widest, steps[0].tree_size)
    counts = np.bincount(second, minlength=24)
    support = law2 > 0
    assert counts[~support].sum() == 0
    expected = law2[support] / law2[support].sum() * len(second)
    assert widest >= 3
    assert chisquare(counts[support], expected).pvalue > 1e-3


def replace_seed(sampling, seed):
    from dataclasses import replace
    return replace(sampling, seed=seed)


def test_stop_checker_decodes_only_a_tail():
    """Stop strings are found when they end at the newest token, however long the output, and each check
    decodes a bounded tail (not the whole text, which made long generations quadratic)."""
    from offspec.generate import StopChecker

    class CharTokenizer:                       # token id = a character's code point
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            self.longest = max(self.longest, len(ids))
            return "".join(map(chr, ids))

    tok = CharTokenizer()
    stops = StopChecker(tok, eos_ids=(), stop_strings=("STOP",), max_new_tokens=10_000)
    generated = [ord("a")] * 5000
    block = [ord(c) for c in "xxSTOPyy"]
    emitted, reason = stops.cut(generated, block)
    assert reason == "stop" and emitted == block[:6]
    assert tok.longest <= stops.window < 100
    assert stops.cut(generated, [ord("S"), ord("T")]) == ([ord("S"), ord("T")], None)
