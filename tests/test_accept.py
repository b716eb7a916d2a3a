"""Verification: greedy speculation equals plain greedy; stochastic speculation has the target's distribution.

The "models" are tables: the next-token logits depend on the last one or two tokens, so a tree node's
distribution is read straight off its path, and exact target distributions are matrix powers.
"""
import numpy as np
import pytest
import torch
from drivers import grow
from scipy.stats import chisquare

import offspec.spec.accept as accept
from offspec.config import SamplingConfig, TreeConfig
from offspec.spec.accept import Verdict, verify_greedy, verify_stochastic
from offspec.spec.calibrate import Calibrator, judged_greedy, judged_path, observe
from offspec.spec.ngram import lookup
from offspec.spec.sampling import make_generator, process_logits
from offspec.spec.sequoia import RankCounts, RankLearner
from offspec.spec.tree import TokenTree

GREEDY = SamplingConfig(temperature=0.0)


def small_tree() -> TokenTree:
    """root 17 -> (42 -> 7), 13"""
    tree = TokenTree(17)
    tree.add(0, 42, 0.6)
    tree.add(0, 13, 0.2)
    tree.add(1, 7, 0.3)
    return tree


def logits_with_argmax(best: list[int], V: int = 50) -> torch.Tensor:
    logits = torch.zeros(len(best), V)                                                   # (N, V)
    logits[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return logits


# ------------------------------------------------------------------------------------------------ greedy
def test_verify_greedy_on_a_hand_built_tree():
    tree = small_tree()
    # Target argmax per node [root, 42, 13, 7]: follows 42 then 7, and adds its own 5.
    assert verify_greedy(tree, logits_with_argmax([42, 7, 0, 5])) == Verdict((1, 3), (42, 7), 5)
    # Accepts the leaf 13: the bonus is the target's argmax there.
    assert verify_greedy(tree, logits_with_argmax([13, 7, 8, 5])) == Verdict((2,), (13,), 8)
    # Nothing accepted: the bonus is the target's argmax at the root.
    verdict = verify_greedy(tree, logits_with_argmax([9, 7, 8, 5]))
    assert verdict == Verdict((), (), 9) and verdict.emitted == [9] and verdict.path == [0]
    assert verify_greedy(TokenTree.root_only(17), logits_with_argmax([4])) == Verdict((), (), 4)


class PairModel:
    """Logits of the next token given the last two tokens: (V, V, V) table."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def at_nodes(self, tree: TokenTree, nodes: torch.Tensor, before_root: int) -> torch.Tensor:
        """Logits after each node's path (F, V); the token before the root comes from the committed sequence."""
        parents = tree.parents[nodes]
        prev = torch.where(parents >= 0, tree.tokens[parents.clamp(min=0)], before_root)
        return self.table[prev, tree.tokens[nodes]]


def pair_models(V: int = 16, noise: float = 0.7, seed: int = 0) -> tuple[PairModel, PairModel]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, V, generator=g) * 2
    draft = target + noise * torch.randn(V, V, V, generator=g)    # agrees often, not always
    return PairModel(target), PairModel(draft)


def speculative_greedy(cfg: TreeConfig, budget: int, prompt: list[int], n: int, target: PairModel,
                       draft: PairModel, levers: bool = False) -> tuple[list[int], float]:
    """The generation loop, driven by tables: returns the emitted tokens and the mean accepted per round.
    levers: calibrated values and n-gram branches (--calibrate/--ngram on), else raw draft probabilities (the default)."""
    seq, accepted, rounds = list(prompt), 0, 0
    calibrator, ngram_accepted = Calibrator(), 0
    ranks = RankLearner(RankCounts.zeros(cfg.branching), cfg.branching)     # sequoia's p, learned as it goes
    while len(seq) - len(prompt) < n:
        before_root = seq[-2]
        root_dist = process_logits(draft.table[seq[-2], seq[-1]], GREEDY)

        def draft_step(tree: TokenTree, frontier: torch.Tensor) -> torch.Tensor:
            return process_logits(draft.at_nodes(tree, frontier, before_root), GREEDY)

        tree = grow(cfg, GREEDY, seq[-1], root_dist, draft_step, budget, make_generator(0),
                    calibration=calibrator.calibration() if levers else None, ngram=lookup(seq) if levers else (),
                    rank_acceptance=ranks.vector() if cfg.policy == "sequoia" else None)
        q = target.at_nodes(tree, torch.arange(tree.n_nodes), before_root)
        verdict = verify_greedy(tree, q)
        judged = judged_greedy(tree, q.argmax(-1).tolist())
        calibrator.add(observe(tree, judged))
        if cfg.policy == "sequoia":
            ranks.observe(tree, judged)
        seq += verdict.emitted
        accepted += len(verdict.nodes)
        ngram_accepted += sum(tree.ngram_match(n) > 0 for n in verdict.nodes)
        rounds += 1
    if levers:
        assert calibrator.counts.observations > 0
    return seq[len(prompt):len(prompt) + n], accepted / rounds, ngram_accepted


def plain_greedy(prompt: list[int], n: int, target: PairModel) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(target.table[seq[-2], seq[-1]].argmax()))
    return seq[len(prompt):]


GREEDY_POLICIES = [
    TreeConfig(policy="dyspec"),
    TreeConfig(policy="dyspec", threshold=0.2),
    TreeConfig(policy="dyspec", threshold=0.01),
    TreeConfig(policy="heap"),
    TreeConfig(policy="chain"),
    TreeConfig(policy="static"),
    TreeConfig(policy="sequoia"),
]


@pytest.mark.parametrize("levers", [False, True], ids=["raw", "calibrated+ngram"])
@pytest.mark.parametrize("cfg", GREEDY_POLICIES, ids=["dyspec", "dyspec-C0.2", "dyspec-C0.01", "heap", "chain",
                                                      "static", "sequoia"])
def test_greedy_speculation_equals_plain_greedy(cfg, levers):
    target, draft = pair_models()
    prompt, n = [1, 2], 48
    reference = plain_greedy(prompt, n, target)
    ngram_accepted = 0
    for budget in (1, 8, 64, 256):
        tokens, mean_accepted, from_ngram = speculative_greedy(cfg, budget, prompt, n, target, draft, levers)
        assert tokens == reference, (cfg.policy, budget)
        if budget >= 8 and cfg.threshold != 0.2:
            assert mean_accepted > 1.0        # the trees really were used, not just the bonus tokens
        ngram_accepted += from_ngram
    assert ngram_accepted > 0 or not levers or cfg.policy == "sequoia", "n-gram nodes were proposed and accepted"
    # (sequoia grafts no n-grams: its shape is the DP's alone)


# ------------------------------------------------------------------------------------------------ stochastic
def test_verify_stochastic_edge_cases():
    V = 6
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
    tree = TokenTree(0)
    tree.add(0, 1, 0.3)
    tree.add(0, 2, 0.2)
    tree.set_dist(0, p)
    g = make_generator(0)
    # q = p: the first child is always accepted (min(1, q/p) = 1); the bonus comes from q at that leaf.
    q = torch.stack([p, torch.eye(V)[4], torch.eye(V)[5]])                              # (N, V)
    for _ in range(20):
        assert verify_stochastic(tree, q.__getitem__, g) == Verdict((1,), (1,), 4)
    # q has no mass on either child: both rejected, the bonus comes from the residual, never 1 or 2.
    q = torch.stack([torch.tensor([0.2, 0.0, 0.0, 0.4, 0.4, 0.0]), torch.eye(V)[4], torch.eye(V)[5]])
    for _ in range(20):
        verdict = verify_stochastic(tree, q.__getitem__, g)
        assert verdict.nodes == () and verdict.bonus in (0, 3, 4)
    # The residual after rejecting 1 and 2 is norm(max(q - p, 0)) = (0, 0, 0, .5, .5, 0): token 0 never comes.
    assert all(verify_stochastic(tree, q.__getitem__, g).bonus in (3, 4) for _ in range(50))


V_SMALL = 8
TRIALS = 5000
# Power: each test compares the counts of one emitted position over TRIALS = 5000 independent generations with
# the exact target distribution pi (support of at most 8 tokens, so df <= 7) at alpha = 0.001. A wrong
# sampler whose distribution is at total-variation distance >= 0.05 from pi gives a noncentrality
# lambda = TRIALS * sum(delta^2 / pi) >= TRIALS * (2 * 0.05)^2 = 50 (Cauchy-Schwarz), and
# P(noncentral chi2(df=7, lambda=50) > chi2.ppf(0.999, 7) = 24.3) = 0.996: such a bug is caught with power
# >= 0.99. test_chi_square_catches_a_verifier_without_the_residual shows it does catch a realistic one.


def markov_pair(T: float, top_p: float, seed: int = 1):
    """Target and draft Markov tables, processed with the same temperature and top-p: (Q, P), each (V, V)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V_SMALL, V_SMALL, generator=g) * 1.5
    draft = target + torch.randn(V_SMALL, V_SMALL, generator=g) * 1.5    # rejections are common
    sampling = SamplingConfig(temperature=T, top_p=top_p)
    return process_logits(target, sampling), process_logits(draft, sampling), sampling


HISTORY = [0, 3, 5, 0, 3, 1, 0, 6, 2, 7, 4, 0, 3, 5, 2, 0]   # a fixed "prompt" the n-gram lookup reads


def sample_speculatively(cfg: TreeConfig, T: float, budget: int, trials: int = TRIALS, seed: int = 0,
                         levers: bool = False, ngram: bool | None = None, calibrate: bool | None = None):
    """Run `trials` independent generations from root token 0, each until 3 tokens are out.
    ngram: n-gram chains looked up in HISTORY + the tokens out so far (deterministic candidates);
    calibrate: values calibrated by what the previous trials' trees showed; levers: both (the default of each).
    Returns (first tokens, third tokens, per-round tree statistics), and with ngram the n-gram nodes' verdicts."""
    ngram = levers if ngram is None else ngram
    calibrate = levers if calibrate is None else calibrate
    Q, P, sampling = markov_pair(T, top_p=0.9)
    g = make_generator(seed)
    calibrator = Calibrator()
    ranks = RankLearner(RankCounts.zeros(cfg.branching), cfg.branching)     # sequoia's p, learned from earlier trials

    def draft_step(tree: TokenTree, frontier: torch.Tensor) -> torch.Tensor:
        return P[tree.tokens[frontier]]                                                  # (F, V)

    first, third, widest, deepest = [], [], 0, 0
    ngram_seen = {"accepted": 0, "rejected": 0}
    for _ in range(trials):
        out = []
        while len(out) < 3:
            root = out[-1] if out else 0
            chains = lookup(HISTORY + out) if ngram else ()
            tree = grow(cfg, sampling, root, P[root], draft_step, budget, g, ngram=chains,
                        calibration=calibrator.calibration() if calibrate else None,
                        rank_acceptance=ranks.vector() if cfg.policy == "sequoia" else None)
            verdict = verify_stochastic(tree, Q[tree.tokens].__getitem__, g)
            judged = judged_path(tree, verdict.nodes)
            calibrator.add(observe(tree, judged))
            if cfg.policy == "sequoia":
                ranks.observe(tree, judged)
            for u in verdict.path:
                for c in tree.children(u):
                    if tree.ngram_match(c) > 0:
                        ngram_seen["accepted" if c in verdict.nodes else "rejected"] += 1
            out += verdict.emitted
            widest = max(widest, max(len(tree.children(u)) for u in range(tree.n_nodes)))
            deepest = max(deepest, len(verdict.nodes))
        first.append(out[0])
        third.append(out[2])
    exact_first = Q[0].double()
    exact_third = torch.linalg.matrix_power(Q.double(), 3)[0]
    results = (np.array(first), exact_first.numpy()), (np.array(third), exact_third.numpy()), widest, deepest
    return (*results, ngram_seen) if ngram else results


def chi_square_pvalue(samples: np.ndarray, pi: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(pi))
    support = pi > 0
    assert counts[~support].sum() == 0, "emitted a token the target (after top-p) can never produce"
    expected = pi[support] / pi[support].sum() * len(samples)
    return chisquare(counts[support], expected).pvalue


LOSSLESS = [
    (0.6, TreeConfig(policy="dyspec", threshold=0.02, branching=3, max_depth=6), 12),
    (1.0, TreeConfig(policy="dyspec", threshold=0.02, branching=3, max_depth=6), 12),
    (0.6, TreeConfig(policy="static", static_widths=(3, 2, 1)), 12),
    (1.0, TreeConfig(policy="static", static_widths=(3, 2, 1)), 12),
    (1.0, TreeConfig(policy="dyspec", threshold=None, branching=3, max_depth=4), 12),   # adaptive C, evictions
    (0.6, TreeConfig(policy="heap", branching=3, max_depth=4), 8),
    (1.0, TreeConfig(policy="sequoia", branching=3, max_depth=4), 12),    # p learned from the earlier trials
]


@pytest.mark.parametrize("T,cfg,budget", LOSSLESS,
                         ids=["dyspec-T0.6", "dyspec-T1", "static-T0.6", "static-T1", "adaptive-T1", "heap-T0.6",
                              "sequoia-T1"])
def test_sampling_is_lossless(T, cfg, budget):
    (first, pi1), (third, pi3), widest, deepest = sample_speculatively(cfg, T, budget)
    assert widest >= 3 and deepest >= 2         # several children per node, and multi-token acceptances
    assert chi_square_pvalue(first, pi1) > 1e-3
    assert chi_square_pvalue(third, pi3) > 1e-3


def test_chi_square_catches_a_verifier_without_the_residual(monkeypatch):
    """Negative control: accept with min(1, q/p) but keep q after a rejection (no residual update)."""
    monkeypatch.setattr(accept, "residual", lambda q, p: q)
    (first, pi1), (third, pi3), _, _ = sample_speculatively(LOSSLESS[1][1], 1.0, 12)
    assert chi_square_pvalue(first, pi1) < 1e-3
    assert chi_square_pvalue(third, pi3) < 1e-3


# One drawn child per node, so n-gram nodes (tried after it is rejected) get room and are accepted ~600 times
# and rejected thousands of times in TRIALS generations. (Several drawn children competing with n-gram nodes
# for a binding budget: test_an_ngram_chain_never_decides_a_drawn_siblings_presence below.)
LOSSLESS_LEVERS = [
    (1.0, TreeConfig(policy="dyspec", threshold=None, branching=1, max_depth=3), 8),    # adaptive C, evictions
    (0.6, TreeConfig(policy="dyspec", threshold=0.1, branching=1, max_depth=3), 8),
    (1.0, TreeConfig(policy="static", static_widths=(1, 1)), 8),
]


@pytest.mark.parametrize("T,cfg,budget", LOSSLESS_LEVERS, ids=["adaptive-T1", "dyspec-T0.6", "static-T1"])
def test_sampling_with_ngram_branches_and_calibration_is_lossless(T, cfg, budget):
    (first, pi1), (third, pi3), _, deepest, ngram = sample_speculatively(cfg, T, budget, levers=True)
    assert deepest >= 2 and min(ngram.values()) > 300, ngram
    assert chi_square_pvalue(first, pi1) > 1e-3
    assert chi_square_pvalue(third, pi3) > 1e-3


def test_chi_square_catches_a_wrong_rule_for_deterministic_candidates(monkeypatch):
    """Negative control: verify an n-gram node like a drawn one whose draft probability was 1/2 (accept with
    min(1, 2 q(g)), then remove g): it over-proposes g. (The exact rule accepts with q(g).)"""
    def wrong(q, g, r):
        if r < min(1.0, 2 * float(q[g])):
            return True, q
        q = q.clone()
        q[g] = 0.0
        return False, q / q.sum()

    monkeypatch.setattr(accept, "try_deterministic", wrong)
    T, cfg, budget = LOSSLESS_LEVERS[2]
    (first, pi1), (third, pi3), _, _, _ = sample_speculatively(cfg, T, budget, levers=True)
    assert min(chi_square_pvalue(first, pi1), chi_square_pvalue(third, pi3)) < 1e-3


@pytest.mark.parametrize("T,cfg,budget", [
    (1.0, TreeConfig(policy="dyspec", threshold=None, branching=3, max_depth=4), 8),
    (0.6, TreeConfig(policy="heap", branching=3, max_depth=4), 8),
], ids=["adaptive-b3-T1", "heap-b3-T0.6"])
def test_sampling_with_calibration_alone_is_lossless(T, cfg, budget):
    """Calibrated values (no n-gram chains) reorder which drawn children join; every join is still decided
    before the child is drawn."""
    (first, pi1), (third, pi3), widest, deepest = sample_speculatively(cfg, T, budget, calibrate=True)
    assert widest >= 2 and deepest >= 2
    assert chi_square_pvalue(first, pi1) > 1e-3
    assert chi_square_pvalue(third, pi3) > 1e-3


# An n-gram chain against later drawn siblings, where the budget binds: the target q is uniform over 4 tokens
# after any context, the draft p = (0.7, 0.2, 0.1, 0) after any context, and one chain proposes the same token
# again and again. Whether a drawn node makes the cut must not depend on its own token: a chain node that
# outranks it may push it out, but not only when it did not draw the chain's token (that rule emitted token 2
# first with probability ~0.34 in the first case, depth 1 and B = 2). The three first tokens must then be
# uniform over the 64 triples. Power: CHAIN_CUT_DRAWS = 10000 draws at alpha = 0.001 catch a law at total-
# variation distance >= 0.05 with power > 0.998 on the 64 triples (df = 63, lambda >= 10000 * (2 * 0.05)^2 = 100,
# Cauchy-Schwarz as above) and > 0.9999 on the first token alone (df = 3). The negative control below shows
# every case catches the rule the fold replaced.
CHAIN_CUT_DRAWS = 10000
CHAIN_CUT = [
    (TreeConfig(policy="static"), 2, (2,)),                                              # the example
    (TreeConfig(policy="dyspec", threshold=None, branching=2, max_depth=1), 2, (2,)),
    (TreeConfig(policy="dyspec", threshold=None, branching=2, max_depth=3), 4, (2, 2, 2)),
    (TreeConfig(policy="dyspec", threshold=0.05, branching=2, max_depth=3), 3, (2, 2, 2)),
    (TreeConfig(policy="static", static_widths=(2, 2, 1)), 3, (2, 2, 2)),
    (TreeConfig(policy="heap", branching=2, max_depth=3), 4, (2, 2, 2)),
]
CHAIN_CUT_IDS = ["static-d1", "adaptive-d1", "adaptive-d3", "dyspec-C-d3", "static-d3", "heap-d3"]


def first_triples_with_a_chain(cfg: TreeConfig, budget: int, chain: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """-> (the first three emitted tokens of CHAIN_CUT_DRAWS generations, as 16 t1 + 4 t2 + t3; how many trees
    had one of the chain's nodes)."""
    from offspec.spec.ngram import NgramChain
    q, p = torch.full((4,), 0.25), torch.tensor([0.7, 0.2, 0.1, 0.0])
    g, sampling, chains = make_generator(0), SamplingConfig(temperature=1.0), (NgramChain(chain, 1),)
    triples, with_chain = [], 0
    for _ in range(CHAIN_CUT_DRAWS):
        out = []
        while len(out) < 3:
            tree = grow(cfg, sampling, 0, p, lambda tree, frontier: p.expand(frontier.numel(), 4), budget, g,
                        ngram=chains)
            with_chain += any(tree.ngram_match(n) > 0 for n in range(1, tree.n_nodes))
            out += verify_stochastic(tree, lambda u: q, g).emitted
        triples.append(16 * out[0] + 4 * out[1] + out[2])
    return np.array(triples), with_chain


def chain_cut_pvalues(cfg: TreeConfig, budget: int, chain: tuple[int, ...]) -> tuple[float, float]:
    """(p-value of the first token, of the triple) against the uniform laws."""
    triples, with_chain = first_triples_with_a_chain(cfg, budget, chain)
    assert with_chain > CHAIN_CUT_DRAWS / 4           # the chain's nodes often made the cut
    return chi_square_pvalue(triples // 16, np.full(4, 0.25)), chi_square_pvalue(triples, np.full(64, 1 / 64))


@pytest.mark.parametrize("cfg,budget,chain", CHAIN_CUT, ids=CHAIN_CUT_IDS)
def test_an_ngram_chain_never_decides_a_drawn_siblings_presence(cfg, budget, chain):
    assert min(chain_cut_pvalues(cfg, budget, chain)) > 1e-3


@pytest.mark.parametrize("cfg,budget,chain", CHAIN_CUT, ids=CHAIN_CUT_IDS)
def test_chi_square_catches_a_chain_that_follows_drawn_nodes_during_the_cut(monkeypatch, cfg, budget, chain):
    """Negative control: the rule the fold replaced (during the cut a chain follows a drawn node with its token,
    as it may at T = 0) is caught in every case above."""
    from offspec.spec.candidates import Candidates

    graft = Candidates.graft_ngrams

    def graft_as_if_greedy(self, keep):
        greedy, self.greedy = self.greedy, True
        try:
            return graft(self, keep)
        finally:
            self.greedy = greedy
    monkeypatch.setattr(Candidates, "graft_ngrams", graft_as_if_greedy)
    assert min(chain_cut_pvalues(cfg, budget, chain)) < 1e-3
