"""The candidates of one round's token tree: every node drafted so far with its value and key, and the working
tree that the draft requests carry.

    g = Candidates(root_token, root_dist, sampling, generator, capacity, ...)
    yield from g.expand(nodes, k)     the first k candidate children of each node, with ONE draft call
    g.add(node, i) -> id              node's i-th candidate joins;   g.drop(node): it left the tree
    g.finish(keep) -> TokenTree       the kept nodes, with the n-gram chains grafted on

The growth policies (grow.py, sequoia.grow_shape) decide which candidates join; this module keeps them. Terms
(node value v, slot value w, estimate a, n-gram node) are grow.py's docstring.

A draft request (tree, frontier), answered with (F, V): `tree` is the WORKING tree: the root plus every node
sent to the draft so far that is still in the running (so at most B + 1 nodes, and the draft's KV cache needs
room for at most B tree tokens). `frontier` (F,) holds the working-tree indices of the nodes to run the draft on
now; their ancestors are all in the working tree and were in earlier calls (or are the root, which the
caller has already run to get root_dist). The returned rows are the draft's processed distributions at
those nodes, i.e. the distributions of their children. Nodes that cannot get a child are never sent.
Adaptive dyspec drops nodes that later fall out of the best B and REUSES their indices for new nodes: a
node's KV written at its index stays valid while the node is live, an ancestor may have a larger index than
its descendant, so read mask rows over all N columns; a dropped node has no live descendants, so no live
mask row points at it. The returned TokenTree is a separate, final tree (only the nodes that made it, in
the order they joined); its `origin` maps each node back to its working-tree index (-1: never sent), so the
draft's KV of final node n is where working node origin[n] was written.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Generator, Optional, Sequence

import torch

from offspec.config import SamplingConfig
from offspec.spec.calibrate import UNCALIBRATED_NGRAM, Calibration
from offspec.spec.ngram import NgramChain
from offspec.spec.sampling import draw_without_replacement
from offspec.spec.tree import TokenTree

DraftRequest = tuple[TokenTree, torch.Tensor]                   # what a growth yields: (working tree, frontier (F,))


@dataclass
class Options:
    """A node's candidate children, in the order verification will try them."""
    tokens: list[int]          # T=0: the top tokens by p; T>0: the without-replacement draw sequence
    probs: list[float]         # p(x_i) under the node's own (not renormalized) draft distribution
    mass_before: list[float]   # sum_{j<i} p(x_j), so R_i = 1 - mass_before[i]
    estimates: list[float]     # a(x_i): p(x_i), or its calibrated acceptance estimate


class Candidates:
    """Candidates of one round, identified by id (0 = root; ids grow as nodes are added, so a parent's id is
    below its children's and siblings' ids follow their draw order), plus the working tree its draft requests carry."""

    def __init__(self, root_token: int, root_dist: torch.Tensor, sampling: SamplingConfig,
                 generator: torch.Generator, capacity: int, calibration: Optional[Calibration] = None,
                 ngram: Sequence[NgramChain] = (), budget: int = 0, max_depth: int = 0):
        self.greedy = sampling.greedy
        self.generator = generator
        self.root_dist = root_dist
        self.calibration = calibration
        self.ngram, self.budget, self.max_depth = ngram, budget, max_depth
        self.token = [int(root_token)]
        self.parent = [-1]
        self.depth = [0]
        self.value = [1.0]
        self.key = [math.inf]                            # the key each node joined on (slot_key; n-gram: value)
        self.prob = [math.nan]                           # p(x) at the parent (nan: an n-gram node)
        self.estimate = [1.0]                            # a(x)
        self.match = [0]                                 # n-gram match length, 0 = a draft node
        self.work = [0]                                  # working-tree index, -1 until sent to the draft
        self.free: list[int] = []                        # working-tree indices of dropped nodes, to reuse
        self.options: dict[int, Options] = {}            # for expanded candidates
        self.dist: dict[int, torch.Tensor] = {}          # T > 0: (V,) draft distribution of expanded candidates
        self.work_tree = TokenTree(root_token, capacity=capacity)   # what the draft requests carry; never over B + 1

    def expand(self, nodes: list[int], k: int) -> Generator[DraftRequest, torch.Tensor, None]:
        """Compute the first k candidate children of each node: the root's from root_dist, the others' with
        ONE draft call over all of them (yielded as a request; the answer is sent back)."""
        if not nodes:
            return
        if nodes == [0]:
            dists = self.root_dist.unsqueeze(0)                                          # (1, V)
        else:
            assert 0 not in nodes, "the root is expanded on its own"
            for c in nodes:
                parent = self.work[self.parent[c]]
                if self.free:
                    self.work[c] = heapq.heappop(self.free)
                    self.work_tree._reuse(self.work[c], parent, self.token[c], self.value[c])
                else:
                    self.work[c] = self.work_tree.add(parent, self.token[c], self.value[c])
            frontier = torch.tensor([self.work[c] for c in nodes], dtype=torch.long)    # (F,)
            dists = yield self.work_tree, frontier                                       # (F, V)
            self.work_tree.n_draft_calls += 1
            if dists.shape[0] != len(nodes):
                raise ValueError(f"the draft answered {dists.shape[0]} rows for {len(nodes)} frontier nodes")
        k = min(k, dists.shape[-1])
        # Candidates of probability 0 are dropped below (never proposed: at T > 0 the row ran out of tokens).
        if self.greedy:
            top = torch.topk(dists, k, dim=-1)                                           # (F, k) each
            tokens, probs = top.indices, top.values
        else:
            tokens, _ = draw_without_replacement(dists, k, self.generator)              # (F, k)
            probs = dists.gather(-1, tokens)                                             # (F, k)
        if self.calibration is None:
            estimates = probs
        else:
            child_depth = torch.tensor([self.depth[c] + 1 for c in nodes]).unsqueeze(1)   # (F, 1)
            estimates = self.calibration.draft(probs, child_depth)                       # (F, k)
        for f, (c, toks, ps, es) in enumerate(zip(nodes, tokens.tolist(), probs.tolist(), estimates.tolist())):
            kept = [(t, p, e) for t, p, e in zip(toks, ps, es) if p > 0.0]
            mass, before = 0.0, []
            for _, p, _ in kept:
                before.append(mass)
                mass += p
            self.options[c] = Options([t for t, _, _ in kept], [p for _, p, _ in kept], before,
                                      [e for _, _, e in kept])
            if not self.greedy:
                self.dist[c] = dists[f]

    def drop(self, node: int) -> None:
        """`node` left the tree (it has no descendants left in it): its working index can be reused."""
        if self.work[node] > 0:
            self.work_tree._detach(self.work[node])
            heapq.heappush(self.free, self.work[node])
            self.work[node] = -1

    def n_options(self, node: int) -> int:
        opts = self.options.get(node)
        return 0 if opts is None else len(opts.tokens)

    def slot_key(self, node: int, i: int) -> float:
        """The value that decides whether `node`'s i-th candidate joins (grow.py's docstring)."""
        opts = self.options[node]
        if self.greedy:
            return self.value[node] * opts.estimates[i]             # v(x_i) = v(u) a(x_i)
        return self.value[node] * max(0.0, 1.0 - opts.mass_before[i])   # w(u, i) = v(u) R_i

    def add(self, node: int, i: int, estimate: Optional[float] = None) -> int:
        """Make `node`'s i-th candidate a node of the tree; returns its id. estimate: its a(x) when the caller's
        model of acceptance is not the draft's (Sequoia's p_i by rank, sequoia.grow_shape); it joins on no key."""
        opts = self.options[node]
        key = self.slot_key(node, i)
        if estimate is not None:
            return self._new(node, opts.tokens[i], self.value[node] * estimate, key, opts.probs[i], estimate, 0)
        value = self.value[node] * opts.estimates[i]                # v(x_i) = v(u) a(x_i)
        if not self.greedy:
            # v(x_i) <= w(u, i) holds exactly for a = p (p(x_i) <= R_i), but R_i is computed from float32
            # probabilities that may sum past 1, and a calibrated a(x_i) may exceed R_i; the min keeps every
            # node ranked below its parent so trees stay closed.
            value = min(value, key)
        return self._new(node, opts.tokens[i], value, key, opts.probs[i], opts.estimates[i], 0)

    def _new(self, parent: int, token: int, value: float, key: float, prob: float, estimate: float,
             match: int) -> int:
        self.token.append(token)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.value.append(value)
        self.key.append(key)
        self.prob.append(prob)
        self.estimate.append(estimate)
        self.match.append(match)
        self.work.append(-1)
        return len(self.token) - 1

    def graft_ngrams(self, keep: list[int]) -> list[int]:
        """Add the n-gram chains to the kept nodes, then keep the B best keys of both (grow.py's docstring,
        "n-gram node"). A chain follows a node that already has its token: at T = 0 any kept node, at T > 0 only
        an n-gram node, and a kept n-gram node with a kept drawn twin is folded into that twin afterwards.
        Example (T = 0): kept root -> a -> b and the chain (a, c): the chain follows a and adds c under it.
        Example (T > 0): the same tree; the chain adds its own a' and c' under it; if the B best keep a, a' and c',
        a' is folded into a, so the tree is root -> a -> (b, c')."""
        if not self.ngram or self.budget < 1:
            return keep
        children: dict[int, list[int]] = {}
        for c in sorted(keep)[1:]:
            children.setdefault(self.parent[c], []).append(c)
        grafted = []
        for chain in self.ngram:
            u = 0
            for token in chain.tokens:
                if self.depth[u] >= self.max_depth:
                    break
                same = next((c for c in children.get(u, [])
                             if self.token[c] == token and (self.greedy or self.match[c] > 0)), None)
                if same is None:
                    estimate = (self.calibration.ngram(self.depth[u] + 1, chain.match)
                                if self.calibration is not None else UNCALIBRATED_NGRAM)
                    value = self.value[u] * estimate
                    if value <= 0.0:
                        break
                    same = self._new(u, int(token), value, value, math.nan, estimate, chain.match)
                    children.setdefault(u, []).append(same)
                    grafted.append(same)
                u = same
        # Every node's key is at most its parent's and a child's id is above its parent's (n-gram nodes come
        # last), so the B first by (key desc, id asc) are closed under parents.
        best = sorted([*keep[1:], *grafted], key=lambda n: (-self.key[n], n))[: self.budget]
        chosen = set(best)
        assert all(self.parent[n] == 0 or self.parent[n] in chosen for n in best), "grafted tree not closed"
        return [0, *self._fold_twins(best)]

    def _fold_twins(self, best: list[int]) -> list[int]:
        """Drop each chosen n-gram node whose parent has a chosen drawn child with its token (its twin; only at
        T > 0, since at T = 0 the chains followed their twins during the cut),
        moving the n-gram node's chosen children under the twin; the freed places stay empty. Only n-gram nodes
        leave, after the cut, so no drawn node's presence depends on a draw (grow.py's docstring)."""
        drawn = {(self.parent[n], self.token[n]): n for n in best if self.match[n] == 0}
        folded: set[int] = set()
        for n in sorted(best):                   # parents first, so a moved node is checked under its new parent
            if self.match[n] == 0:
                continue
            twin = drawn.get((self.parent[n], self.token[n]))
            if twin is not None:
                folded.add(n)
                for c in best:
                    if self.parent[c] == n:
                        self.parent[c] = twin
            else:
                self.value[n] = self.value[self.parent[n]] * self.estimate[n]   # v(x) = v(u) a(x) under its parent
        return [n for n in best if n not in folded]

    def finish(self, keep: list[int]) -> TokenTree:
        """The final tree of the kept candidates (root included, closed under parents) with the n-gram chains
        grafted on, in id order."""
        keep = sorted(self.graft_ngrams(keep))
        tree = TokenTree(self.token[0], capacity=len(keep))
        index = {0: 0}
        for c in keep[1:]:
            index[c] = tree.add(index[self.parent[c]], self.token[c], self.value[c], draft_prob=self.prob[c],
                                estimate=self.estimate[c], ngram_match=self.match[c])
        tree._origin = [self.work[c] for c in keep]
        tree.n_draft_calls = self.work_tree.n_draft_calls
        if not self.greedy:
            for c in keep:
                if c in self.dist and any(tree.ngram_match(k) == 0 for k in tree.children(index[c])):
                    tree.set_dist(index[c], self.dist[c])
        return tree
