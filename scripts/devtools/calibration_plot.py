#!/usr/bin/env python
"""Predicted vs observed acceptance of tree nodes, by depth, from the old bench_accept's archived rows (their "calibration" field,
offspec.spec.calibrate.AcceptanceCounts.report): one panel per depth bucket, each bin of draft probability a point
at (predicted, observed) for two predictors: the draft's probability p (DySpec's estimate) and the calibrated
estimate the trees were grown with. On the diagonal = predicts acceptance. N-gram nodes: one point per depth.

Observations (calibrate.py): at T = 0 every tree node is one (accepted iff the target's argmax at its parent
is its token); at T > 0 the children of the nodes verification visited.

Example:
  python scripts/devtools/calibration_plot.py --rows docs/bench_accept_levers.jsonl.gz --prompt-set chat --out docs/calibration.png
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]   # offspec, scripts/
import _common  # noqa: E402

from offspec.bench import runner as bench  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--rows", required=True, help="the old bench_accept's rows (jsonl, or jsonl.gz)")
    p.add_argument("--prompt-set", default=None, help="only rows of this prompt set (code, chat)")
    p.add_argument("--temperature", type=float, default=0.0, help="only rows at this temperature")
    p.add_argument("--calibrate", choices=("on", "off", "any"), default="on",
                   help="only rows grown with (on) or without (off) calibration")
    p.add_argument("--out", required=True, help="PNG to write")
    return p.parse_args(argv)


def pooled(rows: list[dict]) -> tuple[dict, dict]:
    """Bins summed over rows: (depth, p_bin) -> [n, sum draft p, sum estimate, hits]; depth -> n-gram sums."""
    draft, ngram = defaultdict(lambda: [0.0] * 4), defaultdict(lambda: [0.0] * 3)
    for r in rows:
        cal = r.get("calibration") or {}
        for b in cal.get("bins", []):
            acc = draft[(b["depth"], tuple(b["p_bin"]))]
            n = b["n"]
            for k, x in enumerate((n, b["draft_p"] * n, b["estimate"] * n, b["observed"] * n)):
                acc[k] += x
        for g in cal.get("ngram", []):
            acc = ngram[g["depth"]]
            for k, x in enumerate((g["n"], g["estimate"] * g["n"], g["observed"] * g["n"])):
                acc[k] += x
    return draft, ngram


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = bench.read_rows(args.rows)                    # .jsonl or .jsonl.gz
    rows = [r for r in rows if r.get("calibration") and r["temperature"] == args.temperature
            and (args.prompt_set is None or r.get("prompt_set", "code") == args.prompt_set)
            and (args.calibrate == "any" or r.get("calibrate", False) == (args.calibrate == "on"))]
    if not rows:
        print("error: no rows with calibration data match", file=sys.stderr)
        return 1
    draft, ngram = pooled(rows)
    depths = sorted({d for d, _ in draft}, key=lambda d: int(d.split("-")[0].rstrip("+")))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(depths))
    nrows = (len(depths) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(3.4 * cols, 3.3 * nrows), squeeze=False)
    for ax in axes.flat[len(depths):]:
        ax.axis("off")
    for ax, depth in zip(axes.flat, depths):
        cells = sorted((b, acc) for (d, b), acc in draft.items() if d == depth and acc[0] > 0)
        n = [acc[0] for _, acc in cells]
        size = [12 + 60 * (x / max(n)) for x in n]
        ax.scatter([a[1] / a[0] for _, a in cells], [a[3] / a[0] for _, a in cells], s=size, marker="o",
                   label="draft p")
        ax.scatter([a[2] / a[0] for _, a in cells], [a[3] / a[0] for _, a in cells], s=size, marker="x",
                   label="calibrated")
        if depth in ngram and ngram[depth][0] > 0:
            g = ngram[depth]
            ax.scatter([g[1] / g[0]], [g[2] / g[0]], s=60, marker="^", label=f"n-gram ({int(g[0])})")
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"depth {depth} ({int(sum(n))} nodes)", fontsize=9)
        ax.set_xlabel("predicted acceptance", fontsize=8)
        ax.set_ylabel("observed", fontsize=8)
        ax.legend(fontsize=7)
    sets = sorted({r.get("prompt_set", "code") for r in rows})
    fig.suptitle(f"{len(rows)} bench_accept runs ({', '.join(sets)}; T = {args.temperature:g}); marker size = nodes "
                 f"in the bin", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(f"plot: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
