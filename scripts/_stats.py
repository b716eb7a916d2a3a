"""Statistics and provenance shared by the benchmark scripts: offspec.bench's (the one runner's), and the line
that says when, at which commits and under what load a table's rows were measured.

- A cell's figure is the median over prompts of each prompt's value, with a percentile-bootstrap 95% interval
  over prompts (prompts resampled with replacement, the median recomputed each time): the interval says how
  much the figure depends on which prompts were drawn, which is what a reader generalizing from it needs.
- A ratio of two systems' medians (a speedup) is bootstrapped pairwise: each resample draws prompts and takes
  both systems' values of the same prompts, so prompt difficulty, shared by both, cancels as in the figure.
- Timed cells run in an order shuffled per prompt and repeat (`shuffled_order`), so a slow spell of the
  shared machine falls on different systems each time; a prompt's value is the median of its repeats.
- Every row carries `stamp()`: the commit, the time, the load average and the CPU it was measured at.
"""
from __future__ import annotations

from offspec.bench import fmt_ci, median_ci, ratio_ci, shuffled_order, stamp  # noqa: F401


def provenance_text(rows: list[dict]) -> str:
    """When, at which commits and under what load the rows were measured (rows from before stamps: not known)."""
    stamps = [r["stamp"] for r in rows if "stamp" in r]
    if not stamps:
        return "The rows carry no commit, time or load average (measured before issue #13 added them)."
    times = sorted(s["time"] for s in stamps)
    commits = sorted({s["commit"] or "?" for s in stamps})
    machines = sorted({s.get("machine", "?") for s in stamps})
    loads = [s["load_average"][0] for s in stamps if s["load_average"]]
    load = f"; 1-minute load average {min(loads):.2f} to {max(loads):.2f} across them" if loads else ""
    return (f"{len(stamps)} of {len(rows)} rows stamped: measured {times[0]} to {times[-1]} at commit(s) "
            f"{', '.join(commits)} on {'; '.join(machines)}{load}.")
