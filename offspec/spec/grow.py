"""Tree growth: the resident draft proposes a token tree for one round, under a node budget.

    grow_steps(tree_cfg, sampling, root_token, root_dist, budget, generator)  -> a generator of draft requests

The growth is written as a generator: it yields each draft call it needs, a draft request (working tree,
frontier), is sent back the (F, V) distributions, and returns the TokenTree. So many trees can grow in
lockstep and share one batched draft call per depth (generate.Engine does this for every row in flight).

Terms (DySpec, Xiong et al. 2024; p is the draft's processed distribution, q the target's):
  node value  v(x): the estimated probability that verification reaches node x AND accepts it. DySpec's
              hypothesis: a drafted token is accepted about as often as the draft probability it had when it
              was drawn. Let node u have children x_1, x_2, ... drawn in that order WITHOUT replacement from
              p = p(. | path to u), and let  R_i = 1 - sum_{j<i} p(x_j)  be the draft mass not yet drawn.
              Verification tries x_1, x_2, ... in turn, so x_i is reached when u was accepted and
              x_1 .. x_{i-1} were all rejected, with probability  v(u) * R_i  (the rejection chances
              (1 - p(x_j) / R_j) telescope to R_i); once reached, x_i is accepted with the probability it was
              drawn with,  p_i(x_i) = p(x_i) / R_i  (p with the earlier siblings removed, renormalized). So
                  v(root) = 1,    v(x_i) = v(u) * R_i * p_i(x_i) = v(u) * p(x_i),
              the product of draft probabilities along the path. Values never increase along a path.
  slot value  w(u, i) = v(u) * R_i: the chance that the i-th child of u is reached at all. It is known
              BEFORE x_i is drawn, and it decreases with i.
  threshold C DySpec Algorithm 2: a candidate joins the tree when its value is >= C.
  budget B    the most nodes a tree may have, root not counted.
  estimate    a(x), the chance the target accepts x once it accepted x's parent: p(x) above (DySpec's
              hypothesis), or with a Calibration (calibrate.py) the acceptance rate observed so far for draft
              nodes of x's depth and probability, or in Sequoia's tree (sequoia.grow_shape) p_i, the measured
              acceptance of x's rank. Then v(x) = v(u) * a(x). A calibration is non-decreasing in p and at most
              1, so values still fall along paths and siblings keep the draft's order.
  n-gram node a continuation the sequence already contains (ngram.py), grafted onto the grown tree after
              growth at no draft call: v = v(u) * (its own calibrated estimate), its key. Where the tree already
              has the chain's token, the chain follows that node (at T > 0 only an n-gram node: see below). The
              grown nodes and the n-gram nodes then share the budget: the B best keys of both stay (every node
              ranks below its parent, so the rest is a tree).

Which value decides whether a candidate joins:
  T = 0  candidates are the draft's top tokens, ranked by p, known before anything is drawn: a candidate
         joins on its node value v(x_i) = v(u) * p(x_i).
  T > 0  a candidate joins on its slot value w(u, i) = v(u) * R_i, decided before x_i is drawn. Deciding on the drawn
         token itself would bias verification: with p = (0.9, 0.1), q = (0.5, 0.5) and a rule "propose x only
         if p(x) > 0.5", token 0 comes out with probability 0.9 * 0.5/0.9 + 0.1 * 0.5 = 0.55, not 0.5.
         Multi-candidate speculative sampling is lossless exactly when each node's children are the first k
         draws of a without-replacement sequence and whether there is a k-th child depends only on what was
         drawn before it. Every policy here keeps that: a node's children are a prefix of its draw order, and
         every join decision compares keys of candidates that rank ABOVE the one being decided (a node's own
         descendants and later siblings always rank below it), never the candidate's own token.
         An n-gram node is a deterministic candidate, tried after every drawn sibling (accept.py), so ITS
         presence may depend on their draws; a drawn node's presence must not depend on its own, and so neither
         may the cut to the B best keys. So at T > 0 a chain follows only n-gram nodes while the cut is made: its
         nodes' keys are fixed before anything is drawn (by the committed sequence and the calibration), and
         the cut still decides each drawn node by keys that rank above it. After the cut an n-gram node whose
         drawn twin (same parent, same token) made it too is dropped, its chosen children moved under the twin
         (`_fold_twins`): the twin, once rejected, leaves its token no mass, so the copy could never be
         accepted, while the chain's continuation under the twin can be. Only n-gram nodes leave then; their
         places stay empty. (Following a drawn twin during the cut, as at T = 0, would let a chain node push
         out a later drawn sibling exactly when that sibling did not draw the chain's token.)

What a draft request carries (the working tree, its frontier) and how a dropped node's KV place is reused:
candidates.py, which keeps the candidates; the policies below decide which of them join.

Draft calls per round (root_dist is the caller's, not counted; recorded as tree.n_draft_calls):
  dyspec   one per depth, over the whole frontier (<= max_depth - 1)
  static   one per depth (<= len(static_widths) - 1)
  sequoia  one per depth of its fixed shape (sequoia.py: Sequoia's DP over the measured acceptance by rank)
  chain    one per token after the first (budget - 1, capped by max_depth - 1)
  heap     one per "wave": best-first pops until the best candidate belongs to a node not yet run; then every
           such node that could still place a child (fewer real candidates than the remaining budget rank
           above its value) is run together. At least one per depth, at most one per node: at T = 0 it is
           close to one per node (a new node's value tops the queue at once), at T > 0 waves batch more.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import replace
from typing import Generator, Optional, Sequence

import torch

from offspec.config import SamplingConfig, TreeConfig
from offspec.spec.calibrate import Calibration
from offspec.spec.candidates import Candidates, DraftRequest
from offspec.spec.ngram import NgramChain
from offspec.spec.sequoia import AUTO, RankCounts, best_tree, grow_shape
from offspec.spec.tree import TokenTree

Growth = Generator[DraftRequest, torch.Tensor, TokenTree]       # yields requests, is sent (F, V), returns the tree

POLICIES = ("dyspec", "heap", "chain", "static", "sequoia", "none")


def grow_steps(tree_cfg: TreeConfig, sampling: SamplingConfig, root_token: int, root_dist: torch.Tensor,
               budget: int, generator: torch.Generator, expand_floor: float = 0.0, *,
               calibration: Optional[Calibration] = None, ngram: Sequence[NgramChain] = (),
               rank_acceptance: Optional[Sequence[float]] = None) -> Growth:
    """Grow one round's token tree with at most `budget` nodes besides the root, as a generator of draft calls.

    root_dist (V,): the draft's processed distribution at the root (process_logits of its logits there).
    generator: drives the without-replacement draws at T > 0 (unused at T = 0).
    expand_floor: dyspec runs the draft only on nodes whose value reaches it (the caller passes the previous
    round's C; see _grow_dyspec). 0 = every node that could still place a child.
    calibration: the estimates a(x) of draft and n-gram nodes (None: a = p, and NGRAM_PRIOR for n-gram nodes).
    ngram: the chains to graft onto the grown tree (ngram.lookup of the sequence ending with root_token).
    rank_acceptance: sequoia's p by rank (sequoia.RankCounts.vector; None: the prior's). Sequoia grafts no n-grams.
    """
    if tree_cfg.policy == AUTO:
        raise ValueError(f"tree policy {AUTO!r} is resolved by the engine (chosen_policy) before a tree grows")
    if tree_cfg.policy not in POLICIES:
        raise ValueError(f"unknown tree policy {tree_cfg.policy!r}; expected one of {', '.join(POLICIES)}")
    if budget < 0:
        raise ValueError(f"tree budget must be >= 0, got {budget}")
    tree_cfg = replace(tree_cfg, max_depth=tree_cfg.depth_bound())
    g = Candidates(root_token, root_dist, sampling, generator, capacity=budget + 1, calibration=calibration,
                   ngram=ngram, budget=budget, max_depth=tree_cfg.max_depth)
    if budget == 0 or tree_cfg.policy == "none" or tree_cfg.max_depth < 1:
        g.ngram = ()
        return g.finish([0])
    if tree_cfg.policy == "dyspec":
        return (yield from _grow_dyspec(tree_cfg, g, budget, expand_floor))
    if tree_cfg.policy == "heap":
        return (yield from _grow_heap(tree_cfg, g, budget))
    if tree_cfg.policy == "chain":
        return (yield from _grow_chain(tree_cfg, g, budget))
    if tree_cfg.policy == "sequoia":
        g.ngram = ()
        p = rank_acceptance if rank_acceptance is not None else RankCounts.zeros(tree_cfg.branching).vector()
        return (yield from grow_shape(g, best_tree(p, budget, tree_cfg.max_depth)[0], p))
    return (yield from _grow_static(tree_cfg, g, budget))




class _Ranking:
    """The nodes currently in the tree, ranked by (key desc, id asc), and the join rule.

    Fixed C: a candidate joins if its key >= C while fewer than B nodes are in (DySpec: stop at the budget).
    Adaptive (C is None): a candidate joins if it would rank among the best B, i.e. the tree is not full or
    its key beats the B-th best key so far (strictly: a newcomer has the highest id, so it loses ties); the
    node that falls out is evicted. The lowest-ranked node never has a descendant in the tree (descendants
    rank below their ancestors) nor a later sibling in it (later siblings rank below earlier ones), so the
    tree stays closed under parents and every node's children stay a prefix of its draw order.
    """

    def __init__(self, budget: int, threshold: float | None):
        self.budget = budget
        self.threshold = threshold
        self.lowest: list[tuple[float, int]] = []     # min-heap of (key, -id): the top is the lowest-ranked
        self.alive: set[int] = set()

    def admits(self, key: float) -> bool:
        if key <= 0.0:
            return False
        if self.threshold is not None:
            return key >= self.threshold and len(self.alive) < self.budget
        return len(self.alive) < self.budget or key > self.lowest[0][0]

    def add(self, node: int, key: float) -> int | None:
        """Rank `node` in; returns the node evicted to make room, if any."""
        heapq.heappush(self.lowest, (key, -node))
        self.alive.add(node)
        if len(self.alive) <= self.budget:
            return None
        _, neg = heapq.heappop(self.lowest)
        self.alive.discard(-neg)
        return -neg


def _grow_dyspec(cfg: TreeConfig, g: Candidates, budget: int, expand_floor: float = 0.0) -> Growth:
    """DySpec Algorithm 2, level by level: at each depth every frontier candidate whose value reaches C joins
    (best first, so that the budget, when it binds, keeps the best); the next frontier is the new nodes that
    could still place a child. Adaptive C (threshold None): C is the B-th best value seen so far, so at T = 0
    the result is exactly the B highest-value nodes among all candidates explored.

    Adaptive C starts at 0, so the first levels admit every candidate and the frontier runs wide (tens of
    rows) before deeper, likelier nodes push those out again. A draft call on a CPU costs about its row
    count, so the caller may pass last round's final C as `expand_floor`: only nodes at least that likely
    are run. It only decides which nodes get children, from their own values, so it keeps losslessness."""
    ranking = _Ranking(budget, cfg.threshold)
    yield from g.expand([0], cfg.branching)
    frontier = [0]
    for level in range(cfg.max_depth):
        slots = [(-g.slot_key(u, 0), u, 0) for u in frontier if g.n_options(u) > 0]     # max-heap by key
        heapq.heapify(slots)
        new = []
        while slots:
            neg_key, u, i = heapq.heappop(slots)
            if not ranking.admits(-neg_key):
                break          # keys only fall from here on (per node by i, and the heap pops the largest)
            n = g.add(u, i)
            evicted = ranking.add(n, -neg_key)
            if evicted is not None:
                g.drop(evicted)
            new.append(n)
            if i + 1 < g.n_options(u):
                heapq.heappush(slots, (-g.slot_key(u, i + 1), u, i + 1))
        if level + 1 == cfg.max_depth:
            break
        # A child's key is at most its parent's value (exactly equal for the first draw at T > 0), so only
        # nodes whose own value would be admitted can place a child: the rest are not worth a draft call.
        frontier = [n for n in new if n in ranking.alive and ranking.admits(g.value[n]) and g.value[n] >= expand_floor]
        if not frontier:
            break
        yield from g.expand(frontier, cfg.branching)
    return g.finish([0, *ranking.alive])


def _grow_heap(cfg: TreeConfig, g: Candidates, budget: int) -> Growth:
    """DySpec Algorithm 1: best first with a fixed size. Pop the highest-key candidate anywhere in the tree,
    add it, and offer its first child and its next sibling; stop after B nodes.

    A node not yet run through the draft sits in the queue with its own value, an upper bound on any child's
    key. When such an entry reaches the top, the draft is run on every unexpanded node that could still
    place a child before the budget runs out, in one call."""
    SLOT, PENDING = 0, 1
    queue: list[tuple[float, int, int, int, int]] = []    # (-key, seq, kind, node, i): a max-heap by key
    seq = 0

    def push(key: float, kind: int, node: int, i: int) -> None:
        nonlocal seq
        if key > 0.0:
            heapq.heappush(queue, (-key, seq, kind, node, i))
            seq += 1

    yield from g.expand([0], cfg.branching)
    if g.n_options(0):
        push(g.slot_key(0, 0), SLOT, 0, 0)
    count = 0
    while count < budget and queue:
        neg_key, _, kind, node, i = queue[0]
        if kind == PENDING:
            left, real, wave = budget - count, 0, []
            for _, _, k2, n2, _ in sorted(queue):
                if real >= left:
                    break
                if k2 == SLOT:
                    real += 1
                else:
                    wave.append(n2)
            wave.sort()
            yield from g.expand(wave, cfg.branching)
            waved = set(wave)
            queue = [e for e in queue if not (e[2] == PENDING and e[3] in waved)]
            heapq.heapify(queue)
            for n2 in wave:
                if g.n_options(n2):
                    push(g.slot_key(n2, 0), SLOT, n2, 0)
            continue
        heapq.heappop(queue)
        n = g.add(node, i)
        count += 1
        if i + 1 < g.n_options(node):
            push(g.slot_key(node, i + 1), SLOT, node, i + 1)
        if g.depth[n] < cfg.max_depth:
            push(g.value[n], PENDING, n, 0)
    return g.finish(list(range(len(g.token))))


def _grow_chain(cfg: TreeConfig, g: Candidates, budget: int) -> Growth:
    """Classic speculative decoding: k = budget tokens (at most max_depth), each the draft's top token at
    T = 0 or a draw from p at T > 0."""
    u = 0
    for _ in range(min(budget, cfg.max_depth)):
        yield from g.expand([u], 1)
        if not g.n_options(u):
            break
        u = g.add(u, 0)
    return g.finish(list(range(len(g.token))))


def _grow_static(cfg: TreeConfig, g: Candidates, budget: int) -> Growth:
    """A fixed shape (SpecInfer / Sequoia style): every node at depth d gets static_widths[d] children,
    filled breadth first until the budget runs out."""
    frontier, count = [0], 0
    for width in cfg.static_widths[: cfg.max_depth]:
        if width <= 0 or count >= budget or not frontier:
            break
        # Only the nodes that will get children are run: with `room` places left, the first ceil(room/width).
        frontier = frontier[: math.ceil((budget - count) / width)]
        yield from g.expand(frontier, width)
        new = []
        for u in frontier:
            for i in range(g.n_options(u)):
                if count == budget:
                    break
                new.append(g.add(u, i))
                count += 1
        frontier = new
    return g.finish(list(range(len(g.token))))
