"""Sequoia trees: the fixed shape that maximizes the expected accepted tokens, and the vector it is built from.

Sequoia (Chen et al. 2024, "Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding"), in its notation:
  p_i         acceptance by rank: the probability that verification accepts a node's i-th ranked child
              (i = 1..K; sum_i p_i <= 1). Verification tries the children in rank order, so p_i already
              includes "children 1..i-1 were rejected". Assumed the same at every node ("positional acceptance").
  f(v)        the probability that node v is accepted: the product of p_{rank(u)} over the nodes u on the path
              from the root to v (f(root) = 1).
  F(T)        sum_v f(v) over the nodes of tree T besides the root: the expected accepted tokens a round.
  c(m, l)     the largest  1 + F  of a tree with at most m nodes (its root included) and at most l levels
              below its root; c(1, l) = c(m, 0) = 1.
  D_l(s, i)   the largest  sum_{j>=i} p_j c(s_j, l - 1)  over children of ranks i, i+1, ... whose subtrees hold
              s_i + s_{i+1} + ... <= s nodes. A node's children are a PREFIX of its ranks (the k-th child exists
              only with the first k - 1: verification tries them in order, and at T > 0 they are the first draws
              of a without-replacement sequence), so the choice at rank i is to stop or to place child i:
                  D_l(s, i) = max(0, max_{1<=t<=s} p_i c(t, l - 1) + D_l(s - t, i + 1)),   D_l(s, K + 1) = 0
                  c(m, l)   = 1 + D_l(m - 1, 1).
              (With p non-increasing, "stop" and Sequoia's "skip rank i" give the same optimum.)
The best tree of budget n (nodes besides the root) and depth bound L is the argmax behind c(n + 1, L).

The vector p, measured on the run's own draft and target (RankCounts), per rank i (0-based here):
  tried_i     judged nodes whose i-th child existed and no earlier child was accepted there;
  hits_i      judged nodes whose accepted child was the i-th.
  h_i = (hits_i + W * prior_i) / (tried_i + W), the hazard (accepted once tried), and
  p_i = h_i * prod_{j<i} (1 - h_j).
A node's children are judged (calibrate.judged_greedy / judged_path) whether or not a later rank existed,
so ranks a tree did not grow are censored, not failures. The prior is optimistic (HAZARD_PRIOR), so the DP
tries ranks it has not seen. The same estimator serves T = 0 (child i is accepted iff it is the target's argmax)
and T > 0 (child i is tried after children 1..i-1 were rejected).
"""
from __future__ import annotations

import functools
import heapq
from collections import deque
from dataclasses import dataclass
from typing import Callable, Generator, Optional, Sequence

import numpy as np

AUTO = "auto"       # a TreeConfig.policy the engine resolves by its draft (chosen_policy) before any tree grows
HAZARD_PRIOR = (0.5, 0.25)      # prior hazard of rank 0, and of every later rank
PRIOR_WEIGHT = 4.0              # pseudo-observations behind each prior hazard
Shape = tuple[tuple[int, int], ...]   # (parent index, rank) per node besides the root, breadth first; root = 0


def chosen_policy(policy: str, twin: bool) -> str:
    """The policy a request runs: `policy`, or for AUTO, sequoia where the draft is the target's twin and dyspec
    where it is a separate model (why: docs/options.md, "Which tree for which draft")."""
    return policy if policy != AUTO else "sequoia" if twin else "dyspec"


# ---------------------------------------------------------------------------------------------------------
def best_tree(p: Sequence[float], n: int, depth: int) -> tuple[Shape, float]:
    """The tree of at most n nodes besides the root and at most `depth` levels below it that maximizes
    F = sum_v f(v) (module docstring), for acceptance by rank p = (p_1, ..., p_K): (shape, F).

    shape: node j (1-based, the root is 0) is shape[j - 1] = (its parent's index, its rank, 0-based); a parent
    comes before its children and siblings follow their ranks. Example: p = (0.6, 0.2), n = 3, depth = 2 ->
    ((0, 0), (0, 1), (1, 0)): the root's two children and the first one's first child, F = 0.6 + 0.2 + 0.36.
    Memoized on (p rounded to 4 decimals, n, depth). A node of value 0 is never placed unless a later rank
    needs it."""
    key = tuple(round(min(max(float(x), 0.0), 1.0), 4) for x in p)
    return _best_tree(key, max(int(n), 0), max(int(depth), 0))


@functools.lru_cache(maxsize=256)
def _best_tree(p: tuple[float, ...], n: int, depth: int) -> tuple[Shape, float]:
    if n == 0 or depth == 0 or not any(p):
        return (), 0.0
    if all(a >= b for a, b in zip(p, p[1:])):
        return _best_first(p, n, depth)
    cap = max(64, 1 << (n - 1).bit_length())         # one table answers every n <= cap
    c, choice = _tables(p, cap, depth)
    return _shape(choice, n, depth), float(c[depth, n + 1] - 1.0)


def _best_first(p: tuple[float, ...], n: int, depth: int) -> tuple[Shape, float]:
    """Non-increasing p: f falls from a node to its first child and to its next sibling, so the n largest f
    (within the depth bound) form a valid tree, and no tree of n nodes does better; best first finds them."""
    heap = [(-p[0], 0, 1.0, 0, 0, 1)]       # (-f, order, f(parent), parent (in `picked`, 0 = root), rank, depth)
    picked: list[tuple[int, int, float]] = []       # (parent, rank, f), a parent before its children
    order = 0
    while heap and len(picked) < n:
        neg_f, _, f_parent, parent, rank, level = heapq.heappop(heap)
        if -neg_f <= 1e-12:
            break
        picked.append((parent, rank, -neg_f))
        if rank + 1 < len(p):                       # its next sibling
            order += 1
            heapq.heappush(heap, (-f_parent * p[rank + 1], order, f_parent, parent, rank + 1, level))
        if level < depth:                           # its first child
            order += 1
            heapq.heappush(heap, (neg_f * p[0], order, -neg_f, len(picked), 0, level + 1))
    children: dict[int, list[int]] = {}
    for j, (parent, _, _) in enumerate(picked, start=1):
        children.setdefault(parent, []).append(j)
    shape, index, queue = [], {0: 0}, deque([0])
    while queue:                                     # breadth first, siblings by rank
        u = queue.popleft()
        for j in sorted(children.get(u, []), key=lambda j: picked[j - 1][1]):
            shape.append((index[u], picked[j - 1][1]))
            index[j] = len(shape)
            queue.append(j)
    return tuple(shape), float(sum(f for _, _, f in picked))


@functools.lru_cache(maxsize=8)
def _tables(p: tuple[float, ...], n: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """The DP of the module docstring: c (depth + 1, n + 2), c[l, m] = c(m, l) with c[l, 0] = 0, and choice
    (depth + 1, K, n + 1): choice[l, i, s] = the size t of the rank-i child's subtree behind D_l(s, i) (0: no
    child of rank i or later). Entries for s <= n' are those of a smaller table of size n' (D is "at most")."""
    K, q = len(p), np.asarray(p, dtype=np.float32)
    c = np.ones((depth + 1, n + 2), dtype=np.float32)   # c(m, 0) = 1 for m >= 1
    c[:, 0] = 0.0
    choice = np.zeros((depth + 1, K, n + 1), dtype=np.int32)
    neg = np.full(n + 1, -np.inf, dtype=np.float32)
    gain = np.empty((n + 1, n), dtype=np.float32)       # float32: half the bytes of the (n + 1, n) sweeps
    for level in range(1, depth + 1):
        below = c[level - 1, 1:n + 1]                # c(t, l - 1) for t = 1..n, (n,)
        D = np.zeros(n + 1, dtype=np.float32)        # D_l(s, K + 1) = 0, (n + 1,)
        for i in range(K - 1, -1, -1):
            # gain[s, t - 1] = p_i c(t, l - 1) + D_l(s - t, i + 1) for 1 <= t <= s, -inf for t > s.
            # D[s - t] = padded[n - s + t] with padded[k] = D[n - k] (k <= n) and -inf beyond.
            padded = np.concatenate([D[::-1], neg])                          # (2n + 2,)
            window = np.lib.stride_tricks.sliding_window_view(padded, n)     # window[a, j] = padded[a + j]
            np.add(window[n + 1:0:-1], q[i] * below, out=gain)               # (n + 1, n): row s uses a = n + 1 - s
            best_t = gain.argmax(axis=1)                                     # (n + 1,)
            best = gain[np.arange(n + 1), best_t]
            place = best > 1e-12
            choice[level, i] = np.where(place, best_t + 1, 0)
            D = np.where(place, best, np.float32(0.0))
        c[level, 1:] = 1.0 + D                       # c(m, l) = 1 + D_l(m - 1, 1), m = 1..n + 1
        if np.array_equal(c[level], c[level - 1]):   # the depth bound no longer binds: deeper levels repeat
            c[level + 1:], choice[level + 1:] = c[level], choice[level]
            break
    return c, choice


def _shape(choice: np.ndarray, n: int, depth: int) -> Shape:
    """The tree behind c(n + 1, depth), breadth first, from the choice table."""
    shape: list[tuple[int, int]] = []
    queue = deque([(0, n + 1, depth)])               # (node index, its size bound, levels below it)
    while queue:
        node, m, level = queue.popleft()
        s = m - 1
        for i in range(choice.shape[1]):
            t = int(choice[level, i, s]) if level > 0 else 0
            if t == 0:
                break
            shape.append((node, i))
            queue.append((len(shape), t, level - 1))
            s -= t
    return tuple(shape)


# ---------------------------------------------------------------------------------------------------------
@dataclass
class RankCounts:
    """Observations by rank (module docstring): tried (K,) and hits (K,), float64 counts."""
    tried: np.ndarray
    hits: np.ndarray

    @classmethod
    def zeros(cls, K: int) -> "RankCounts":
        return cls(np.zeros(K), np.zeros(K))

    @property
    def observations(self) -> int:
        """Judged nodes: each tried its first child."""
        return int(self.tried[0]) if len(self.tried) else 0

    def resized(self, K: int) -> "RankCounts":
        """The first K ranks (zeros past the ones counted)."""
        out = RankCounts.zeros(K)
        k = min(K, len(self.tried))
        out.tried[:k], out.hits[:k] = self.tried[:k], self.hits[:k]
        return out

    def __add__(self, other: "RankCounts") -> "RankCounts":
        """The sum over the longer of the two rank ranges."""
        K = max(len(self.tried), len(other.tried))
        a, b = self.resized(K), other.resized(K)
        return RankCounts(a.tried + b.tried, a.hits + b.hits)

    def __sub__(self, other: "RankCounts") -> "RankCounts":
        return self + RankCounts(-other.tried, -other.hits)

    def at_most(self, n: int) -> "RankCounts":
        """These counts scaled to at most n observations (hazards kept), e.g. another mode's as a prior."""
        scale = min(1.0, n / self.observations) if self.observations else 1.0
        return RankCounts(self.tried * scale, self.hits * scale)

    def vector(self) -> tuple[float, ...]:
        """p (K,): p_i = h_i prod_{j<i} (1 - h_j), h_i the hazard shrunk toward HAZARD_PRIOR."""
        prior = np.full(len(self.tried), HAZARD_PRIOR[1])
        prior[:1] = HAZARD_PRIOR[0]
        h = (self.hits + PRIOR_WEIGHT * prior) / (self.tried + PRIOR_WEIGHT)
        survive = np.concatenate([[1.0], np.cumprod(1.0 - h)[:-1]])
        return tuple(float(x) for x in h * survive)

    def to_dict(self) -> dict:
        """{"tried": [...], "hits": [...]} up to the last rank ever tried."""
        K = int((self.tried > 0).nonzero()[0].max(initial=-1)) + 1
        return {"tried": [float(x) for x in self.tried[:K]], "hits": [float(x) for x in self.hits[:K]]}

    @classmethod
    def from_dict(cls, d: dict) -> "RankCounts":
        tried, hits = np.asarray(d["tried"], dtype=np.float64), np.asarray(d["hits"], dtype=np.float64)
        if tried.shape != hits.shape or tried.ndim != 1 or (hits > tried).any() or (hits < 0).any():
            raise ValueError("rank counts: tried and hits must be equal-length lists with 0 <= hits <= tried")
        return cls(tried, hits)


def observe_ranks(tree, judged: dict[int, Optional[int]], K: int) -> RankCounts:
    """One verified tree -> its observations by rank. judged: calibrate.judged_greedy / judged_path (for each
    node whose children were judged, the child accepted there, or None). Only drawn children count (n-gram
    nodes have no rank); a node's drawn children are its ranks 0, 1, ... in order."""
    counts = RankCounts.zeros(K)
    for u, accepted in judged.items():
        kids = [c for c in tree.children(u) if tree.ngram_match(c) == 0][:K]
        for i, c in enumerate(kids):
            counts.tried[i] += 1
            if c == accepted:
                counts.hits[i] += 1
                break
    return counts


class RankLearner:
    """One row's acceptance-by-rank vector: the engine's starting counts plus what the row observes, unless
    frozen. Each observation is also handed to `share` (the engine's pair cache, saved at close). The vector is
    recomputed only when the row's observations have doubled since the last one, so the shapes it asks for
    repeat and best_tree's memo answers them."""

    def __init__(self, start: RankCounts, K: int, frozen: bool = False,
                 share: Optional[Callable[[RankCounts], None]] = None):
        self.counts = start.resized(K)
        self.K, self.frozen, self.share = K, frozen, share
        self._vector: Optional[tuple[float, ...]] = None
        self._at = 0

    def vector(self) -> tuple[float, ...]:
        n = self.counts.observations
        if self._vector is None or n >= max(2 * self._at, self._at + 4):
            self._vector, self._at = self.counts.vector(), n
        return self._vector

    def observe(self, tree, judged: dict[int, Optional[int]]) -> RankCounts:
        """Count one verified tree (unless frozen); returns its observations."""
        new = observe_ranks(tree, judged, self.K)
        if not self.frozen:
            self.counts = self.counts + new
            if self.share is not None:
                self.share(new)
        return new


def grow_shape(g, shape: Shape, p: Sequence[float]) -> Generator:
    """Grow `shape` (best_tree's for the vector p) with the round's candidates g (candidates.Candidates): depth by
    depth, ONE draft call over the nodes that have children in the shape, each asked for the most children any of
    them has (a node's children are then a prefix of its candidates, and whether its k-th child exists is fixed
    before anything is drawn). A missing candidate (probability 0) leaves its place, and its subtree, empty.
    Returns g's final tree.
    A node's value is f(v), the model that chose the shape (its estimate p_rank(v)), not the draft's
    probability: the tree's values sum to best_tree's F, and the auto budget prices the tree by them."""
    kids: list[list[int]] = [[] for _ in range(len(shape) + 1)]
    for j, (parent, _) in enumerate(shape, start=1):
        kids[parent].append(j)
    grown = {0: 0}                                   # shape node -> growth id
    level = [0]
    while level:
        parents = [j for j in level if kids[j]]
        if not parents:
            break
        yield from g.expand([grown[j] for j in parents], max(len(kids[j]) for j in parents))
        level = []
        for j in parents:
            u = grown[j]
            for rank, child in enumerate(kids[j][: g.n_options(u)]):
                grown[child] = g.add(u, rank, estimate=p[rank])
                level.append(child)
    return g.finish(list(range(len(g.token))))
