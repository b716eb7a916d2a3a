"""Verification: which of the draft's proposals the target keeps, and the token it adds.

Terms (notation of Leviathan et al. 2023 / SpecInfer / DySpec):
  p          the draft's processed distribution at a node (the one its children were drawn from)
  q          the target's processed distribution at a node, read from the ONE target pass over the tree;
             row u of q (N, V) is the target's next-token distribution after the path root..u
  accepted   the tree nodes (root excluded) on the path the target agrees with, root to leaf; their tokens
             are emitted in order
  bonus      one more token, always emitted after the accepted ones: the target's own choice at the last
             accepted node (or at the root when nothing was accepted). It becomes the next round's root.
  residual   norm(max(q - p, 0)): the part of q that p does not cover. After a proposal is rejected the
             target's remaining choice is distributed as the residual, which is what makes the scheme exact.

Greedy (T = 0): at node u, follow the child whose token is argmax q_u; stop when there is none. The bonus is
argmax at the last accepted node, so the emitted tokens are exactly the target's greedy continuation.

Stochastic (T > 0), multi-candidate speculative sampling with children drawn without replacement: at node u
with children x_1 .. x_k in draw order, p = the draft distribution they were drawn from, q = q_u:
    for x in x_1 .. x_k:
        accept x with probability min(1, q(x) / p(x))   -> move to x and repeat there
        otherwise  q <- norm(max(q - p, 0))               (residual: x no longer possible)
                   p <- p with x removed, renormalized    (the distribution the next sibling was drawn from)
    nothing accepted -> bonus ~ q (the final residual);  u is a leaf -> bonus ~ q_u.
Each step emits x with probability min(p, q)(x) + (mass rejected) * residual(x) = q(x), so by induction on the
siblings and down the tree the emitted tokens have exactly the target's distribution.

Deterministic candidates (n-gram nodes, ngram.py: a continuation read off the sequence, not drawn): their
proposal distribution is a point mass on their token g, so the same rule with p = onehot(g) is exact:
    accept g with probability min(1, q(g) / 1) = q(g)
    otherwise  q <- norm(max(q - onehot(g), 0))  = q with g removed, renormalized;   p is left alone
(g w.p. q(g) + (1 - q(g)) * 0; any y != g w.p. (1 - q(g)) * q(y) / (1 - q(g)) = q(y): exact for any q, so it
composes with the drawn siblings in any order.) Growth puts them after a node's drawn children.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from offspec.spec.sampling import residual, sample
from offspec.spec.tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    nodes: tuple[int, ...]     # accepted tree nodes, root excluded, root to leaf
    tokens: tuple[int, ...]    # their tokens
    bonus: int                 # the target's token after the last accepted node

    @property
    def emitted(self) -> list[int]:
        """Everything this round adds to the sequence: accepted tokens, then the bonus."""
        return [*self.tokens, self.bonus]

    @property
    def path(self) -> list[int]:
        """Root plus accepted nodes: the tree rows whose KV the caches keep."""
        return [0, *self.nodes]


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> Verdict:
    """target_logits (N, V), row u = the target's logits after the path root..u."""
    return follow_argmax(tree, target_logits.argmax(dim=-1).tolist())


def follow_argmax(tree: TokenTree, best: list[int]) -> Verdict:
    """best (N,): the target's argmax token at each node."""
    tokens = tree.tokens.tolist()
    nodes, u = [], 0
    while True:
        x = next((c for c in tree.children(u) if tokens[c] == best[u]), None)
        if x is None:
            return Verdict(tuple(nodes), tuple(tokens[n] for n in nodes), best[u])
        nodes.append(x)
        u = x


def verify_stochastic(tree: TokenTree, q_at: Callable[[int], torch.Tensor], generator: torch.Generator) -> Verdict:
    """q_at(u) -> (V,): the target's processed distribution at node u (process_logits of its logits row).

    Asked only for the nodes verification visits: the root and the accepted path (a tree of a thousand nodes
    needs a handful of rows). Draft distributions come from tree.dist(u). `generator` must live on q's
    device; every call consumes fresh randomness from it.
    """
    tokens = tree.tokens.tolist()
    nodes, u = [], 0
    while True:
        q_u = q_at(u).float()                                                             # (V,)
        children = tree.children(u)
        if not children:
            break
        p = None                                       # (V,) the draft distribution, once a drawn child comes
        r = torch.rand(len(children), generator=generator, device=q_u.device).tolist()   # (k,) uniforms
        accepted = None
        for j, x_node in enumerate(children):
            x = tokens[x_node]
            if tree.ngram_match(x_node) > 0:
                took, q_u = try_deterministic(q_u, x, r[j])
                if took:
                    accepted = x_node
                    break
                continue
            if p is None:
                p = tree.dist(u).float()
            # accept with probability min(1, q(x)/p(x)): r < q(x)/p(x), without the division
            # (p(x) > 0 since x was drawn from p).
            if r[j] * float(p[x]) < float(q_u[x]):
                accepted = x_node
                break
            q_u = residual(q_u, p)
            p = p.clone()
            p[x] = 0.0
            p = p / p.sum()
        if accepted is None:
            break
        nodes.append(accepted)
        u = accepted
    bonus = int(sample(q_u, generator))
    return Verdict(tuple(nodes), tuple(tokens[n] for n in nodes), bonus)


def try_deterministic(q: torch.Tensor, g: int, r: float) -> tuple[bool, torch.Tensor]:
    """A deterministic candidate g against q (V,) with the uniform r: (accepted, q for the next sibling)."""
    if r < float(q[g]):
        return True, q
    point = torch.zeros_like(q)
    point[g] = 1.0
    return False, residual(q, point)
