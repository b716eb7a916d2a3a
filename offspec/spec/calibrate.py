"""Acceptance calibration: node values that predict what the target accepts, learned while generating.

A node's DySpec value is the product, along its path, of each node's conditional acceptance estimate
a(x) = P(the target accepts x | it accepted x's parent). Uncalibrated, a(x) = p(x), the draft's probability of
x: small drafts are over-confident on some tokens and under-confident on others, and the bias differs by
depth. Every verified tree says what really happened, so a run learns the map as it goes:

  draft nodes   a = f_d(p): per depth bucket d, the observed acceptance rate in bins of p, shrunk toward the
                all-depth rate of the bin (itself shrunk toward the bin's mean p, so with no evidence f = p),
                made non-decreasing in p (pool adjacent violators) and read by linear interpolation between
                bin centres. Non-decreasing in p keeps siblings ranked as the draft ranks them.
  n-gram nodes  a = g_d(n): per depth bucket and match length n (ngram.py), the observed rate shrunk toward
                NGRAM_PRIOR.

Observations (what "accepted given the parent accepted" means, read off one verified tree):
  T = 0  every node x with parent u: accepted iff x's token is the target's argmax at u. The one target pass
         gives the target's logits at EVERY node, so every node of the tree is an observation.
  T > 0  the children of each node verification visited (the root and the accepted path): accepted iff it is
         the child verification accepted there. Other nodes were never tried.

Rates are kept per row in flight: cheap counts in bins, updated after every pass, starting from the counts the
pair's earlier runs left in its cache (engine.pair_cache), which the engine adds each row's counts to. Only which
nodes are proposed changes; verification and hence the output are untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Optional, Sequence

import torch

P_EDGES = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
DEPTH_STARTS = (1, 2, 3, 4, 5, 7, 10, 15)   # depth buckets: [1], [2], [3], [4], [5, 6], [7, 9], [10, 14], [15, ...)
MATCH_STARTS = (1, 2, 3, 4, 6)              # n-gram match-length buckets: 1, 2, 3, 4-5, 6+
PRIOR_WEIGHT = 4.0                          # pseudo-observations behind each prior
NGRAM_PRIOR = 0.4                           # an n-gram node's acceptance before any was observed
EMPTY_BIN_WEIGHT = 0.05                     # weight of a bin's prior when the bins are made monotone

_P_EDGES = torch.tensor(P_EDGES, dtype=torch.float64)
_P_MIDS = (_P_EDGES[1:] + _P_EDGES[:-1]) / 2
_DEPTHS = torch.tensor(DEPTH_STARTS[1:])
_MATCHES = torch.tensor(MATCH_STARTS[1:])
N_DEPTH, N_P, N_MATCH = len(DEPTH_STARTS), len(P_EDGES) - 1, len(MATCH_STARTS)


def depth_bucket(depth: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(depth, _DEPTHS, right=True)


def p_bin(p: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(p.double(), _P_EDGES[1:-1], right=True)


def match_bucket(match: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(match, _MATCHES, right=True)


@dataclass
class AcceptanceCounts:
    """Observed acceptances in bins. draft_*: (N_DEPTH, N_P) by depth bucket x bin of p; ngram_*: (N_DEPTH,
    N_MATCH) by depth bucket x match-length bucket. n = observations, hits = accepted, p = sum of the draft
    probabilities (draft bins), est = sum of the estimates the tree was grown with."""
    draft_n: torch.Tensor
    draft_hits: torch.Tensor
    draft_p: torch.Tensor
    draft_est: torch.Tensor
    ngram_n: torch.Tensor
    ngram_hits: torch.Tensor
    ngram_est: torch.Tensor

    @classmethod
    def zeros(cls) -> "AcceptanceCounts":
        d = lambda: torch.zeros(N_DEPTH, N_P, dtype=torch.float64)
        g = lambda: torch.zeros(N_DEPTH, N_MATCH, dtype=torch.float64)
        return cls(d(), d(), d(), d(), g(), g(), g())

    def __add__(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        return AcceptanceCounts(*(a + b for a, b in zip(self._fields(), other._fields())))

    def __sub__(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        return AcceptanceCounts(*(a - b for a, b in zip(self._fields(), other._fields())))

    def _fields(self) -> tuple:
        """The count tensors in field order (the constructor's)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def observations(self) -> int:
        return int(self.draft_n.sum() + self.ngram_n.sum())

    def to_dict(self) -> dict:
        """Every field as nested lists (rows by depth bucket), for a pair's cache file (engine.pair_cache)."""
        return {f.name: getattr(self, f.name).tolist() for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceCounts":
        """to_dict's inverse; ValueError unless every field has its shape and 0 <= hits <= n."""
        zero = cls.zeros()
        counts = cls(*(torch.tensor(d[f.name], dtype=torch.float64) for f in fields(cls)))
        if any(a.shape != z.shape for a, z in zip(counts._fields(), zero._fields())):
            raise ValueError(f"acceptance counts: fields of shapes {[tuple(z.shape) for z in zero._fields()]} expected")
        for n, hits in ((counts.draft_n, counts.draft_hits), (counts.ngram_n, counts.ngram_hits)):
            if (hits < 0).any() or (hits > n).any():
                raise ValueError("acceptance counts: 0 <= hits <= n expected in every bin")
        return counts

    def report(self) -> dict:
        """Predicted vs observed acceptance, for the JSON report: per depth bucket (draft nodes) the mean draft
        probability (DySpec's estimate), the mean estimate the trees were grown with and the observed rate,
        plus every non-empty bin, and the same for n-gram nodes by match length."""
        def rate(a, n):
            return round(float(a / n), 4) if n > 0 else None

        depths = [f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in zip(DEPTH_STARTS, DEPTH_STARTS[1:])]
        depths.append(f"{DEPTH_STARTS[-1]}+")
        by_depth, bins = [], []
        for d in range(N_DEPTH):
            n = float(self.draft_n[d].sum())
            if n > 0:
                by_depth.append({"depth": depths[d], "n": int(n), "draft_p": rate(self.draft_p[d].sum(), n),
                                 "estimate": rate(self.draft_est[d].sum(), n),
                                 "observed": rate(self.draft_hits[d].sum(), n)})
            for b in range(N_P):
                n = float(self.draft_n[d, b])
                if n > 0:
                    bins.append({"depth": depths[d], "p_bin": [P_EDGES[b], P_EDGES[b + 1]], "n": int(n),
                                 "draft_p": rate(self.draft_p[d, b], n), "estimate": rate(self.draft_est[d, b], n),
                                 "observed": rate(self.draft_hits[d, b], n)})
        matches = [f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in zip(MATCH_STARTS, MATCH_STARTS[1:])]
        matches.append(f"{MATCH_STARTS[-1]}+")
        ngram = [{"depth": depths[d], "match": matches[m], "n": int(self.ngram_n[d, m]),
                  "estimate": rate(self.ngram_est[d, m], self.ngram_n[d, m]),
                  "observed": rate(self.ngram_hits[d, m], self.ngram_n[d, m])}
                 for d in range(N_DEPTH) for m in range(N_MATCH) if self.ngram_n[d, m] > 0]
        n_draft, n_ngram = float(self.draft_n.sum()), float(self.ngram_n.sum())
        return {"draft_nodes": int(n_draft), "draft_p": rate(self.draft_p.sum(), n_draft),
                "draft_estimate": rate(self.draft_est.sum(), n_draft),
                "draft_observed": rate(self.draft_hits.sum(), n_draft),
                "ngram_nodes": int(n_ngram), "ngram_estimate": rate(self.ngram_est.sum(), n_ngram),
                "ngram_observed": rate(self.ngram_hits.sum(), n_ngram),
                "by_depth": by_depth, "bins": bins, "ngram": ngram}


def observe(tree, accepted_child: dict[int, Optional[int]]) -> AcceptanceCounts:
    """One verified tree -> its observations. accepted_child: for each node whose children were judged, the
    child the target accepts there (None: none of them). See the module docstring for which nodes those are."""
    counts = AcceptanceCounts.zeros()
    nodes = [c for u in accepted_child for c in tree.children(u)]
    if not nodes:
        return counts
    idx = torch.tensor(nodes)
    parents = tree.parents[idx].tolist()
    hit = torch.tensor([accepted_child[u] == c for u, c in zip(parents, nodes)], dtype=torch.float64)
    depth = depth_bucket(tree.depths[idx])
    match = torch.tensor([tree.ngram_match(c) for c in nodes])
    est = torch.tensor([tree.estimate(c) for c in nodes], dtype=torch.float64)
    is_ngram = match > 0
    d, h, e = depth[~is_ngram], hit[~is_ngram], est[~is_ngram]
    if d.numel():
        p = torch.tensor([tree.draft_prob(c) for c, g in zip(nodes, is_ngram.tolist()) if not g], dtype=torch.float64)
        flat = d * N_P + p_bin(p)
        for total, x in ((counts.draft_n, torch.ones_like(p)), (counts.draft_hits, h), (counts.draft_p, p),
                         (counts.draft_est, e)):
            total.view(-1).index_add_(0, flat, x)
    if is_ngram.any():
        flat = depth[is_ngram] * N_MATCH + match_bucket(match[is_ngram])
        for total, x in ((counts.ngram_n, torch.ones(int(is_ngram.sum()), dtype=torch.float64)),
                         (counts.ngram_hits, hit[is_ngram]), (counts.ngram_est, est[is_ngram])):
            total.view(-1).index_add_(0, flat, x)
    return counts


def judged_greedy(tree, best: Sequence[int]) -> dict[int, Optional[int]]:
    """T = 0: every node with children, and the child equal to the target's argmax there (best (N,))."""
    tokens = tree.tokens.tolist()
    return {u: next((c for c in tree.children(u) if tokens[c] == best[u]), None)
            for u in range(tree.n_nodes) if tree.children(u)}


def judged_path(tree, accepted: Sequence[int]) -> dict[int, Optional[int]]:
    """T > 0: the root and each accepted node, and the child accepted after it (None after the last)."""
    path = [0, *accepted]
    return {u: (path[k + 1] if k + 1 < len(path) else None) for k, u in enumerate(path) if tree.children(u)}


class Calibration:
    """The estimates one round's growth uses (a snapshot: a round never sees its own outcome)."""

    def __init__(self, counts: AcceptanceCounts):
        c = counts
        # Draft bins: the bin's mean p (its midpoint while empty) is the prior; pooled over depths first.
        n_all, hits_all, p_all = c.draft_n.sum(0), c.draft_hits.sum(0), c.draft_p.sum(0)          # (N_P,)
        centre = torch.where(n_all > 0, p_all / n_all.clamp_min(1), _P_MIDS)
        pooled = (hits_all + PRIOR_WEIGHT * centre) / (n_all + PRIOR_WEIGHT)
        rate = (c.draft_hits + PRIOR_WEIGHT * pooled) / (c.draft_n + PRIOR_WEIGHT)                 # (N_DEPTH, N_P)
        self.centre = centre                                                                        # (N_P,)
        # Monotone by weight of evidence: a bin with no observations of its own (its prior only) barely pulls
        # on an observed neighbour, so an over-confident bin is not dragged back up to p by empty bins above it.
        self.rate = torch.stack([_isotonic(r, w) for r, w in zip(rate, c.draft_n + EMPTY_BIN_WEIGHT)])
        g_all = (c.ngram_hits.sum(0) + PRIOR_WEIGHT * NGRAM_PRIOR) / (c.ngram_n.sum(0) + PRIOR_WEIGHT)  # (N_MATCH,)
        self.ngram_rate = (c.ngram_hits + PRIOR_WEIGHT * g_all) / (c.ngram_n + PRIOR_WEIGHT)         # (N_DEPTH, N_MATCH)

    def draft(self, p: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """p (...,) draft probabilities of nodes at depth (...,) (broadcast) -> their estimates (...,), float64.
        Piecewise linear through (centre_b, rate_b); below the first centre it falls linearly to 0 at p = 0."""
        p = p.double()
        rows = self.rate[depth_bucket(depth)].expand(*torch.broadcast_shapes(p.shape, depth.shape), N_P)  # (..., N_P)
        p = p.expand(rows.shape[:-1])
        hi = torch.searchsorted(self.centre, p.unsqueeze(-1)).clamp(1, N_P - 1)                          # (..., 1)
        x0, x1 = self.centre[hi - 1], self.centre[hi]
        y0, y1 = rows.gather(-1, hi - 1), rows.gather(-1, hi)
        t = ((p.unsqueeze(-1) - x0) / (x1 - x0)).clamp(0.0, 1.0)
        out = (y0 + t * (y1 - y0)).squeeze(-1)
        low = p < self.centre[0]
        out = torch.where(low, rows[..., 0] * p / self.centre[0], out)
        return out.clamp(0.0, 1.0)

    def ngram(self, depth: int, match: int) -> float:
        """The estimate of an n-gram node at `depth` from a chain whose suffix matched `match` tokens."""
        return float(self.ngram_rate[int(depth_bucket(torch.tensor(depth))), int(match_bucket(torch.tensor(match)))])


UNCALIBRATED_NGRAM = NGRAM_PRIOR   # an n-gram node's estimate when calibration is off


class Calibrator:
    """One row's running counts: `start` (the pair's counts from earlier runs, and for a greedy row this engine's
    earlier rows: engine.pair_cache; none by default) plus what the row observes, unless frozen. Each observation is
    also handed to `share` (the engine's pair cache, saved at close). `calibration()` is the snapshot for the next
    round."""

    def __init__(self, start: Optional[AcceptanceCounts] = None, frozen: bool = False,
                 share: Optional[Callable[[AcceptanceCounts], None]] = None):
        self.counts = start if start is not None else AcceptanceCounts.zeros()
        self.frozen, self.share = frozen, share
        self._snapshot: Optional[Calibration] = None

    def calibration(self) -> Calibration:
        if self._snapshot is None:
            self._snapshot = Calibration(self.counts)
        return self._snapshot

    def add(self, counts: AcceptanceCounts) -> None:
        if self.frozen:
            return
        self.counts = self.counts + counts
        self._snapshot = None
        if self.share is not None:
            self.share(counts)


def _isotonic(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The non-decreasing sequence closest to y in weighted least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []        # [mean, weight, length]
    for yi, wi in zip(y.tolist(), w.tolist()):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return torch.tensor([m for m, _, n in blocks for _ in range(n)], dtype=torch.float64)
