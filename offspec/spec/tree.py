"""TokenTree: the draft's proposals for one round, as a few tensors.

Node 0 is the ROOT: the last committed token (the previous round's bonus token, or the last prompt token),
not yet in the target's cache. Its children are the depth-1 proposals, their children depth-2, and so on.
Nodes are numbered in the order they were added, so a parent always precedes its children and a node's
children are listed in draw order (the order verification must try them in). (The one exception is the
working tree that growth hands to the draft, which reuses the indices of nodes it dropped; see grow.py.)

Per node (N = number of nodes, root included; the tree's size in budget terms is N - 1):
  tokens   (N,) long      token id
  parents  (N,) long      parent node, -1 for the root
  depths   (N,) long      0 for the root
  values   (N,) float64   DySpec value: estimated probability that the node is reached and accepted (root 1)
  mask     (N, N) bool    ancestor mask: row i is True at i's ancestors and at i itself. Built as the tree
                          grows: a node's row is its parent's row plus its own column.
  origin   (N,) long      where the node sat in the working tree growth sent to the draft (so the
                          draft's KV cache entry of node n is at working index origin[n]); -1 for a node that
                          was never sent to the draft. Identity for a tree built by hand.
  dists    {node: (V,)}   for each node whose children were drawn at T > 0: the draft distribution p they
                          were drawn from (stochastic verification needs it). Empty for greedy trees.
Per node, for acceptance calibration (calibrate.py) and n-gram branches (ngram.py), read one at a time:
  draft_prob(n)   the draft's probability of the node's token at its parent (nan: not proposed by the draft)
  estimate(n)     the conditional acceptance estimate it was grown with (value(n) = value(parent) * estimate(n))
  ngram_match(n)  0 for a draft node; for an n-gram node (a deterministic candidate, never run through the
                  draft), the match length of the chain that proposed it
  n_draft_calls           draft calls growth made for this tree (root excluded), for the step stats.
All tensors but the dists live on the CPU: they are small, built node by node, and read by Python loops;
move `mask`, `tokens` and `positions` to the device once per forward. They are cached: treat them as
read-only.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


class TokenTree:
    def __init__(self, root_token: int, capacity: int = 16):
        # Per-node data is kept in Python lists while the tree grows (appending to a list is ~100x cheaper
        # than writing tensor elements one by one); the tensors are materialized on first read after a
        # change. The mask keeps its built rows, so reading it while growing only computes the new rows.
        self._tok: list[int] = []
        self._par: list[int] = []
        self._dep: list[int] = []
        self._val: list[float] = []
        self._children: list[list[int]] = []
        self._prob: list[float] = []                   # draft probability of the token at its parent
        self._est: list[float] = []                    # conditional acceptance estimate
        self._match: list[int] = []                    # n-gram match length, 0 = a draft node
        self._mask = torch.zeros(max(int(capacity), 1), max(int(capacity), 1), dtype=torch.bool)
        self._mask_rows = 0                            # rows of _mask already built
        self._stale_rows: set[int] = set()             # reused rows to rebuild (growth's working tree only)
        self._cache: dict[str, torch.Tensor] = {}      # tensors of the current n_nodes
        self._origin: Optional[list[int]] = None       # None = identity (this tree is its own working tree)
        self.dists: dict[int, torch.Tensor] = {}
        self.n_draft_calls = 0                         # draft calls made while growing (root excluded)
        self._append(int(root_token), -1, 0, 1.0)

    @classmethod
    def root_only(cls, root_token: int) -> "TokenTree":
        """The empty proposal: verification then just samples (or argmaxes) the target at the root."""
        return cls(root_token, capacity=1)

    # ------------------------------------------------------------ building
    def add(self, parent: int, token: int, value: float, *, draft_prob: float = float("nan"),
            estimate: float = float("nan"), ngram_match: int = 0) -> int:
        """Append a child of `parent` (after its existing children); returns the new node's index."""
        if not 0 <= parent < self.n_nodes:
            raise IndexError(f"parent {parent} is not a node of a {self.n_nodes}-node tree")
        return self._append(int(token), int(parent), self._dep[parent] + 1, float(value), draft_prob, estimate,
                            ngram_match)

    def _append(self, token: int, parent: int, depth: int, value: float, draft_prob: float = float("nan"),
                estimate: float = float("nan"), ngram_match: int = 0) -> int:
        n = len(self._tok)
        self._tok.append(token)
        self._par.append(parent)
        self._dep.append(depth)
        self._val.append(value)
        self._prob.append(float(draft_prob))
        self._est.append(float(estimate))
        self._match.append(int(ngram_match))
        self._children.append([])
        if parent >= 0:
            self._children[parent].append(n)
        self._cache.clear()
        return n

    def _build_mask(self) -> None:
        """Fill the mask rows added (or reused) since the last read: row = parent's row + own column, one
        vectorized step per depth (a row's parent is either already built or one depth up in this batch)."""
        N, start = self.n_nodes, self._mask_rows
        if N > self._mask.shape[0]:
            grown = torch.zeros(2 * N, 2 * N, dtype=torch.bool)
            grown[:start, :start] = self._mask[:start, :start]
            self._mask = grown
        rows = torch.tensor(sorted(set(range(start, N)) | self._stale_rows), dtype=torch.long)   # (R,)
        par = torch.tensor([self._par[r] for r in rows.tolist()], dtype=torch.long)               # (R,)
        dep = torch.tensor([self._dep[r] for r in rows.tolist()], dtype=torch.long)               # (R,)
        for d in torch.unique(dep).tolist():
            at, up = rows[dep == d], par[dep == d]
            self._mask[at, :N] = False
            self._mask[at[up >= 0], :N] = self._mask[up[up >= 0], :N]
            self._mask[at, at] = True               # before the next depth copies these rows
        self._mask_rows = N
        self._stale_rows.clear()

    def _detach(self, node: int) -> None:
        """For growth's working tree only: `node` left the tree (it has no live descendants, so no live mask
        row points at it); its index may be given to a new node with `_reuse`."""
        self._children[self._par[node]].remove(node)

    def _reuse(self, node: int, parent: int, token: int, value: float) -> None:
        """For growth's working tree only: make the detached `node` a new child of `parent`. Reusing indices
        keeps the working tree, and the draft KV slots indexed by it, within the budget."""
        self._tok[node], self._par[node], self._val[node] = token, parent, value
        self._dep[node] = self._dep[parent] + 1
        self._children[node] = []
        self._children[parent].append(node)
        self._stale_rows.add(node)
        self._cache.clear()

    def set_dist(self, node: int, dist: torch.Tensor) -> None:
        """Record the draft distribution (V,) that `node`'s children are drawn from (T > 0)."""
        self.dists[node] = dist

    # ------------------------------------------------------------ reading
    @property
    def n_nodes(self) -> int:
        """N, root included: the rows of every per-node tensor."""
        return len(self._tok)

    @property
    def size(self) -> int:
        """Proposed tokens: nodes minus the root. This is what a budget counts."""
        return self.n_nodes - 1

    @property
    def depth(self) -> int:
        """Deepest level (0 for a root-only tree)."""
        return max(self._dep)

    def _tensor(self, name: str, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = self._cache.get(name)
        if t is None:
            t = self._cache[name] = torch.tensor(data, dtype=dtype)
        return t

    @property
    def tokens(self) -> torch.Tensor:
        return self._tensor("tokens", self._tok, torch.long)                             # (N,)

    @property
    def parents(self) -> torch.Tensor:
        return self._tensor("parents", self._par, torch.long)                            # (N,)

    @property
    def depths(self) -> torch.Tensor:
        return self._tensor("depths", self._dep, torch.long)                             # (N,)

    @property
    def values(self) -> torch.Tensor:
        return self._tensor("values", self._val, torch.float64)                          # (N,)

    @property
    def mask(self) -> torch.Tensor:
        if self._mask_rows < self.n_nodes or self._stale_rows:
            self._build_mask()
        return self._mask[: self.n_nodes, : self.n_nodes]                                 # (N, N)

    @property
    def origin(self) -> torch.Tensor:
        if self._origin is None:
            return torch.arange(self.n_nodes)                                              # (N,)
        return torch.tensor(self._origin, dtype=torch.long)                                # (N,)

    def expanded(self, node: int) -> bool:
        """Was `node` fed to the draft while growing (so the draft's KV cache holds it)? The root always was."""
        return self._origin is None or self._origin[node] >= 0

    def positions(self, prefix_len: int) -> torch.Tensor:
        """RoPE positions (N,) = prefix_len + depth: siblings share a position, as they are alternatives.

        Example: depths [0, 1, 1, 2] after a 7-token prefix -> positions [7, 8, 8, 9].
        (prefix_len counts the committed tokens before the root, so the root sits at position prefix_len.)
        """
        return prefix_len + self.depths

    def children(self, node: int) -> list[int]:
        """Child node indices in draw order."""
        return list(self._children[node])

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root (included) down to `node` (included)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self._par[node]
        return path[::-1]

    def draft_prob(self, node: int) -> float:
        return self._prob[node]

    def estimate(self, node: int) -> float:
        return self._est[node]

    def ngram_match(self, node: int) -> int:
        return self._match[node]

    @property
    def draft_depths(self) -> torch.Tensor:
        """(N,) long: each node's depth, 0 for n-gram nodes (they cost no draft call: the planner's t_draft)."""
        return self.depths.masked_fill(torch.tensor(self._match, dtype=torch.long) > 0, 0)

    def dist(self, node: int) -> torch.Tensor:
        """The draft distribution (V,) that `node`'s children were drawn from."""
        if node not in self.dists:
            raise KeyError(f"node {node} has no draft distribution (greedy tree, or no children drawn)")
        return self.dists[node]

    def draw(self, decode: Optional[Callable[[int], str]] = None) -> str:
        """The tree as indented text, one node a line: `[index] token  v=value`, root first.

            [0] 17  v=1.0000
              [1] 42  v=0.6120
                [3] 7  v=0.3000
              [2] 13  v=0.2010
        With `decode`, each token is also shown as text.
        """
        tokens, values = self._tok, self._val
        lines = []
        stack = [(0, 0)]
        while stack:
            node, level = stack.pop()
            text = f" {decode(tokens[node])!r}" if decode is not None else ""
            lines.append(f"{'  ' * level}[{node}] {tokens[node]}{text}  v={values[node]:.4f}")
            stack.extend((c, level + 1) for c in reversed(self._children[node]))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"TokenTree(size={self.size}, depth={self.depth})"
