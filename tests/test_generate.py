"""The generation loop on tiny models: speculative greedy == plain greedy (every policy and budget), cache
bookkeeping, stops inside a block, and plain greedy == transformers' generate."""
import time

import pytest
import torch
from drivers import forward_one
from tiny import hf_config, make_model, perturbed_copy, save_agreeing_pair, save_checkpoint

from offspec.config import OffloadConfig, RuntimeConfig, SamplingConfig, TreeConfig
from offspec.engine.generate import GenerationRequest, run
from offspec.engine.load import load_engine
from offspec.formats.checkpoint import Checkpoint

RUNTIME = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target and a draft that agrees with it often (a noisy copy), both with peaked distributions."""
    return save_agreeing_pair(tmp_path_factory.mktemp("pair"), n_layers=5)


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


@pytest.mark.parametrize("mode,quant", [("none", "none"), ("disk", "none"), ("disk", "int8")])
def test_qwen3_streamed_speculative_greedy_equals_plain(tmp_path, mode, quant):
    """Qwen3's per-head query/key norms travel in the packed (or quantized) layer like any other tensor: a Qwen3
    target, resident or streamed from disk, with a Qwen3 draft, speculates to its own plain greedy tokens, which
    are transformers' own where the target is not quantized."""
    target_dir, draft_dir, hf = save_agreeing_pair(tmp_path, n_layers=3, arch="qwen3")
    offload = OffloadConfig(mode=mode, store_dir=str(tmp_path / "store") if mode == "disk" else None)
    runtime = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32, target_quant=quant)
    eng = load_engine(target_dir, draft_dir, offload, runtime, progress=False).engine
    assert eng.target.cfg.qk_norm
    spec, _ = tokens_of(eng, TreeConfig(policy="dyspec", budget=16), n=30)
    plain, _ = tokens_of(eng, TreeConfig(policy="none"), n=30)
    assert spec.tokens == plain.tokens and spec.tokens_per_pass > 1.5
    if quant == "none":
        with torch.no_grad():
            ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(PROMPT):].tolist()
        assert plain.tokens == ref


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


@pytest.fixture(scope="module")
def weak_pair(pair, tmp_path_factory):
    """The same target with a draft that often disagrees: where the output repeats itself, n-gram branches
    are right and the draft's own nodes are not, so accepted n-gram nodes (never seen by the draft) are common."""
    root = tmp_path_factory.mktemp("weak")
    return pair[0], save_checkpoint(perturbed_copy(pair[2], noise=0.6, seed=5), root / "draft"), pair[2]


@pytest.mark.parametrize("policy", ["dyspec", "heap", "chain", "static"])
def test_levers_off_and_on_equal_plain_and_report_calibration(weak_pair, policy):
    """Calibrated values and n-gram branches only change which nodes are proposed (both are off by default, as in
    the tests above): with them on every policy still equals plain greedy, and the report says how predicted and
    observed acceptance compare."""
    eng = engine(weak_pair)
    plain, _ = tokens_of(eng, TreeConfig(policy="none"), n=60)
    raw, _ = tokens_of(eng, TreeConfig(policy=policy, budget=32), n=60)
    levers, _ = tokens_of(eng, TreeConfig(policy=policy, budget=32, ngram=True, calibrate=True), n=60)
    assert raw.tokens == plain.tokens == levers.tokens
    assert plain.calibration is None and raw.calibration["ngram_nodes"] == 0
    assert raw.calibration["draft_estimate"] == raw.calibration["draft_p"]        # uncalibrated: estimate = p
    cal = levers.calibration
    assert cal["draft_nodes"] > 0 and 0 < cal["draft_observed"] <= 1 and cal["by_depth"][0]["depth"] == "1"
    assert cal["ngram_nodes"] > 0 and cal["ngram_observed"] > 0, "the tiny model repeats itself: n-gram nodes hit"


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


@pytest.mark.parametrize("tree", [TreeConfig(policy="chain", budget=16), TreeConfig(policy="dyspec", budget=32),
                                  TreeConfig()])
def test_no_tree_is_deeper_than_the_tokens_left_need(pair, tree):
    """A round emits its accepted path and a bonus token: with L tokens left its tree is at most L - 1 deep (no
    tree at L = 1), and the tokens are plain greedy's."""
    eng = engine(pair)
    plain, _ = tokens_of(eng, TreeConfig(policy="none"), n=21)
    spec, steps = tokens_of(eng, tree, n=21)
    assert spec.tokens == plain.tokens
    left = 21
    for step in steps:
        assert step.tree_depth <= left - 1                # depth 0: the root alone
        left -= len(step.tokens)
    assert left == 0


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
    from offspec.formats.layout import LayerLayout
    layer_bytes = LayerLayout.of(Checkpoint(pair[0]).config, torch.float32).nbytes
    streamed = engine(pair, OffloadConfig(mode="cpu", n_slots=2, gpu_budget=4 * layer_bytes))
    resident = engine(pair)
    try:
        from offspec.model.kv_cache import KVCache
        cfg = resident.target.cfg
        toks = torch.tensor(PROMPT)
        T = toks.shape[0]
        mask = torch.arange(T)[:, None] >= torch.arange(T)[None]                    # (T, T) causal
        outs = []
        for eng in (resident, streamed):
            cache = KVCache.for_model(cfg, T, torch.float32, torch.device("cpu"))
            outs.append(forward_one(eng.target, toks, torch.arange(T), torch.arange(T), mask, cache))
        assert torch.equal(outs[0], outs[1])
        assert len(streamed.target.layers.placement.resident) == 2
    finally:
        streamed.close()


def test_engine_sampling_is_lossless(tmp_path):
    """End to end through the Engine (draft forward over the tree, caches, compaction): the second emitted token
    (reached through an accepted draft token or a residual sample) follows the target's own distribution.

    The target is made nearly context-free (the exact next-token distribution depends only on the last token:
    attention and MLP outputs are zeroed), so the exact law of token 2 is a matrix product. 3000 runs, alpha =
    0.001, <= 20 support tokens: by Cauchy-Schwarz the noncentrality is >= 3000 (2 TV)^2, so a total-variation
    error of 0.1 is caught with power > 0.999 (one of 0.05 only with power >= 0.64)."""
    import numpy as np
    from scipy.stats import chisquare

    from offspec.spec.sampling import process_logits

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
    from offspec.engine.rows import StopChecker

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


# ---------------------------------------------------------------- caps, context end, chunks (issue #10)

def test_max_new_tokens_below_one_is_refused_by_the_library():
    from offspec.errors import InputError
    for bad in (0, -3):
        with pytest.raises(InputError, match="max_new_tokens must be a whole number >= 1"):
            GenerationRequest(prompt_ids=PROMPT, max_new_tokens=bad)


def test_both_kv_caches_are_capped_at_the_context(pair, monkeypatch):
    """max_new_tokens of a million on a 512-token model: neither cache is sized by it (the draft's was)."""
    from offspec.engine import generate as gen_mod
    capacities = []
    real = gen_mod.KVCache.for_model

    def recording(cfg, capacity, *args, **kwargs):
        capacities.append(capacity)
        return real(cfg, capacity, *args, **kwargs)

    monkeypatch.setattr(gen_mod.KVCache, "for_model", staticmethod(recording))
    eng = engine(pair)
    req = GenerationRequest(prompt_ids=PROMPT, max_new_tokens=1_000_000, tree=TreeConfig(policy="dyspec", budget=16))
    next(iter(eng.generate(req)))
    assert len(capacities) == 2 and max(capacities) <= eng.max_context == 512


@pytest.mark.parametrize("tree", [TreeConfig(policy="dyspec", budget=64), TreeConfig(policy="chain", budget=8),
                                  TreeConfig(policy="dyspec", budget=None)])
def test_at_the_context_end_speculation_emits_what_plain_decoding_does(pair, tree):
    """A prompt 30 tokens short of the 512-token context: plain and speculative decoding stop at the same
    token with finish_reason "context" (a speculative block used to run one token further)."""
    eng = engine(pair)
    prompt = tuple((7 * i) % 120 + 5 for i in range(482))
    plain, _ = tokens_of(eng, TreeConfig(policy="none"), n=1000, prompt=prompt)
    spec, steps = tokens_of(eng, tree, n=1000, prompt=prompt)
    assert plain.finish_reason == spec.finish_reason == "context"
    assert spec.tokens == plain.tokens and len(plain.tokens) == 512 - 1 - len(prompt)
    assert max(s.tree_size for s in steps) > 1


def test_a_planned_context_caps_the_engine(pair):
    from offspec.config import RunLimits
    eng = load_engine(pair[0], pair[1], OffloadConfig(), RUNTIME, progress=False,
                      limits=RunLimits(context=64, tree_budget=8)).engine
    assert eng.max_context == 64 and eng.max_tree_budget == 8
    report, _ = tokens_of(eng, TreeConfig(policy="dyspec", budget=8), n=1000)
    assert report.finish_reason == "context" and len(report.tokens) == 64 - 1 - len(PROMPT)
    from offspec.errors import InputError
    with pytest.raises(InputError, match="more than the engine was planned for"):
        tokens_of(eng, TreeConfig(policy="dyspec", budget=9))


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_forward_equals_one_piece(pair, chunk):
    """Each layer over its rows in chunks, the mask built per chunk: the same logits (fp32) and the same cache."""
    from offspec.engine.mask import PassMask
    from offspec.model.kv_cache import KVCache
    eng = engine(pair)
    cfg = eng.target.cfg
    T = len(PROMPT)
    outs, caches = [], []
    for c in (None, chunk):
        cache = KVCache.for_model(cfg, T, torch.float32, torch.device("cpu"))
        outs.append(forward_one(eng.target, torch.tensor(PROMPT), torch.arange(T), torch.arange(T),
                                PassMask(0, T, None, torch.device("cpu")), cache, chunk=c))
        caches.append(cache)
    # fp32 rounding only: matmuls over fewer rows may sum in another order
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[0].k, caches[1].k, rtol=1e-4, atol=1e-4)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))


def test_nan_caches_catch_a_masked_off_read_of_an_unwritten_slot(pair):
    """Negative control for conftest's NaN-filled caches: a mask one column wider than the slots the forward
    writes (that column masked off for every row) reads a slot nothing wrote, and the logits turn NaN. So a
    forward that read unwritten cache memory fails every test instead of passing on memory that happened to be
    zero (the bug a chunked prefill once had); over exactly its written columns the same forward is finite."""
    from offspec.engine.mask import causal_rows
    from offspec.model.kv_cache import KVCache
    eng = engine(pair)
    T, cpu = len(PROMPT), torch.device("cpu")
    outs = []
    for width in (T + 1, T):
        cache = KVCache.for_model(eng.target.cfg, T + 1, torch.float32, cpu)
        outs.append(forward_one(eng.target, torch.tensor(PROMPT), torch.arange(T), torch.arange(T),
                                causal_rows(0, T, width, cpu), cache))
    assert torch.isnan(outs[0]).all()
    assert torch.isfinite(outs[1]).all()


def test_pass_mask_rows_match_the_whole_mask():
    """PassMask(a, b) = rows a..b-1 of [causal pending rows | tree rows (prefix + ancestors)]; the docstring's example."""
    from offspec.engine.mask import PassMask
    from offspec.spec.tree import TokenTree
    tree = TokenTree(9)
    tree.add(0, 4, 0.5)
    mask = PassMask(3, 2, tree.mask, torch.device("cpu"))
    whole = mask(0, 4).int().tolist()
    assert whole == [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]
    for a, b in [(0, 1), (1, 3), (2, 4), (3, 4)]:
        assert mask(a, b).int().tolist() == whole[a:b]


def test_small_prefill_chunk_keeps_greedy_output(pair):
    from offspec.config import RunLimits
    eng = load_engine(pair[0], pair[1], OffloadConfig(mode="cpu", n_slots=2), RUNTIME, progress=False,
                      limits=RunLimits(prefill_chunk=4)).engine
    try:
        plain, _ = tokens_of(engine(pair), TreeConfig(policy="none"))
        spec, _ = tokens_of(eng, TreeConfig(policy="dyspec", budget=16))
        assert spec.tokens == plain.tokens
    finally:
        eng.close()


def test_sampled_verification_processes_only_the_rows_it_visits(pair, monkeypatch):
    """At T > 0 the target's logits are turned into distributions only at the root and along the accepted
    path, never for all N tree rows (N x V floats plus top-p's sort temporaries: gigabytes at N = 1024)."""
    from offspec.engine import generate as gen_mod
    rows_processed = []
    real = gen_mod.process_logits

    def counting(logits, sampling):
        rows_processed.append(logits.numel() // logits.shape[-1])
        return real(logits, sampling)

    monkeypatch.setattr(gen_mod, "process_logits", counting)
    eng = engine(pair)
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, seed=1)
    req = GenerationRequest(prompt_ids=PROMPT, max_new_tokens=24, tree=TreeConfig(policy="dyspec", budget=64),
                            sampling=sampling, ignore_eos=True)
    original_accept = eng._accept
    verify_rows = []

    def accept(tree, q_logits, sampling, generator):
        before = len(rows_processed)
        verdict, judged = original_accept(tree, q_logits, sampling, generator)
        verify_rows.append((sum(rows_processed[before:]), tree.n_nodes, len(verdict.nodes)))
        return verdict, judged

    monkeypatch.setattr(eng, "_accept", accept)
    list(eng.generate(req))
    assert any(n > 8 for _, n, _ in verify_rows)
    for processed, n_nodes, accepted in verify_rows:
        assert processed == accepted + 1 <= n_nodes     # one row per visited node: the root and the accepted path


def test_timer_waits_for_the_compute_stream_only(monkeypatch):
    """Timing never calls the device-wide torch.cuda.synchronize (it would wait for the copy stream too)."""
    from offspec.engine import metrics
    calls = []

    class Stream:
        def synchronize(self):
            calls.append("stream")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("device-wide synchronize"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    with metrics.Timer(torch.device("cuda")) as t:
        pass
    assert calls == ["stream", "stream"] and t.seconds >= 0


def test_every_copy_is_counted_once_even_when_it_ends_during_the_draft(tmp_path, monkeypatch):
    """With as many slots as streamed layers, every copy of a pass is issued at the end of the pass before and
    may end while the draft works (here the draft's growth waits a little, as a GPU's copies would end). The
    report still counts each pass's layers once: the streamer's readings tile the run (docs/streaming.md §6)."""
    from offspec.engine.generate import Engine
    from offspec.formats.layout import LayerLayout
    grow_all = Engine._grow_all

    def slow_draft(self, *args):
        trees = grow_all(self, *args)
        time.sleep(0.05)
        return trees
    monkeypatch.setattr(Engine, "_grow_all", slow_draft)
    target_dir, draft_dir, _ = save_agreeing_pair(tmp_path, n_layers=2)
    eng = load_engine(target_dir, draft_dir, OffloadConfig(mode="cpu", n_slots=2), RUNTIME, progress=False).engine
    try:
        layer_bytes = LayerLayout.of(Checkpoint(target_dir).config, torch.float32).nbytes
        report, steps = tokens_of(eng, TreeConfig(policy="dyspec", budget=16), n=20)
        moved = sum(s.bytes_streamed for s in steps)
        assert moved % layer_bytes == 0
        assert report.passes - 1 <= moved // (2 * layer_bytes) <= report.passes + 1
    finally:
        eng.close()


def test_on_a_cpu_the_draft_loads_beside_the_first_round(pair):
    """A CPU run with the target resident starts with a plain prefill round, so the draft loads on a thread
    beside it (draft.DraftBeside): the first token does not wait for it, the tokens are plain greedy's, and
    what the run waited for the draft after that round is counted in the start, not in decoding."""
    from offspec.model.draft import DraftBeside
    eng = engine(pair)
    try:
        assert isinstance(eng.draft, DraftBeside)
        report, steps = tokens_of(eng, TreeConfig(policy="dyspec"), n=30)
        plain, _ = tokens_of(eng, TreeConfig(policy="none"), n=30)
        assert report.tokens == plain.tokens and report.tokens_per_pass > 1
        assert steps[0].tree_size == 0 and eng.draft.seconds is not None
        assert report.start is None                # run() was given no start: nothing to add the wait to
    finally:
        eng.close()
    streamed = engine(pair, OffloadConfig(mode="cpu", n_slots=2))
    try:
        assert not isinstance(streamed.draft, DraftBeside)     # a streamed target's first round grows a tree
    finally:
        streamed.close()


def test_a_draft_that_fails_to_load_beside_says_so_at_its_first_use(pair, monkeypatch):
    import offspec.model.draft as draft_module
    from offspec.errors import CheckpointError

    def broken(*args, **kwargs):
        raise CheckpointError("draft: cannot read tensor model.layers.0.q_proj.weight")
    monkeypatch.setattr(draft_module, "load_resident", broken)
    eng = engine(pair)
    try:
        with pytest.raises(CheckpointError, match="cannot read tensor"):
            tokens_of(eng, TreeConfig(policy="dyspec"), n=10)
    finally:
        eng.close()
