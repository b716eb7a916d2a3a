"""Seconds per token: choosing the tree budget on the running hardware, and predicting other hardware.

A round costs  t_round(B) = t_draft(depth(B)) + t_target(B)  and yields  E(B) = 1 + sum of the B best node
values  tokens, because a DySpec node's value estimates the probability that it is reached and accepted
(and the expected accepted length is the sum of those probabilities over the tree). The best budget
minimizes t_round(B) / E(B). All three ingredients are measured while generating:
  t_target(n) = a + b * n     least squares over the passes seen (n = tokens in the pass)
  t_draft(d)  = c * (d + 1)   one catch-up call plus one batched call per depth
  E(B)        from the values of the last tree (sorted, cumulative)
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from .config import AUTO_MAX_TREE_BUDGET


class BudgetPlanner:
    """Picks each round's tree budget ("auto") from measured draft and target costs."""

    def __init__(self, start: int = 32, max_budget: int = AUTO_MAX_TREE_BUDGET, max_depth: int = 32):
        self.budget = min(start, max_budget)
        self.max_budget = max_budget
        self.max_depth = max_depth       # TreeConfig.max_depth: trees that reach it can only grow wider
        self.passes: deque[tuple[int, float]] = deque(maxlen=32)   # (tokens in pass, seconds)
        self.draft_per_call: Optional[float] = None
        self.explored_low = False

    def next_budget(self) -> int:
        return self.budget

    def observe(self, tree, draft_seconds: float, target_seconds: float, pass_tokens: int) -> None:
        self.passes.append((pass_tokens, target_seconds))
        if tree.size > 0:
            per_call = draft_seconds / (tree.depth + 1)
            self.draft_per_call = per_call if self.draft_per_call is None else 0.7 * self.draft_per_call + 0.3 * per_call
            self.budget = self._choose(tree)

    def target_fit(self) -> tuple[float, float]:
        """(a, b) of t_target(n) = a + b n; b >= 0. Needs passes of at least two sizes."""
        ns = torch.tensor([n for n, _ in self.passes], dtype=torch.float64)
        ts = torch.tensor([t for _, t in self.passes], dtype=torch.float64)
        if ns.numel() < 2 or float(ns.max() - ns.min()) == 0.0:
            return float(ts.mean()), 0.0
        A = torch.stack([torch.ones_like(ns), ns], 1)
        a, b = torch.linalg.lstsq(A, ts[:, None]).solution[:, 0].tolist()
        b = max(b, 0.0)
        return max(float((ts - b * ns).mean()), 0.0), b

    def _choose(self, tree) -> int:
        values = tree.values[1:].double()
        depths = tree.depths[1:]
        order = torch.argsort(values, descending=True)
        expected = 1.0 + torch.cumsum(values[order], 0)                              # E(B), B = 1..size
        depth_of = torch.cummax(depths[order], 0).values.double()                    # depth(B)
        a, b = self.target_fit()
        B = torch.arange(1, values.numel() + 1, dtype=torch.float64)
        seconds = self.draft_per_call * (depth_of + 1) + a + b * (B + 1)
        best = int(torch.argmin(seconds / expected)) + 1
        if len({n for n, _ in self.passes}) < 3 and not self.explored_low:
            # Too few distinct pass sizes to know b: try a small tree once to measure the slope.
            self.explored_low = True
            return max(1, tree.size // 4)
        if best >= tree.size and tree.depth < self.max_depth:
            # The optimum is at the edge of what we explored: look further. (A tree already as deep as allowed
            # would only get wider, at values below everything it holds: the edge is where it stops.)
            return min(self.max_budget, max(2 * tree.size, 2))
        return max(1, best)


@dataclass(frozen=True)
class GpuSetup:
    """A hypothetical machine for `predict_seconds_per_token`."""
    link_gb_per_s: float = 24.0       # host->device bandwidth, pinned (PCIe 4.0 x16 ≈ 24 GB/s)
    resident_bytes: int = 0           # target weight bytes kept on the GPU for good (not moved per pass)


def predict_seconds_per_token(streamed_bytes: int, setup: GpuSetup, tokens_per_pass: float,
                              draft_seconds_per_round: float, compute_seconds_per_pass: float = 0.0) -> dict:
    """PREDICTION for a streamed target on a GPU:
        t_pass  = max(streamed_bytes / link, compute)       (copies overlap compute)
        s/token = (t_pass + t_draft) / tokens_per_pass
    (the draft is not overlapped with the pass here, a conservative assumption)."""
    transfer = max(streamed_bytes - setup.resident_bytes, 0) / (setup.link_gb_per_s * 1e9)
    t_pass = max(transfer, compute_seconds_per_pass)
    return {
        "transfer_seconds_per_pass": transfer,
        "pass_seconds": t_pass,
        "seconds_per_token": (t_pass + draft_seconds_per_round) / max(tokens_per_pass, 1e-9),
        "formula": "(max(bytes/link, compute) + draft) / tokens_per_pass",
    }
