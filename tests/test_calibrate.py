"""Acceptance calibration and n-gram lookup: the pieces on their own (generation with them: test_accept,
test_generate)."""
import math

import torch
from drivers import grow

from offspec.config import SamplingConfig, TreeConfig
from offspec.spec.calibrate import (
    NGRAM_PRIOR,
    AcceptanceCounts,
    Calibration,
    Calibrator,
    _isotonic,
    judged_greedy,
    judged_path,
    observe,
)
from offspec.spec.ngram import NgramChain, lookup
from offspec.spec.sampling import make_generator
from offspec.spec.tree import TokenTree


def test_lookup_takes_the_longest_match_most_recent_first():
    seq = [5, 6, 7, 1, 5, 6, 9, 2, 5, 6]
    assert lookup(seq, max_len=3) == [NgramChain((9, 2, 5), 2), NgramChain((7, 1, 5), 2)]
    # (9, 8) never occurred: the 1-token suffix (8,) did, at 2 -> (3, 8).
    assert lookup([1, 9, 8, 3, 8], max_len=2) == [NgramChain((3, 8), 1)]
    assert lookup([4, 4], max_len=5) == [NgramChain((4,), 1)]
    assert lookup([1, 2, 3]) == [] and lookup([7]) == []
    # Distinct first tokens only; at most max_chains.
    assert [c.tokens[0] for c in lookup([1, 2, 1, 3, 1, 2, 1, 4, 1], max_chains=2, max_len=1)] == [4, 2]


def test_isotonic_pools_adjacent_violators():
    y = torch.tensor([0.1, 0.5, 0.3, 0.6, 0.2], dtype=torch.float64)
    out = _isotonic(y, torch.ones(5, dtype=torch.float64))
    assert torch.allclose(out, torch.tensor([0.1, 0.4, 0.4, 0.4, 0.4], dtype=torch.float64))
    assert torch.allclose(_isotonic(torch.tensor([0.1, 0.2]), torch.ones(2)), torch.tensor([0.1, 0.2], dtype=torch.float64))


def test_with_no_evidence_estimates_are_the_draft_probabilities():
    cal = Calibration(AcceptanceCounts.zeros())
    p = torch.tensor([0.001, 0.03, 0.25, 0.5, 0.77, 0.97])
    est = cal.draft(p, torch.tensor(3))
    assert torch.allclose(est, p.double(), atol=0.03)
    assert math.isclose(cal.ngram(2, 3), NGRAM_PRIOR)


def tree_of(p_children: list[float], depth2: list[float]) -> TokenTree:
    """root -> children with draft probabilities p_children (tokens 10, 11, ...); the first child has children
    with probabilities depth2 (tokens 20, 21, ...)."""
    tree = TokenTree(0)
    for i, p in enumerate(p_children):
        tree.add(0, 10 + i, p, draft_prob=p, estimate=p)
    for i, p in enumerate(depth2):
        tree.add(1, 20 + i, p_children[0] * p, draft_prob=p, estimate=p)
    return tree


def test_learning_moves_estimates_toward_observed_rates_and_keeps_them_monotone():
    """The draft says 0.9 at depth 1 but the target takes that token a third of the time; at depth 2 the draft's
    0.35 tokens are always taken."""
    calibrator = Calibrator()
    for k in range(60):
        tree = tree_of([0.9, 0.05], [0.35, 0.15])
        best = [10 if k % 3 == 0 else 99, 20, 0, 0, 0]                  # target argmax at each node
        calibrator.add(observe(tree, judged_greedy(tree, best)))
    cal = calibrator.calibration()
    depth1 = cal.draft(torch.tensor([0.05, 0.5, 0.9]), torch.tensor(1))
    assert abs(float(depth1[2]) - 1 / 3) < 0.05
    assert float(depth1[0]) <= float(depth1[1]) <= float(depth1[2])          # still ranked as the draft ranks
    assert float(cal.draft(torch.tensor(0.35), torch.tensor(2))) > 0.9
    assert float(cal.draft(torch.tensor(0.9), torch.tensor(5))) > 0.5       # depth 5 unseen: pooled, shrunk to p
    report = calibrator.counts.report()
    d1 = next(r for r in report["by_depth"] if r["depth"] == "1")
    assert d1["n"] == 120 and abs(d1["observed"] - 20 / 120) < 1e-3 and abs(d1["draft_p"] - 0.475) < 1e-3


def test_observations_at_t0_cover_every_node_and_at_t_above_0_the_visited_ones():
    tree = tree_of([0.6, 0.2], [0.5])
    greedy = observe(tree, judged_greedy(tree, [11, 20, 0, 0]))      # root: target takes 11; node 1: takes 20
    assert greedy.observations == 3 and int(greedy.draft_hits.sum()) == 2
    # T > 0, node 2 accepted at the root: the root's two children are observed, node 1's child was never tried.
    sampled = observe(tree, judged_path(tree, [2]))
    assert sampled.observations == 2 and int(sampled.draft_hits.sum()) == 1


def test_ngram_chains_graft_onto_the_tree_and_share_the_budget():
    V = 12
    dist = torch.full((V, V), 0.01)
    dist[:, 5] = 1.0 - 0.01 * (V - 1)                                       # the draft always says 5

    def draft_step(tree, frontier):
        return dist[tree.tokens[frontier]]

    greedy = SamplingConfig(temperature=0.0)
    cfg = TreeConfig(policy="dyspec", branching=2, max_depth=4)
    chains = [NgramChain((5, 5, 7, 8), 3), NgramChain((9, 1), 1)]
    tree = grow(cfg, greedy, 3, dist[3], draft_step, 6, make_generator(0), ngram=chains)
    assert tree.size == 6
    paths = {tuple(tree.tokens[tree.path_to(n)].tolist()[1:]): tree.ngram_match(n) for n in range(1, tree.n_nodes)}
    # The chain follows the draft's 5 -> 5 and adds 7 (an n-gram node) under it; the draft's own nodes stay.
    assert paths[(5,)] == 0 and paths[(5, 5)] == 0 and paths[(5, 5, 7)] == 3
    assert all(tree.values[n] <= tree.values[tree.parents[n]] for n in range(1, tree.n_nodes))
    assert not any(tree.expanded(n) for n in range(1, tree.n_nodes) if tree.ngram_match(n))
    # With a budget of 2 only the two likeliest nodes stay, the draft's.
    small = grow(cfg, greedy, 3, dist[3], draft_step, 2, make_generator(0), ngram=chains)
    assert small.size == 2 and all(small.ngram_match(n) == 0 for n in range(1, small.n_nodes))


def test_calibration_plot_reads_bench_rows(tmp_path):
    import json

    from scripts_module import load_script

    plot = load_script("calibration_plot")
    counts = AcceptanceCounts.zeros()
    for k in range(30):
        tree = tree_of([0.9, 0.05], [0.35, 0.15])
        tree.add(2, 30, 0.01, estimate=0.4, ngram_match=2)                 # an n-gram node under node 2
        counts = counts + observe(tree, judged_greedy(tree, [10 if k % 3 else 11, 20, 30, 0, 0, 0]))
    report = counts.report()
    assert report["ngram_nodes"] == 30 and report["ngram_observed"] == 1.0
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"temperature": 0.0, "prompt_set": "chat", "calibrate": True,
                                "calibration": report}) + "\n")
    out = tmp_path / "cal.png"
    assert plot.main(["--rows", str(rows), "--prompt-set", "chat", "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    assert plot.main(["--rows", str(rows), "--prompt-set", "code", "--out", str(out)]) == 1
    import gzip  # the rows as committed: gzip-compressed
    packed = tmp_path / "packed.jsonl.gz"
    packed.write_bytes(gzip.compress(rows.read_bytes()))
    out.unlink()
    assert plot.main(["--rows", str(packed), "--prompt-set", "chat", "--out", str(out)]) == 0 and out.is_file()
