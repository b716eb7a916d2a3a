#!/usr/bin/env python
"""A prediction, not a measurement: the budget planner's best Sequoia tree for a pair's cached acceptance-by-rank
vector under stated costs, with a depth bound of 32 against none (--max-depth auto).

A round of a tree of n nodes, L levels deep, costs  c0 (L + 1) + a + b (n + 1)  (one draft call a level plus the
catch-up, the pass, b a verified token) and yields  1 + F(n, L)  tokens (Sequoia's DP, offspec.spec.sequoia). For
each (a, c0) the best n (powers of two up to 1024) under each bound; F is the vector's, so the figures hold as far
as the vector predicts the prompts (docs/notes/2026-11-30-the-depth-the-costs-choose.md, section 2).

  python scripts/devtools/sequoia_depth_plan.py ~/.cache/offspec/sequoia/<key>.json --pass 0.5,1.5,2.6 \\
      --call-ms 5,15,40
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # offspec

from offspec.config import AUTO_MAX_TREE_BUDGET, FIXED_BUDGET_DEPTH, TreeConfig  # noqa: E402
from offspec.spec.sequoia import RankCounts, best_tree  # noqa: E402

BUDGETS = [2 ** i for i in range(2, AUTO_MAX_TREE_BUDGET.bit_length())]     # 4 ... the auto budget's largest


def read_vector(path: str) -> RankCounts:
    """A pair's cached counts by rank, resized to the tree's branching; SystemExit with one line if unreadable."""
    try:
        return RankCounts.from_dict(json.loads(Path(path).expanduser().read_text())).resized(TreeConfig.branching)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"sequoia_depth_plan: cannot read an acceptance vector from {path}: {e}") from None


def best_round(p, a: float, b: float, c0: float, bound: int) -> tuple[float, int, int, float]:
    """(seconds a token, n, depth, tokens a round) of the cheapest tree a token under the depth bound."""
    rounds = []
    for n in BUDGETS:
        shape, F = best_tree(p, n, bound)
        depths = [0]
        for parent, _ in shape:
            depths.append(depths[parent] + 1)
        L = max(depths)
        seconds = c0 * (L + 1) + a + b * (n + 1)
        rounds.append((seconds / (1 + F), n, L, 1 + F))
    return min(rounds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("vector", help="a pair's cache file, $OFFSPEC_HOME/sequoia/<key>.json")
    ap.add_argument("--pass", dest="passes", default="0.5,1.5,2.6", help="pass seconds a, comma-separated")
    ap.add_argument("--call-ms", default="5,15,40", help="draft call milliseconds c0, comma-separated")
    ap.add_argument("--token-ms", type=float, default=1.0, help="b: milliseconds a verified token")
    args = ap.parse_args(argv)
    counts = read_vector(args.vector)
    p = counts.vector()
    print(f"p = {', '.join(f'{x:.4f}' for x in p[:3])}, ...; {counts.observations:.0f} observations; "
          f"b = {args.token_ms:g} ms a token")
    print(f"| pass a (s) | draft call c0 (ms) | depth <= {FIXED_BUDGET_DEPTH}: s/token, n, depth, tokens a pass "
          "| auto: s/token, n, depth, tokens a pass | auto / bound |")
    print("|---|---|---|---|---|")
    for a in (float(x) for x in args.passes.split(",")):
        for c0 in (float(x) / 1e3 for x in args.call_ms.split(",")):
            rows = [best_round(p, a, args.token_ms / 1e3, c0, bound)
                    for bound in (FIXED_BUDGET_DEPTH, AUTO_MAX_TREE_BUDGET)]
            cells = [f"{s:.3f}, {n}, {d}, {t:.1f}" for s, n, d, t in rows]
            print(f"| {a:g} | {c0 * 1e3:g} | {cells[0]} | {cells[1]} | {rows[0][0] / rows[1][0]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
