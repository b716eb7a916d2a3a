"""Batched speculation (Engine.run_batch): many requests share every pass, each row exactly as if alone.

Rows share the passes (one packed target forward, one draft forward per growth step) but nothing else: own
cache row, generator, tree and stop state; attention never crosses rows. So in fp32 a request's tokens in a
batch equal its tokens alone, greedy and sampled (with a fixed tree budget its random draws do not depend on
its neighbours), whatever policy, whenever it joins and whichever rows finish first."""
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from drivers import forward_one
from tiny import hf_config, make_model, perturbed_copy, save_agreeing_pair, save_checkpoint

from offspec.config import OffloadConfig, RunLimits, RuntimeConfig, SamplingConfig, TreeConfig
from offspec.engine.generate import Engine, GenerationRequest
from offspec.engine.load import load_engine

RUNTIME = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_agreeing_pair(tmp_path_factory.mktemp("batch"), n_layers=3)[:2]


@pytest.fixture(scope="module")
def engine(pair):
    return load_engine(pair[0], pair[1], OffloadConfig(), RUNTIME, progress=False, limits=LIMITS).engine


LIMITS = RunLimits(concurrency=5)


def prompts(n):
    g = torch.Generator().manual_seed(3)
    return [tuple(torch.randint(5, 120, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist())
            for _ in range(n)]


def alone(engine, request):
    steps = list(engine.generate(request))
    return [t for s in steps for t in s.tokens], steps[-1].finish_reason


def batched(engine, requests, concurrency):
    tokens = {i: [] for i in range(len(requests))}
    reasons, rows_seen = {}, []
    for event in engine.run_batch(requests, concurrency=concurrency):
        assert event.error is None, event.error
        tokens[event.request] += event.step.tokens
        rows_seen.append(event.step.rows_in_pass)
        if event.step.finish_reason is not None:
            reasons[event.request] = event.step.finish_reason
    return tokens, reasons, rows_seen


@pytest.mark.parametrize("tree", [TreeConfig(policy="dyspec", budget=16), TreeConfig(policy="heap", budget=12),
                                  TreeConfig(policy="chain", budget=4), TreeConfig(policy="static", budget=10),
                                  TreeConfig(policy="none"), TreeConfig(policy="dyspec", budget=24, threshold=0.05),
                                  TreeConfig(policy="dyspec", budget=16, ngram=True, calibrate=True)])
def test_each_row_in_a_batch_equals_its_run_alone(engine, tree):
    # Different prompt lengths and max_new_tokens: rows finish at different passes, and with 7 requests through
    # 3 rows, later requests take the rows that free up (refill).
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=n, tree=tree, ignore_eos=True)
                for p, n in zip(prompts(7), [5, 17, 9, 30, 3, 12, 21])]
    tokens, reasons, rows_seen = batched(engine, requests, concurrency=3)
    assert max(rows_seen) == 3 and min(rows_seen) < 3
    for i, request in enumerate(requests):
        assert (tokens[i], reasons[i]) == alone(engine, request), i


@pytest.fixture(scope="module")
def quantized_draft_engines(pair):
    """The pair with the draft held each way --draft-quant offers (the int8 copy is the CPU default)."""
    return {quant: load_engine(pair[0], pair[1], OffloadConfig(), replace(RUNTIME, draft_quant=quant),
                               progress=False, limits=LIMITS).engine for quant in ("int8", "int8-held")}


@pytest.mark.parametrize("draft_quant", ["none", "int8", "int8-held"])
def test_sampled_rows_have_their_own_randomness(engine, quantized_draft_engines, draft_quant):
    """T > 0, fixed budgets: each row draws from its own generator (seeded by its own seed), so a row's
    tokens are the same alone or in any batch, and rows with different seeds differ. With the draft's int8
    matrices too: a row reads them by its own width in a draft call, never by the call's (weights.narrow_rows)."""
    engine = engine if draft_quant == "none" else quantized_draft_engines[draft_quant]
    sampling = [SamplingConfig(temperature=0.9, top_p=0.95, seed=s) for s in (1, 2, 3, 4, 5)]
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=12, tree=TreeConfig(policy="dyspec", budget=8),
                                  sampling=s, ignore_eos=True) for p, s in zip(prompts(5), sampling)]
    tokens, _, _ = batched(engine, requests, concurrency=5)
    for i, request in enumerate(requests):
        assert tokens[i] == alone(engine, request)[0]
    same_prompt = [GenerationRequest(prompt_ids=prompts(1)[0], max_new_tokens=12, sampling=s, ignore_eos=True,
                                     tree=TreeConfig(policy="dyspec", budget=8)) for s in sampling[:2]]
    t2, _, _ = batched(engine, same_prompt, concurrency=2)
    assert t2[0] != t2[1]


def test_stops_inside_a_batch(engine):
    """EOS, a stop string and max tokens, each inside an accepted block, in rows that share passes: each row
    stops where it stops alone, speculating or plainly decoding (--tree none)."""
    base = [GenerationRequest(prompt_ids=p, max_new_tokens=30, tree=TreeConfig(policy="dyspec", budget=16),
                              ignore_eos=True) for p in prompts(3)]
    free_run = [alone(engine, r)[0] for r in base]
    eos = free_run[0][7]
    text = engine.tokenizer.decode(free_run[1], skip_special_tokens=True)
    stop = text[10:12]
    engine.eos_ids = (eos,)
    try:
        requests = [GenerationRequest(prompt_ids=base[0].prompt_ids, max_new_tokens=30, tree=base[0].tree),
                    GenerationRequest(prompt_ids=base[1].prompt_ids, max_new_tokens=30, tree=base[1].tree,
                                      stop_strings=(stop,), ignore_eos=True),
                    GenerationRequest(prompt_ids=base[2].prompt_ids, max_new_tokens=13, tree=base[2].tree,
                                      ignore_eos=True)]
        tokens, reasons, _ = batched(engine, requests, concurrency=3)
        for i, request in enumerate(requests):
            assert (tokens[i], reasons[i]) == alone(engine, request)
            assert (tokens[i], reasons[i]) == alone(engine, replace(request, tree=TreeConfig(policy="none")))
        assert reasons == {0: "eos", 1: "stop", 2: "length"}
        assert tokens[0] == free_run[0][:free_run[0].index(eos)]
    finally:
        engine.eos_ids = ()


def test_a_row_at_the_context_end_beside_others(engine):
    long = tuple((7 * i) % 110 + 5 for i in range(490))           # 22 short of the 512-token context
    requests = [GenerationRequest(prompt_ids=long, max_new_tokens=100, tree=TreeConfig(policy="dyspec", budget=32),
                                  ignore_eos=True),
                *[GenerationRequest(prompt_ids=p, max_new_tokens=40, tree=TreeConfig(policy="dyspec", budget=32),
                                    ignore_eos=True) for p in prompts(2)]]
    tokens, reasons, _ = batched(engine, requests, concurrency=3)
    assert reasons[0] == "context" and len(tokens[0]) == 512 - 1 - len(long)
    for i, request in enumerate(requests):
        assert (tokens[i], reasons[i]) == alone(engine, request)


def test_requests_put_while_the_batch_runs_take_free_rows_at_the_next_pass(engine):
    """An open RequestFeed (a Ray worker's): each time a row finishes, the next request is put into the feed
    (as the driver does on receiving its line); it takes the free row at the next pass, so every pass until
    the feed runs dry has both rows, and each output equals the request alone. The batch ends once the feed
    is closed and its rows have finished."""
    from offspec.engine.feed import RequestFeed

    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=n, tree=TreeConfig(policy="dyspec", budget=12),
                                  ignore_eos=True) for p, n in zip(prompts(6), (9, 5, 14, 3, 8, 6))]
    feed = RequestFeed(tokens_a_row=max(len(r.prompt_ids) + r.max_new_tokens for r in requests))
    feed.put([(0, requests[0]), (1, requests[1])])
    later = list(enumerate(requests))[2:]
    tokens, rows_until_dry = {i: [] for i in range(len(requests))}, []
    for event in engine.run_batch(feed, concurrency=2):
        assert event.error is None, event.error
        tokens[event.request] += event.step.tokens
        if later:
            rows_until_dry.append(event.step.rows_in_pass)
        if event.step.finish_reason is not None:
            if later:
                feed.put([later.pop(0)])
            else:
                feed.close()
    assert rows_until_dry and set(rows_until_dry) == {2}
    for i, request in enumerate(requests):
        assert tokens[i] == alone(engine, request)[0]


def test_a_cancelled_request_leaves_at_the_next_pass_and_the_others_run_as_alone(engine):
    """RequestFeed.cancel (a server's client that went away): a running request yields nothing after the pass
    it was cancelled in and its row takes the next waiting request; a waiting one never runs; the others'
    outputs are their outputs alone."""
    from offspec.engine.feed import RequestFeed

    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=n, tree=TreeConfig(policy="dyspec", budget=12),
                                  ignore_eos=True) for p, n in zip(prompts(4), (30, 10, 10, 10))]
    feed = RequestFeed(tokens_a_row=max(len(r.prompt_ids) + r.max_new_tokens for r in requests))
    feed.put(enumerate(requests))
    feed.close()
    feed.cancel(3)                                   # waiting: taken out before it runs
    tokens, steps_of_0 = {i: [] for i in range(4)}, 0
    for event in engine.run_batch(feed, concurrency=2):
        tokens[event.request] += event.step.tokens
        if event.request == 0:
            steps_of_0 += 1
            assert steps_of_0 <= 2, "a cancelled row went on after the next pass"
            if steps_of_0 == 2:
                feed.cancel(0)                       # running: its row is freed before the next pass
    assert steps_of_0 == 2 and not tokens[3] and len(tokens[0]) < 30
    for i in (1, 2):
        assert tokens[i] == alone(engine, requests[i])[0]


def test_fixed_budget_rows_after_auto_budget_rows_finished(engine):
    """A batch whose auto-budget rows have all finished goes on with fixed-budget rows alone (the controller
    then has no row to budget: it must not divide by their count)."""
    from offspec.engine.feed import RequestFeed

    auto = GenerationRequest(prompt_ids=prompts(1)[0], max_new_tokens=3, ignore_eos=True)
    fixed = GenerationRequest(prompt_ids=prompts(2)[1], max_new_tokens=12, ignore_eos=True,
                              tree=TreeConfig(policy="dyspec", budget=8))
    feed = RequestFeed(tokens_a_row=64)
    feed.put([(0, auto)])
    tokens = {0: [], 1: []}
    for event in engine.run_batch(feed, concurrency=2):
        tokens[event.request] += event.step.tokens
        if event.request == 0 and event.step.finish_reason is not None:
            feed.put([(1, fixed)])
        if event.request == 1 and event.step.finish_reason is not None:
            feed.close()
    assert tokens[1] == alone(engine, fixed)[0] and tokens[0] == alone(engine, auto)[0]


def test_with_no_row_in_flight_the_batch_waits_for_the_feed(engine):
    """An open, empty feed: run_batch waits (no busy loop, no early end) until another thread puts a
    request, and ends when that thread closes the feed."""
    import threading

    from offspec.engine.feed import RequestFeed

    request = GenerationRequest(prompt_ids=prompts(1)[0], max_new_tokens=5, ignore_eos=True)
    feed = RequestFeed(tokens_a_row=len(request.prompt_ids) + 5)

    def driver():
        feed.put([("late", request)])
        feed.close()

    timer = threading.Timer(0.3, driver)
    timer.start()
    try:
        events = list(engine.run_batch(feed, concurrency=2))
    finally:
        timer.join()
    assert {e.request for e in events} == {"late"}
    assert [t for e in events for t in e.step.tokens] == alone(engine, request)[0]


def test_a_request_longer_than_an_open_feed_said_is_refused(pair):
    """An open feed's rows hold tokens_a_row + the largest tree; a request needing more is refused in one line
    (it would overrun its cache row), the others run."""
    from offspec.engine.feed import RequestFeed

    small_trees = load_engine(pair[0], pair[1], OffloadConfig(), RUNTIME, progress=False,
                              limits=RunLimits(concurrency=2, tree_budget=8)).engine
    fits, too_long = (GenerationRequest(prompt_ids=p, max_new_tokens=n, tree=TreeConfig(budget=8))
                      for p, n in zip(prompts(2), (4, 60)))
    feed = RequestFeed(tokens_a_row=len(fits.prompt_ids) + 4)
    feed.put([("fits", fits), ("too long", too_long)])
    feed.close()
    events = list(small_trees.run_batch(feed, concurrency=2))
    refused = [e for e in events if e.error is not None]
    assert [e.request for e in refused] == ["too long"] and "rows hold" in str(refused[0].error)
    assert any(e.request == "fits" and e.step.finish_reason for e in events if e.error is None)


def test_a_feed_closed_ahead_of_its_last_put_stays_open_for_it():
    """A Ray actor's calls may run out of order: the driver's close(after=n) can arrive before its last put;
    the feed ends only once n requests came, and refuses more."""
    from offspec.engine.feed import RequestFeed

    feed = RequestFeed()
    feed.put([(0, "a")])
    feed.close(after=2)
    assert feed.wait() and feed.take() == (0, "a") and feed.waiting() == 0
    feed.put([(1, "b")])                     # the put the close overtook
    assert feed.wait() and feed.take() == (1, "b")
    assert not feed.wait()                   # closed and empty: returns at once
    with pytest.raises(ValueError, match="closed"):
        feed.put([(2, "c")])
    assert RequestFeed.of(["x", "y"]).known == ["x", "y"]


def test_concurrency_above_the_plan_is_refused(engine):
    from offspec.errors import InputError
    with pytest.raises(InputError, match="concurrency 6 is more than the engine was planned for"):
        next(engine.run_batch([GenerationRequest(prompt_ids=(5, 6))] * 6, concurrency=6))


def test_a_bad_request_is_refused_and_the_others_run(engine):
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=6, ignore_eos=True) for p in prompts(2)]
    requests.insert(1, GenerationRequest(prompt_ids=tuple(range(5, 600)), max_new_tokens=4))   # longer than the context
    errors, done = {}, set()
    for event in engine.run_batch(requests, concurrency=2):
        if event.error is not None:
            errors[event.request] = str(event.error)
        elif event.step.finish_reason:
            done.add(event.request)
    assert list(errors) == [1] and "context holds only 512" in errors[1] and done == {0, 2}


def test_streamed_batch_equals_resident_alone(pair, engine, tmp_path):
    streamed = load_engine(pair[0], pair[1], OffloadConfig(mode="disk", n_slots=2, store_dir=str(tmp_path / "s")),
                           RUNTIME, progress=False, limits=LIMITS).engine
    try:
        requests = [GenerationRequest(prompt_ids=p, max_new_tokens=n, tree=TreeConfig(policy="dyspec", budget=16),
                                      ignore_eos=True) for p, n in zip(prompts(4), [8, 14, 5, 11])]
        tokens, _, _ = batched(streamed, requests, concurrency=4)
        for i, request in enumerate(requests):
            assert tokens[i] == alone(engine, request)[0]
    finally:
        streamed.close()


# ---------------------------------------------------------------- caches after every round, and negative controls

def fresh_prefill(model, tokens):
    """(k, v) of `tokens` run from scratch through `model`, each (L, H_kv, T, hd)."""
    from offspec.model.kv_cache import KVCache
    T = len(tokens)
    cache = KVCache.for_model(model.cfg, T, torch.float32, torch.device("cpu"))
    positions = torch.arange(T)
    forward_one(model, torch.tensor(tokens), positions, positions, positions[None, :] <= positions[:, None], cache)
    return cache.k[:, 0], cache.v[:, 0]


@contextmanager
def caches_checked(engine):
    """While inside: after every round, before its finished rows retire (Engine._retire), each row's target and
    draft cache rows hold exactly what a fresh prefill of its committed tokens gives (fp32, up to matmul
    rounding), so no rejected token, sibling or other row left a trace. Yields the list of rows checked."""
    retire, checked = Engine._retire, []

    def check(batch, finished):
        for row in batch.rows:
            for model, cache in ((engine.target, batch.t_cache), (engine.draft, batch.d_cache)):
                L = cache.lengths[row.cache_row]
                if L == 0:                      # a prompt still joining has not reached the draft yet
                    continue
                k, v = fresh_prefill(model, row.seq[:L])
                torch.testing.assert_close(cache.k[:, row.cache_row, :, :L], k, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(cache.v[:, row.cache_row, :, :L], v, rtol=1e-4, atol=1e-4)
            checked.append(row.index)
        retire(batch, finished)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "_retire", staticmethod(check))
        yield checked


def requests_for_checks():
    return [GenerationRequest(prompt_ids=p, max_new_tokens=n, tree=TreeConfig(policy="dyspec", budget=16),
                              ignore_eos=True) for p, n in zip(prompts(4), [9, 14, 6, 11])]


def run_checked(engine, requests, concurrency=3):
    tokens = {i: [] for i in range(len(requests))}
    with caches_checked(engine) as checked:
        for event in engine.run_batch(requests, concurrency=concurrency):
            tokens[event.request] += event.step.tokens
    assert set(checked) == set(range(len(requests)))       # every row's caches were checked
    return tokens


def test_after_every_round_each_rows_caches_equal_a_fresh_prefill(engine):
    requests = requests_for_checks()
    tokens = run_checked(engine, requests)
    assert all(tokens[i] == alone(engine, r)[0] for i, r in enumerate(requests))


class _TreeView:
    """A working tree as the draft sees it, with one thing wrong (for the negative controls)."""

    def __init__(self, tree, mask=None, depths=None):
        self._tree, self._mask, self._depths = tree, mask, depths

    def __getattr__(self, name):
        return getattr(self._tree, name)

    @property
    def mask(self):
        return self._mask if self._mask is not None else self._tree.mask

    @property
    def depths(self):
        return self._depths if self._depths is not None else self._tree.depths


@pytest.mark.parametrize("broken", ["sibling visible in a draft mask row", "draft positions off by one",
                                    "another row's cache visible"])
def test_negative_controls_are_caught(engine, monkeypatch, broken):
    from offspec.engine.generate import Engine
    from offspec.model.kv_cache import KVCache
    if broken == "another row's cache visible":
        real_write = KVCache.write

        def leaky_write(self, layer, row, slots, k, v):
            real_write(self, layer, row, slots, k, v)
            if self.k.shape[1] > 1:                      # ... and into the next row too
                real_write(self, layer, (row + 1) % self.k.shape[1], slots, k, v)
        monkeypatch.setattr(KVCache, "write", leaky_write)
    else:
        real_step = Engine._draft_step_all

        def broken_step(self, rows, requests, cache):
            views = {}
            for i, (tree, frontier) in requests.items():
                if broken.startswith("sibling"):
                    views[i] = (_TreeView(tree, mask=torch.ones_like(tree.mask)), frontier)
                else:
                    views[i] = (_TreeView(tree, depths=tree.depths + 1), frontier)
            return real_step(self, rows, views, cache)
        monkeypatch.setattr(Engine, "_draft_step_all", broken_step)
    with pytest.raises(AssertionError):
        run_checked(engine, requests_for_checks())


def test_sampling_is_lossless_with_several_rows_in_flight(tmp_path):
    """The engine-level chi-square test of tests/test_generate.py, with 8 rows in flight: each request's second
    token (through an accepted draft token or a residual sample) follows the target's own law. A near
    context-free target (attention and MLP outputs zeroed) makes that law a matrix product. 2400 requests over
    3 prompts, so 800 samples a law; alpha = 0.001, <= 20 support tokens: by Cauchy-Schwarz a total-variation
    error of 0.15 is caught with power > 0.998 (one of 0.1 with power >= 0.69)."""
    import numpy as np
    from scipy.stats import chisquare
    from tiny import make_tokenizer

    from offspec.spec.sampling import process_logits

    target = make_model(hf_config("llama", n_layers=2, vocab=24), seed=11, scale=3.0)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    draft = perturbed_copy(target, noise=0.3)
    tok = make_tokenizer(n_tokens=24)
    t_dir, d_dir = save_checkpoint(target, tmp_path / "t", tok), save_checkpoint(draft, tmp_path / "d", tok)
    eng = load_engine(t_dir, d_dir, OffloadConfig(), RUNTIME, progress=False, limits=RunLimits(concurrency=8)).engine
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    with torch.no_grad():
        Q = process_logits(target(torch.arange(24)[:, None]).logits[:, 0], sampling).double()   # (V, V)
    prompts_ = [(5, 9, 7), (3, 4), (11, 2, 8, 6)]                     # rows with different prompts share passes
    requests = [GenerationRequest(prompt_ids=prompts_[i % 3], max_new_tokens=2, ignore_eos=True,
                                  sampling=SamplingConfig(temperature=1.0, top_p=0.95, seed=i),
                                  tree=TreeConfig(policy="dyspec", budget=6, branching=3, max_depth=3))
                for i in range(2400)]
    tokens = {i: [] for i in range(len(requests))}
    widest = 0
    for event in eng.run_batch(requests, concurrency=8):
        tokens[event.request] += event.step.tokens
        widest = max(widest, event.step.rows_in_pass)
    assert widest == 8
    for k, prompt in enumerate(prompts_):
        law2 = (Q[prompt[-1]] @ Q).numpy()
        second = [tokens[i][1] for i in range(k, len(requests), 3)]
        counts = np.bincount(second, minlength=24)
        support = law2 > 0
        assert counts[~support].sum() == 0
        expected = law2[support] / law2[support].sum() * len(second)
        assert chisquare(counts[support], expected).pvalue > 1e-3, prompt


# The exact law of whole continuations, through the batched engine, with a target whose next token depends on
# its context (attention and MLP intact): a request's first LAW_TOKENS tokens must follow
#     P(t_1 .. t_K | prompt) = prod_i q(t_i | prompt, t_1 .. t_(i-1)),
# each factor read off the transformers model itself. Trees reach depth 4 and a round often accepts 3 or 4
# drafted tokens, so the law runs through verification at depths >= 3, residual draws, the bonus token, and the
# caches a second round reads. LAW_REQUESTS requests over 2 prompts (1500 a law) with 8 rows in flight; the
# 4-token outcomes with an expected count >= 5 are cells of their own and the rest one merged cell (12-20 cells
# here); alpha = 0.001. A sampler at total-variation distance >= 0.1 from the law on those cells gives lambda >=
# 1500 * (2 * 0.1)^2 = 60 (Cauchy-Schwarz), caught with power >= 0.95 for df <= 20 (P(ncx2(20, 60) > 45.3)).
# The negative controls below show that a verifier reading its parent's distribution, a target attending to the
# whole tree, and a cache keeping the wrong tree rows are each caught.
LAW_TOKENS, LAW_REQUESTS, LAW_V = 4, 3000, 8
LAW_PROMPTS = [(5, 3, 7, 1), (6, 4, 4)]


@pytest.fixture(scope="module")
def context_pair(tmp_path_factory):
    """(engine, transformers target) of a V = 8 pair: a target with every layer intact, a 10% noisy draft."""
    from tiny import make_tokenizer
    root = tmp_path_factory.mktemp("law")
    target = make_model(hf_config("llama", n_layers=2, vocab=LAW_V), seed=11, scale=1.5)
    draft = perturbed_copy(target, noise=0.1)
    tok = make_tokenizer(n_tokens=LAW_V)
    t_dir, d_dir = save_checkpoint(target, root / "t", tok), save_checkpoint(draft, root / "d", tok)
    engine = load_engine(t_dir, d_dir, OffloadConfig(), RUNTIME, progress=False,
                         limits=RunLimits(concurrency=8)).engine
    return engine, target


def continuation_law(target, prompt: tuple[int, ...], sampling: SamplingConfig, k: int) -> dict[tuple, float]:
    """{(t_1 .. t_k): P(t_1 .. t_k | prompt)} under the transformers model, every factor processed by `sampling`."""
    from offspec.spec.sampling import process_logits
    with torch.no_grad():
        q = process_logits(target(torch.tensor([prompt])).logits[0, -1], sampling).double()   # (V,)
    if k == 1:
        return {(t,): float(q[t]) for t in range(q.numel())}
    return {(t, *rest): float(q[t]) * law for t in range(q.numel()) if q[t] > 0
            for rest, law in continuation_law(target, (*prompt, t), sampling, k - 1).items()}


LAW_TREE = TreeConfig(policy="dyspec", budget=8, branching=3, max_depth=4)


def continuation_pvalues(context_pair, tree: TreeConfig = LAW_TREE) -> tuple[list[float], int]:
    """The engine's continuations of LAW_PROMPTS against their laws: (p-value a prompt, 0 where an outcome the law
    rules out came; rounds that accepted 3 or more drafted tokens)."""
    import numpy as np
    from scipy.stats import chisquare

    engine, target = context_pair
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    requests = [GenerationRequest(prompt_ids=LAW_PROMPTS[i % 2], max_new_tokens=LAW_TOKENS, ignore_eos=True,
                                  sampling=replace(sampling, seed=i), tree=tree)
                for i in range(LAW_REQUESTS)]
    tokens, deep = {i: [] for i in range(LAW_REQUESTS)}, 0
    for event in engine.run_batch(requests, concurrency=8):
        tokens[event.request] += event.step.tokens
        deep += event.step.accepted >= 3
    pvalues = []
    for k, prompt in enumerate(LAW_PROMPTS):
        law = continuation_law(target, prompt, sampling, LAW_TOKENS)
        seen: dict[tuple, int] = {}
        for i in range(k, LAW_REQUESTS, 2):
            seen[tuple(tokens[i])] = seen.get(tuple(tokens[i]), 0) + 1
        if any(law.get(outcome, 0.0) == 0 for outcome in seen):   # an outcome the target can never produce
            pvalues.append(0.0)
            continue
        n = sum(seen.values())
        own = [o for o in law if law[o] * n >= 5]
        expected = np.array([law[o] for o in own] + [1.0 - sum(law[o] for o in own)]) * n
        observed = np.array([seen.get(o, 0) for o in own] + [n - sum(seen.get(o, 0) for o in own)])
        pvalues.append(chisquare(observed, expected * n / expected.sum()).pvalue)
    return pvalues, deep


@pytest.mark.parametrize("tree", [LAW_TREE, TreeConfig(policy="static", budget=8, static_widths=(2, 1, 1, 1),
                                                        ngram=True, calibrate=True)], ids=["dyspec", "static-levers"])
def test_continuations_follow_the_context_dependent_targets_law(context_pair, tree):
    pvalues, deep = continuation_pvalues(context_pair, tree)
    assert deep > LAW_REQUESTS / 4, deep           # verification at depth >= 3 really happened, often
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.parametrize("broken", ["verifier reads the parent's distribution", "target attends to the whole tree",
                                    "cache keeps the first tree rows"])
def test_the_law_test_catches_wrong_verification_attention_and_caches(context_pair, monkeypatch, broken):
    from offspec.engine import generate, mask
    from offspec.model.kv_cache import KVCache
    if broken.startswith("verifier"):
        accept = generate.Engine._accept

        def parents_rows(tree, q_logits, sampling, generator):
            return accept(tree, q_logits[tree.parents.clamp(min=0)], sampling, generator)
        monkeypatch.setattr(generate.Engine, "_accept", staticmethod(parents_rows))
    elif broken.startswith("target"):
        init = mask.PassMask.__init__

        def whole_tree(self, first_slot, n_pending, tree_mask, device):
            init(self, first_slot, n_pending, None if tree_mask is None else torch.ones_like(tree_mask), device)
        monkeypatch.setattr(mask.PassMask, "__init__", whole_tree)
    else:
        compact = KVCache.compact

        def first_rows(self, kept_slots, start, row=0):
            compact(self, torch.arange(start, start + kept_slots.numel()), start, row)
        monkeypatch.setattr(KVCache, "compact", first_rows)
    assert min(continuation_pvalues(context_pair)[0]) < 1e-3


@pytest.mark.parametrize("per_pass", [7, None])
def test_a_long_prompt_joins_in_chunks_beside_decoding_rows(engine, per_pass):
    """Continuous refill with a long prompt: while other rows decode it is fed prefill_per_pass tokens a pass
    (Steps without tokens), the others keep emitting in those passes, and every row still equals its run alone
    with its caches equal to a fresh prefill after every round (a chunk in the wrong slots or unmasked shows)."""
    g = torch.Generator().manual_seed(11)
    long_prompt = tuple(torch.randint(5, 120, (45,), generator=g).tolist())
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=n, tree=TreeConfig(policy="dyspec", budget=8),
                                  ignore_eos=True)
                for p, n in zip([*prompts(2), long_prompt, *prompts(3)[2:]], [4, 30, 10, 6])]
    tokens, fed, beside = {i: [] for i in range(len(requests))}, [], 0
    with caches_checked(engine) as checked:
        for event in engine.run_batch(requests, concurrency=2, prefill_per_pass=per_pass):
            assert event.error is None, event.error
            if event.request == 2 and not tokens[2]:
                fed.append(event.step.pass_tokens)
            if event.request != 2 and fed and not tokens[2]:
                beside += len(event.step.tokens)            # others' tokens while the long prompt joins
            tokens[event.request] += event.step.tokens
    assert set(checked) == set(range(len(requests)))
    for i, request in enumerate(requests):
        assert tokens[i] == alone(engine, request)[0], i
    if per_pass is not None:
        # 45 prompt tokens joining beside a decoding row: 44 before the root in chunks of 7, then the last 2
        # with the root and the first tree.
        assert fed[:6] == [7] * 6 and fed[6] > 3 and len(fed) == 7
        assert beside >= 6, "the decoding row kept emitting while the long prompt joined"
    assert sum(fed) > len(long_prompt)        # the prompt went in whole, then its first tree was verified


def test_auto_concurrency_refills_only_the_rows_the_costs_favour(engine, monkeypatch):
    """adapt_rows: `concurrency` is the most rows; a finished row is refilled only while the planner's
    rows_worth says so. The outputs stay each request's own."""
    from offspec.engine.controller import Controller
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=n, ignore_eos=True)          # auto tree budget
                for p, n in zip(prompts(6), [5, 17, 9, 12, 3, 8])]
    for worth, most_seen in ((2, 2), (None, 4)):
        monkeypatch.setattr(Controller, "rows_worth", lambda self, most: worth)
        tokens = {i: [] for i in range(len(requests))}
        seen = []
        for event in engine.run_batch(requests, concurrency=4, adapt_rows=True):
            assert event.error is None, event.error
            tokens[event.request] += event.step.tokens
            seen.append(event.step.rows_in_pass)
        assert max(seen) == most_seen
        for i, request in enumerate(requests):
            assert tokens[i] == alone(engine, request)[0], i


def test_while_plain_decoding_wins_a_probe_grows_one_tree_the_least_behind(engine, monkeypatch):
    """Costs under which no tree pays (every token of a pass and of a draft call costs the same): the job's
    first round prefills with no tree, the next decodes plainly, the third grows one row's tree (the others'
    drafts never read their prompts), the rows then decode plainly, and each probe that re-times trees grows the tree of one row only,
    the one whose draft has the least to read. The engine hands the planner each row's backlog and tokens left
    after the commits, and the catch-up's tokens; the outputs stay each request's own."""
    from offspec.engine.controller import Controller
    monkeypatch.setattr(Controller, "target_fit", lambda self: (0.0, 1.0))
    monkeypatch.setattr(Controller, "draft_fit", lambda self, unsure="per call": (1.0, 1.0))
    monkeypatch.setattr(Controller, "catch_up_fit", lambda self: 1.0)
    monkeypatch.setattr(Controller, "miss", lambda self: 1.0)     # the model is taken at its word
    rounds = []                                   # per round: (rows that grew, backlog and tokens left after it)
    observe = Controller.observe

    def spy(self, record):
        rounds.append(({r for r, t in record.trees.items() if t.size > 0}, record.behind, record.left,
                       record.catch_up))
        observe(self, record)
    monkeypatch.setattr(Controller, "observe", spy)
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=n, ignore_eos=True)          # auto tree budget
                for p, n in zip(prompts(3), [40, 34, 28])]
    tokens, _, _ = batched(engine, requests, concurrency=3)
    mine = rounds[:]                              # the runs alone below add theirs to the spy's list
    for i, request in enumerate(requests):
        assert tokens[i] == alone(engine, request)[0], i
    # On a CPU the job's prefill round grows no tree and reads no prompt into the draft, nor does the plain round
    # after it; the third round, one tree (the first probe below): only its row's prompt is read
    assert mine[0][0] == mine[1][0] == set() and mine[0][3][0] == mine[1][3][0] == 0
    assert all(len(grew) <= 1 for grew, *_ in mine)          # no tree pays: never more than the probe's
    probes = [k for k, (grew, *_) in enumerate(mine) if k > 0 and grew and not mine[k - 1][0]]
    assert probes[0] == 2 and len(probes) >= 2
    for k in probes:
        (grew,), behind = mine[k][0], mine[k - 1][1]
        assert behind[grew] == min(behind.values()) and mine[k][3][0] == behind[grew]   # its catch-up, alone
    for (_, _, left, _), (_, _, later, _) in zip(mine, mine[1:]):
        assert all(0 <= later[r] < left[r] for r in later)          # tokens left shrink every round


@pytest.mark.parametrize("mode", ["none", "cpu"])
def test_a_cpu_job_probes_first_only_where_the_target_is_resident(pair, mode):
    """Resident on a CPU (a pass and a draft's prompt read are both compute) the job's first round grows no tree,
    nor does the next (a plain pass, timed, sizes the probe), and the third one row's (probe_first); where the
    target streams, a pass costs its read of every layer as on a
    GPU, and every row grows its tree from the first round. Either way each row's tokens are its own."""
    from offspec.engine.controller import Controller
    offload = OffloadConfig(mode=mode, n_slots=2)
    eng = load_engine(pair[0], pair[1], offload, RUNTIME, progress=False, limits=LIMITS).engine
    grew = []
    observe = Controller.observe

    def spy(self, record):
        grew.append({r for r, t in record.trees.items() if t.size > 0})
        observe(self, record)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Controller, "observe", spy)
            requests = [GenerationRequest(prompt_ids=p, max_new_tokens=n, ignore_eos=True)    # auto tree budget
                        for p, n in zip(prompts(3), [12, 9, 14])]
            tokens, _, _ = batched(eng, requests, concurrency=3)
        if mode == "none":
            assert grew[0] == grew[1] == set() and len(grew[2]) == 1, grew[:3]
        else:
            assert grew[0] == grew[1] == {0, 1, 2}, grew[:2]
        for i, request in enumerate(requests):
            assert tokens[i] == alone(eng, request)[0], i
    finally:
        eng.close()
