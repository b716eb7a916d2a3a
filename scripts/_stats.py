"""Statistics and provenance shared by the benchmark scripts: offspec.bench.runner's (the one runner's). The line that
says where, when and at which commits a table's rows were measured is _common.measured_line.

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

from offspec.bench.runner import fmt_ci, median_ci, ratio_ci, shuffled_order, stamp

__all__ = ["fmt_ci", "median_ci", "ratio_ci", "shuffled_order", "stamp"]
