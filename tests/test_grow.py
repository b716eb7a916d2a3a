"""Tree growth with a fake Markov "draft" (the next-token distribution depends only on a node's token)."""
import math

import pytest
import torch
from drivers import grow

from offspec.config import AUTO_MAX_TREE_BUDGET, FIXED_BUDGET_DEPTH, SamplingConfig, TreeConfig
from offspec.spec.sampling import make_generator, process_logits
from offspec.spec.tree import TokenTree

V = 12
GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=1.0, top_p=0.9)
ROOT = 3


def markov_logits(seed: int, peak: float = 4.0) -> torch.Tensor:
    """(V, V) logits, row = current token; one boosted token per row so that trees grow deep as well as wide."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=g)
    logits[torch.arange(V), torch.randint(0, V, (V,), generator=g)] += peak
    return logits


class FakeDraft:
    """draft_step for a Markov table. Plays the caller's KV cache (slot = working-tree index) and checks the
    draft_step contract on every call: every ancestor of a frontier node still sits in the slot it was
    written to, and the mask row of a frontier node selects exactly its ancestors and itself."""

    def __init__(self, logits: torch.Tensor, sampling: SamplingConfig, budget: int):
        self.probs = process_logits(logits, sampling)          # (V, V): row = the distribution after a token
        self.budget = budget
        self.frontiers: list[list[int]] = []
        self.tree: TokenTree | None = None                     # the working tree, as last seen
        self.kv = {0: (ROOT,)}                                 # slot -> token path of the node written there
        self.expanded = [(ROOT, 1.0)]                          # (token, value) of every node run, root included
        self.depths: list[set[int]] = []                       # depths of each call's frontier

    def root_dist(self) -> torch.Tensor:
        return self.probs[ROOT]

    def __call__(self, tree: TokenTree, frontier: torch.Tensor) -> torch.Tensor:
        self.tree = tree
        nodes = frontier.tolist()
        tokens = tree.tokens.tolist()
        assert len(set(nodes)) == len(nodes) and tree.n_nodes <= self.budget + 1

        def path_tokens(n):
            return tuple(tokens[a] for a in tree.path_to(n))

        for n in nodes:
            path = tree.path_to(n)
            assert all(self.kv.get(a) == path_tokens(a) for a in path[:-1])
            assert set(torch.nonzero(tree.mask[n]).flatten().tolist()) == set(path)
        for n in nodes:
            self.kv[n] = path_tokens(n)
            self.expanded.append((tokens[n], float(tree.values[n])))
        self.frontiers.append(nodes)
        self.depths.append({int(tree.depths[n]) for n in nodes})
        return self.probs[tree.tokens[frontier]]                                     # (F, V)


def run(cfg: TreeConfig, sampling: SamplingConfig, budget: int, seed: int = 0) -> tuple[TokenTree, FakeDraft]:
    draft = FakeDraft(markov_logits(seed), sampling, budget)
    tree = grow(cfg, sampling, ROOT, draft.root_dist(), draft, budget, make_generator(seed))
    return tree, draft


def naive_mask(parents: list[int]) -> torch.Tensor:
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def check_tree(tree: TokenTree, draft: FakeDraft, cfg: TreeConfig, sampling: SamplingConfig, budget: int):
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    values = tree.values.tolist()
    assert tree.size <= budget
    assert tokens[0] == ROOT and parents[0] == -1 and depths[0] == 0 and values[0] == 1.0
    assert torch.equal(tree.mask, naive_mask(parents))
    for n in range(1, tree.n_nodes):
        u = parents[n]
        assert 0 <= u < n                                          # parents precede children
        assert depths[n] == depths[u] + 1 <= cfg.depth_bound()
        p = float(draft.probs[tokens[u], tokens[n]])
        assert p > 0 and tree.draft_prob(n) == pytest.approx(p)
        # v(x) = v(u) a(x), a = p but for Sequoia's tree (p_rank), up to the float32 rounding of the mass
        # still undrawn (see Candidates.add)
        a = tree.estimate(n) if cfg.policy == "sequoia" else p
        assert values[n] == pytest.approx(values[u] * a, rel=1e-9, abs=1e-6 * values[u])
    for u in range(tree.n_nodes):
        kids = tree.children(u)
        assert kids == sorted(kids)
        kid_tokens = [tokens[c] for c in kids]
        assert len(set(kid_tokens)) == len(kid_tokens)              # siblings are distinct tokens
        if kids and sampling.greedy:
            # T = 0: the children are the draft's top tokens, best first.
            assert kid_tokens == torch.topk(draft.probs[tokens[u]], len(kids)).indices.tolist()
        if kids and not sampling.greedy:
            assert torch.equal(tree.dist(u), draft.probs[tokens[u]])
        if kids:
            assert tree.expanded(u)                                  # the draft saw every parent
    # origin: the draft's KV slot of each final node holds exactly that node's path.
    origin = tree.origin.tolist()
    for n, w in enumerate(origin):
        if w >= 0:
            assert draft.kv[w] == tuple(tokens[a] for a in tree.path_to(n))
    assert origin[0] == 0
    assert tree.n_draft_calls == len(draft.frontiers)


POLICIES = [
    TreeConfig(policy="dyspec"),                       # adaptive C
    TreeConfig(policy="dyspec", threshold=0.01),
    TreeConfig(policy="heap"),
    TreeConfig(policy="chain"),
    TreeConfig(policy="static"),
    TreeConfig(policy="sequoia"),
]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["T0", "T1"])
@pytest.mark.parametrize("budget", [1, 8, 64, 256])
@pytest.mark.parametrize("cfg", POLICIES, ids=["dyspec-adaptive", "dyspec-C", "heap", "chain", "static",
                                                "sequoia"])
def test_trees_are_valid_and_within_budget(cfg, budget, sampling):
    tree, draft = run(cfg, sampling, budget)
    check_tree(tree, draft, cfg, sampling, budget)
    if budget == 1:
        assert tree.size == 1
        if sampling.greedy:
            assert tree.tokens[1] == int(draft.root_dist().argmax())
    if cfg.policy in ("dyspec", "heap") and cfg.threshold is None:
        assert tree.size == budget                     # fixed size / adaptive C fill the budget


@pytest.mark.parametrize("budget", [8, 64, 256])
def test_adaptive_dyspec_is_the_best_b_of_all_explored_candidates(budget):
    cfg = TreeConfig(policy="dyspec", threshold=None, branching=4)
    tree, draft = run(cfg, GREEDY, budget, seed=1)
    # Every node the draft was run on (and the root) offered its top-`branching` tokens as candidates.
    explored = []
    for token, value in draft.expanded:
        explored += [value * p for p in torch.topk(draft.probs[token], cfg.branching).values.tolist()]
    best = sorted(explored, reverse=True)[:budget]
    assert len(draft.expanded) - 1 > draft.tree.size       # nodes fell out and their slots were reused
    assert sorted(tree.values[1:].tolist(), reverse=True) == best
    # ... and it is the same tree as strict best-first growth (DySpec Algorithm 1), in depth calls.
    heap, _ = run(TreeConfig(policy="heap", branching=4), GREEDY, budget, seed=1)
    assert sorted(heap.values[1:].tolist(), reverse=True) == best
    assert tree.n_draft_calls <= heap.n_draft_calls
    # One draft call per depth, each over one level's frontier.
    assert draft.depths == [{d} for d in range(1, len(draft.frontiers) + 1)]
    assert tree.n_draft_calls in (tree.depth - 1, tree.depth)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["T0", "T1"])
@pytest.mark.parametrize("C", [0.3, 0.05, 0.01])
def test_fixed_threshold(C, sampling):
    cfg = TreeConfig(policy="dyspec", threshold=C, branching=4)
    budget = 64
    tree, draft = run(cfg, sampling, budget, seed=2)
    check_tree(tree, draft, cfg, sampling, budget)
    values = tree.values.tolist()
    if sampling.greedy:
        assert min(values) >= C
    else:
        # T > 0 joins on the slot value w(u, i) = v(u) (1 - sum_{j<i} p(x_j)) = v(u) - sum of earlier siblings' values.
        for u in range(tree.n_nodes):
            before = 0.0
            for c in tree.children(u):
                assert values[u] - before >= C * (1 - 1e-9)
                before += values[c]
    # One draft call per depth, only on nodes that can place a child (value >= C).
    assert draft.depths == [{d} for d in range(1, len(draft.frontiers) + 1)]
    assert all(value >= C for _, value in draft.expanded)
    if tree.size < budget:
        # Nothing that passed C was left out: every explored candidate with value >= C is in the tree.
        if sampling.greedy:
            inside = {(tree.path_to(n)[-2] if n else -1, int(tree.tokens[n])) for n in range(1, tree.n_nodes)}
            for n in range(tree.n_nodes):
                if tree.expanded(n):
                    top = torch.topk(draft.probs[int(tree.tokens[n])], cfg.branching)
                    for t, p in zip(top.indices.tolist(), top.values.tolist()):
                        if values[n] * p >= C:
                            assert (n, t) in inside
        else:
            # At T > 0 the first draw of a node has slot value v(u): a node sent to the draft always gets a child.
            assert all(tree.children(n) for n in range(tree.n_nodes) if tree.expanded(n))


def test_threshold_above_every_value_gives_root_only():
    tree, draft = run(TreeConfig(policy="dyspec", threshold=1.5), GREEDY, 64)
    assert tree.size == 0 and draft.frontiers == []


def test_adaptive_dyspec_sampled_fills_the_budget_with_prefixes():
    tree, draft = run(TreeConfig(policy="dyspec", branching=4), SAMPLED, 64, seed=3)
    check_tree(tree, draft, TreeConfig(policy="dyspec"), SAMPLED, 64)
    assert tree.size == 64
    assert max(len(tree.children(u)) for u in range(tree.n_nodes)) >= 2


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["T0", "T1"])
def test_chain(sampling):
    cfg = TreeConfig(policy="chain", max_depth=6)
    for budget in (1, 4, 10):
        tree, draft = run(cfg, sampling, budget)
        k = min(budget, cfg.max_depth)
        assert tree.size == k and tree.depth == k and tree.n_draft_calls == k - 1
        assert tree.parents.tolist() == [-1, *range(k)]
        if sampling.greedy:
            tokens = tree.tokens.tolist()
            assert all(tokens[i + 1] == int(draft.probs[tokens[i]].argmax()) for i in range(k))


def test_static_widths_and_truncation():
    cfg = TreeConfig(policy="static", static_widths=(4, 2, 2, 1))
    tree, draft = run(cfg, GREEDY, 256)
    assert tree.size == 4 + 8 + 16 + 16
    for u in range(tree.n_nodes):
        assert len(tree.children(u)) == (cfg.static_widths[int(tree.depths[u])] if tree.depths[u] < 4 else 0)
    assert tree.n_draft_calls == 3
    # Truncated at the budget, breadth first; only nodes that get children were sent to the draft.
    tree, draft = run(cfg, GREEDY, 9)
    assert tree.size == 9 and tree.depths.tolist().count(1) == 4 and tree.depths.tolist().count(2) == 5
    assert draft.frontiers == [[1, 2, 3]]            # ceil(5 places / 2 children) = 3 depth-1 nodes


def test_max_depth_is_respected():
    for policy in ("dyspec", "heap", "chain", "static", "sequoia"):
        cfg = TreeConfig(policy=policy, max_depth=3)
        tree, draft = run(cfg, GREEDY, 256)
        assert tree.depth <= 3
        check_tree(tree, draft, cfg, GREEDY, 256)


def test_an_auto_depth_bound_follows_the_budget():
    """--max-depth auto: an auto budget's tree has no depth bound of its own (the planner prices each level), a
    fixed budget's stops at FIXED_BUDGET_DEPTH; a bound given is kept."""
    for cfg, depth in ((TreeConfig(policy="chain"), 40), (TreeConfig(policy="chain", budget=40), FIXED_BUDGET_DEPTH),
                       (TreeConfig(policy="chain", max_depth=8), 8)):
        tree, _ = run(cfg, GREEDY, 40)
        assert tree.depth == depth
    assert TreeConfig().depth_bound() == AUTO_MAX_TREE_BUDGET and TreeConfig(budget=0, max_depth=3).depth_bound() == 3


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["T0", "T1"])
def test_heap_draft_calls(sampling):
    """Best-first growth needs a draft call per depth at least and per node at most; level-wise dyspec needs
    one per depth. (At T = 0 the heap ends up near one call per node: the reason for Algorithm 2.)"""
    heap, _ = run(TreeConfig(policy="heap"), sampling, 64)
    assert heap.depth - 1 <= heap.n_draft_calls <= heap.size
    dyspec, _ = run(TreeConfig(policy="dyspec"), sampling, 64)
    assert dyspec.n_draft_calls in (dyspec.depth - 1, dyspec.depth)


def test_empty_and_bad_requests():
    for cfg, budget in [(TreeConfig(policy="none"), 16), (TreeConfig(policy="dyspec"), 0)]:
        tree, draft = run(cfg, GREEDY, budget)
        assert tree.size == 0 and draft.frontiers == []
    with pytest.raises(ValueError, match="unknown tree policy"):
        run(TreeConfig(policy="beam"), GREEDY, 8)
    with pytest.raises(ValueError, match="resolved by the engine"):          # TreeConfig()'s: chosen_policy's job
        run(TreeConfig(), GREEDY, 8)
    with pytest.raises(ValueError, match=">= 0"):
        run(TreeConfig(policy="dyspec"), GREEDY, -1)


def test_growth_is_seeded():
    a, _ = run(TreeConfig(policy="dyspec", branching=4), SAMPLED, 32, seed=5)
    b, _ = run(TreeConfig(policy="dyspec", branching=4), SAMPLED, 32, seed=5)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert math.isclose(float(a.values.sum()), float(b.values.sum()))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_expand_floor_runs_only_likely_nodes(sampling):
    """With last round's C as the floor, the draft runs only on nodes at least that likely: fewer rows for
    the same budget, and the tree is still valid (closed, within budget, children a prefix of the draws)."""
    cfg, budget = TreeConfig(policy="dyspec", budget=24, branching=4, max_depth=8), 24
    wide, wide_draft = run(cfg, sampling, budget)
    floor = float(wide.values[1:].min())            # this tree's C, as the Engine would pass it next round
    draft = FakeDraft(markov_logits(0), sampling, budget)
    tree = grow(cfg, sampling, ROOT, draft.root_dist(), draft, budget, make_generator(0), expand_floor=floor)
    check_tree(tree, draft, cfg, sampling, budget)
    assert all(value >= floor for _, value in draft.expanded[1:])
    assert sum(map(len, draft.frontiers)) < sum(map(len, wide_draft.frontiers))


def test_the_policy_lists_kept_apart_for_fast_help_match_grows():
    """The CLI's --tree choices and bench's <policy>-<N> names are literal lists (no torch import for --help):
    they must be sequoia.AUTO and grow.POLICIES (bench's without "none")."""
    from offspec.bench import runner
    from offspec.cli import options
    from offspec.spec.grow import POLICIES
    from offspec.spec.sequoia import AUTO
    assert options.POLICIES == [AUTO, *POLICIES]
    assert list(runner.POLICIES) == [AUTO, *(p for p in POLICIES if p != "none")]
