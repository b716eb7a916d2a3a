"""Sequoia trees: the DP against brute force over every tree, the acceptance-by-rank estimator, growth of the shape,
and the engine and CLI end to end on tiny models (speculative greedy == plain greedy, alone and in a batch, the
pair's cache written at close). The cache itself: test_pair_cache.py."""
import json
import random

import pytest
import torch
from click.testing import CliRunner
from test_grow import GREEDY, SAMPLED, check_tree, run
from tiny import save_agreeing_pair

from offspec.cli.main import main
from offspec.config import FIXED_BUDGET_DEPTH, OffloadConfig, RunLimits, RuntimeConfig, SamplingConfig, TreeConfig
from offspec.engine.generate import GenerationRequest
from offspec.engine.load import load_engine
from offspec.engine.pair_cache import Learned
from offspec.spec.sequoia import HAZARD_PRIOR, RankCounts, RankLearner, _shape, _tables, best_tree, observe_ranks
from offspec.spec.tree import TokenTree

# ------------------------------------------------------------------------------------------------ the DP


def shapes(m: int, depth: int, K: int):
    """Every tree of at most m nodes (root included) and at most `depth` levels below its root, each node's
    children a prefix of ranks 0..K-1: nested tuples, a node = the tuple of its children in rank order."""
    yield ()
    if depth > 0:
        yield from (kids for kids in forests(m - 1, depth - 1, K, K) if kids)


def forests(s: int, depth: int, K: int, slots: int):
    """Sequences of at most `slots` subtrees with at most s nodes together."""
    yield ()
    if slots == 0 or s == 0:
        return
    for first in shapes(s, depth, K):
        for rest in forests(s - size(first), depth, K, slots - 1):
            yield (first, *rest)


def size(t) -> int:
    return 1 + sum(size(c) for c in t)


def value(t, p) -> float:
    """F of a tree, root excluded: sum_i p_i (1 + F(child i))."""
    return sum(p[i] * (1.0 + value(c, p)) for i, c in enumerate(t))


def brute_force(p, n: int, depth: int) -> float:
    return max(value(t, p) for t in shapes(n + 1, depth, len(p)))


def shape_value(shape, p) -> float:
    f = [1.0]
    for parent, rank in shape:
        f.append(f[parent] * p[rank])
    return sum(f[1:])


def check_shape(shape, n: int, depth: int, K: int):
    assert len(shape) <= n
    level, ranks = [0], {}
    for j, (parent, rank) in enumerate(shape, start=1):
        assert 0 <= parent < j and rank < K                        # parents first
        assert rank == ranks.get(parent, -1) + 1                   # children are a prefix of the ranks, in order
        ranks[parent] = rank
        level.append(level[parent] + 1)
        assert level[-1] <= depth
    assert level == sorted(level)                                  # breadth first


def random_vector(rng: random.Random, K: int, monotone: bool) -> tuple:
    h = [rng.uniform(0.05, 0.9) for _ in range(K)]
    p, left = [], 1.0
    for x in h:
        p.append(round(left * x, 4))
        left *= 1 - x
    return tuple(sorted(p, reverse=True)) if monotone else tuple(p)


@pytest.mark.parametrize("monotone", [True, False], ids=["non-increasing", "any"])
def test_best_tree_equals_brute_force_over_every_tree(monotone):
    rng = random.Random(1 if monotone else 2)
    for trial in range(6):
        p = random_vector(rng, 3, monotone)
        for n in range(1, 7):
            for depth in (1, 2, 3):
                shape, F = best_tree(p, n, depth)
                check_shape(shape, n, depth, 3)
                assert F == pytest.approx(brute_force(p, n, depth), abs=1e-5), (p, n, depth)
                assert shape_value(shape, p) == pytest.approx(F, abs=1e-5)
                c, choice = _tables(p, 8, depth)                   # the DP itself, whatever the vector
                assert float(c[depth, n + 1] - 1) == pytest.approx(F, abs=1e-5)
                assert shape_value(_shape(choice, n, depth), p) == pytest.approx(F, abs=1e-5)


def test_a_later_rank_can_need_a_poor_first_child():
    """p = (0.1, 0.6): the second child is worth a useless first one (children are a prefix of the ranks)."""
    shape, F = best_tree((0.1, 0.6), 2, 1)
    assert shape == ((0, 0), (0, 1)) and F == pytest.approx(0.7)
    shape, F = best_tree((0.1, 0.6), 3, 2)
    assert F == pytest.approx(brute_force((0.1, 0.6), 3, 2))


def test_chain_star_and_monotone_in_the_budget():
    assert best_tree((1.0, 0.0, 0.0), 10, 4) == (((0, 0), (1, 0), (2, 0), (3, 0)), 4.0)   # a chain, depth-bound
    shape, _ = best_tree((0.4, 0.2, 0.1, 0.05), 3, 1)
    assert shape == ((0, 0), (0, 1), (0, 2))                                               # depth 1: a star
    assert best_tree((0.4, 0.2), 10, 1)[0] == ((0, 0), (0, 1))                             # at most K children
    p = random_vector(random.Random(5), 8, monotone=False)
    values = [best_tree(p, n, 6)[1] for n in range(0, 80, 7)]
    assert values == sorted(values) and best_tree(p, 0, 6) == ((), 0.0)


def test_large_budgets_are_fast_enough_to_run_every_round():
    """Budget 1024, K = 8, depth 32: the DP (a vector that is not non-increasing) and best first."""
    import time
    for p in [(0.2, 0.45, 0.1, 0.06, 0.04, 0.02, 0.01, 0.005), (0.6, 0.2, 0.08, 0.04, 0.02, 0.01, 0.005, 0.002)]:
        start = time.perf_counter()
        shape, F = best_tree(p, 1024, 32)
        assert len(shape) == 1024 and F > 1 and time.perf_counter() - start < 3.0
        check_shape(shape, 1024, 32, 8)


# ------------------------------------------------------------------------------------------------ the estimator
def three_children() -> TokenTree:
    """root -> a, b, c (ranks 0, 1, 2); a -> d."""
    tree = TokenTree(1)
    for token in (2, 3, 4):
        tree.add(0, token, 0.1)
    tree.add(1, 5, 0.1)
    return tree


def test_counts_by_rank_and_the_hazard_vector():
    tree = three_children()
    counts = observe_ranks(tree, {0: 2, 1: None}, K=4)         # root: rank 1 accepted; a: its only child rejected
    assert counts.tried.tolist() == [2, 1, 0, 0] and counts.hits.tolist() == [0, 1, 0, 0]
    counts = counts + observe_ranks(tree, {0: None}, K=4)       # all three tried, none accepted
    assert counts.tried.tolist() == [3, 2, 1, 0] and counts.observations == 3
    assert (counts + RankCounts.zeros(6)).tried.tolist() == [3, 2, 1, 0, 0, 0]            # over the longer range
    assert counts.to_dict() == {"tried": [3, 2, 1], "hits": [0, 1, 0]}                     # to the last rank tried
    assert (counts - counts).observations == 0
    h0, h1 = HAZARD_PRIOR
    assert RankCounts.zeros(3).vector() == pytest.approx((h0, h1 * (1 - h0), h1 * (1 - h0) * (1 - h1)))
    many = RankCounts.zeros(2)
    many.tried[:], many.hits[:] = [10000, 5000], [5000, 1000]   # h = (0.5, 0.2) once the prior no longer counts
    assert many.vector() == pytest.approx((0.5, 0.1), abs=1e-3)


def test_a_learner_recomputes_its_vector_only_when_its_counts_doubled():
    learner = RankLearner(RankCounts.zeros(3), 3)
    first = learner.vector()
    tree = three_children()
    learner.observe(tree, {0: 1})
    assert learner.vector() is first                            # 1 observation: not yet
    for _ in range(4):
        learner.observe(tree, {0: 1})
    assert learner.vector() != first and learner.counts.observations == 5
    frozen = RankLearner(learner.counts, 3, frozen=True)
    frozen.observe(tree, {0: None})
    assert frozen.counts.observations == 5


# ------------------------------------------------------------------------------------------------ growth
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["T0", "T1"])
def test_growth_follows_the_shape_one_draft_call_per_depth(sampling):
    cfg = TreeConfig(policy="sequoia", branching=4, max_depth=5)
    tree, draft = run(cfg, sampling, 24)
    check_tree(tree, draft, cfg, sampling, 24)
    p = RankCounts.zeros(4).vector()                              # the prior: what the growth ran on
    shape, F = best_tree(p, 24, 5)
    grown = [(int(tree.parents[n]), tree.children(int(tree.parents[n])).index(n)) for n in range(1, tree.n_nodes)]
    assert all(len(depths) == 1 for depths in draft.depths)     # one draft call per depth
    f = [1.0]                                                    # f(v): the product of p_rank along v's path
    for n in range(1, tree.n_nodes):
        parent = int(tree.parents[n])
        f.append(f[parent] * p[tree.children(parent).index(n)])
    assert tree.values.tolist() == pytest.approx(f)              # values are Sequoia's f, not draft probabilities
    if sampling.greedy:                                          # every candidate exists: the tree is the shape
        assert grown == list(shape) and tree.n_draft_calls == tree.depth - 1
        assert float(tree.values[1:].sum()) == pytest.approx(F, rel=1e-3)   # ... and sum to the DP's F (p rounded)
    else:                                                        # top-p leaves some out, with their subtrees
        assert tree.size <= len(shape) and tree.n_draft_calls <= tree.depth


# ------------------------------------------------------------------------------------------------ the engine
RUNTIME = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_agreeing_pair(tmp_path_factory.mktemp("sequoia"), n_layers=2)[:2]


@pytest.fixture(scope="module")
def engine(pair):
    return load_engine(*pair, OffloadConfig(), RUNTIME, progress=False, limits=RunLimits(concurrency=3)).engine


def tokens_alone(engine, req):
    return [t for s in engine.generate(req) for t in s.tokens]


def test_engine_greedy_equals_plain_alone_and_in_a_batch(engine, tmp_path, monkeypatch):
    engine.learned = Learned("tiny", home=tmp_path)             # as a loaded pair would have (load.py passes a key)
    prompts = [tuple(range(5, 25)), (7, 9, 11), tuple(range(40, 52))]
    reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=n, tree=TreeConfig(policy="sequoia", budget=12),
                              ignore_eos=True) for p, n in zip(prompts, (24, 10, 16))]
    plain = [tokens_alone(engine, GenerationRequest(prompt_ids=r.prompt_ids, max_new_tokens=r.max_new_tokens,
                                                    tree=TreeConfig(policy="none"), ignore_eos=True)) for r in reqs]
    steps = list(engine.generate(reqs[0]))
    assert [t for s in steps for t in s.tokens] == plain[0]
    assert sum(s.accepted for s in steps) / len(steps) > 0.5 and max(s.tree_size for s in steps) <= 12
    batched = {i: [] for i in range(len(reqs))}
    for event in engine.run_batch(reqs, concurrency=3):
        assert event.error is None
        batched[event.request] += event.step.tokens
        steps.append(event.step)
    assert [batched[i] for i in range(len(reqs))] == plain
    engine.close()                                               # adds every row's observations to the file
    saved = json.loads(next((tmp_path / "sequoia").glob("*.json")).read_text())
    observed = sum(s.rank_counts.observations for s in steps if s.rank_counts is not None)
    assert saved["tried"][0] == observed > 0


def test_engine_sampled_rows_keep_their_tokens_in_a_batch(engine):
    engine.learned = Learned(None)
    sampling = [SamplingConfig(temperature=0.9, seed=s) for s in (1, 2)]
    reqs = [GenerationRequest(prompt_ids=tuple(range(5, 15 + i)), max_new_tokens=10, sampling=s, ignore_eos=True,
                              tree=TreeConfig(policy="sequoia", budget=8)) for i, s in enumerate(sampling)]
    batched = {i: [] for i in range(len(reqs))}
    for event in engine.run_batch(reqs, concurrency=2):
        batched[event.request] += event.step.tokens
    assert [batched[i] for i in range(len(reqs))] == [tokens_alone(engine, r) for r in reqs]


def test_the_engine_resolves_the_depth_bound_when_it_admits_a_request(engine):
    """--max-depth auto: a fixed budget stops at FIXED_BUDGET_DEPTH, a bound given is kept (and an auto budget
    has none of its own: test_grow); either way greedy output is the plain one."""
    engine.learned = Learned(None)
    prompt = tuple(range(5, 12))
    plain = tokens_alone(engine, GenerationRequest(prompt_ids=prompt, max_new_tokens=48, ignore_eos=True,
                                                   tree=TreeConfig(policy="none")))
    for max_depth, deepest in ((None, FIXED_BUDGET_DEPTH), (40, 40)):
        tree = TreeConfig(policy="chain", budget=40, max_depth=max_depth)
        steps = list(engine.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=48, ignore_eos=True,
                                                       tree=tree)))
        assert max(s.tree_depth for s in steps) == deepest and [t for s in steps for t in s.tokens] == plain


def test_cli_generate_with_sequoia_trees(pair, tmp_path, monkeypatch):
    """`offspec generate --tree sequoia` on a tiny pair: the plain greedy tokens, the report says sequoia and
    counts acceptance by rank."""
    monkeypatch.setenv("OFFSPEC_HOME", str(tmp_path / "home"))      # where the pair's cache goes, never the user's
    reports = {}
    for tree in ("none", "sequoia"):
        out = tmp_path / f"{tree}.json"
        result = CliRunner().invoke(main, ["generate", "--target", str(pair[0]), "--draft", str(pair[1]), "--device",
                                           "cpu", "--dtype", "float32", "--offload", "none", "--raw", "--tree", tree,
                                           "--tree-budget", "8", "--max-new-tokens", "12", "--json", str(out),
                                           "abcabc"], prog_name="offspec")
        assert result.exit_code == 0, (result.output, result.exception)
        reports[tree] = json.loads(out.read_text())
    assert reports["sequoia"]["tokens"] == reports["none"]["tokens"]
    assert reports["sequoia"]["tree_policy"] == "sequoia" and reports["sequoia"]["tokens_per_pass"] > 1
    assert reports["sequoia"]["calibration"]["by_rank"]["tried"][0] > 0
