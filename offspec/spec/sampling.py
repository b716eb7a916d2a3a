"""Token distributions: temperature / top-k / top-p, residuals, draws, seeded generators.

One function, `process_logits`, turns logits into the distribution a model "samples from"; the SAME function
is applied to draft logits (giving p) and to target logits (giving q), so temperature, top-k and top-p shape
both models identically, which is what makes speculative sampling reproduce the target's processed
distribution exactly.
"""
from __future__ import annotations

import torch

from offspec.config import SamplingConfig

ROW_CHUNK = 64   # rows processed at a time: top-p sorts, and a sort of (R, V) makes several (R, V) temporaries


def process_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits (..., V) -> probabilities (..., V), float32, each row summing to 1.

    Rows are processed ROW_CHUNK at a time, so a draft call over a wide tree level (a thousand rows of a
    150k vocabulary) needs its output and one chunk's temporaries, not gigabytes of them.

    T > 0: softmax(logits / T) restricted to the top-k tokens, then to the nucleus (the smallest set of most
    likely tokens whose mass reaches top_p), renormalized. Same order as transformers: temperature, top-k,
    top-p.
    T = 0 (greedy): plain softmax(logits), no truncation. The emitted token is the argmax either way; the
    probabilities are only used to rank draft candidates during tree growth, and truncating them (or taking
    the T -> 0 one-hot limit) would throw away exactly the runner-up tokens a tree wants to try.
    """
    rows = logits.numel() // max(logits.shape[-1], 1)
    if logits.dim() >= 2 and rows > ROW_CHUNK:
        flat = logits.reshape(rows, logits.shape[-1])                                    # (R, V)
        out = torch.empty(flat.shape, dtype=torch.float32, device=logits.device)
        for a in range(0, rows, ROW_CHUNK):
            out[a: a + ROW_CHUNK] = _process_rows(flat[a: a + ROW_CHUNK], sampling)
        return out.view(logits.shape)
    return _process_rows(logits, sampling)


def _process_rows(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    x = logits.float()
    if sampling.greedy:
        return torch.softmax(x, dim=-1)
    x = x / sampling.temperature
    V = x.shape[-1]
    if 0 < sampling.top_k < V:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]                    # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))      # ties with the k-th token are kept, as in transformers
    if sampling.top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)                 # (..., V)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep a token while the mass of the tokens above it is still short of top_p: the most likely
        # token always survives, and the kept set is the smallest that reaches top_p.
        drop_sorted = mass_before >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) -> argmax token ids (...,)."""
    return logits.argmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """probs (..., V) -> one token id per row (...,), drawn with `generator` (on the probs' device)."""
    flat = probs.reshape(-1, probs.shape[-1])                                            # (R, V)
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def residual(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """norm(max(q - p, 0)) over the last dim: where the target still has mass the draft did not cover.

    q, p (..., V). A rejection of x implies q(x) < p(x) and hence, both summing to 1, some mass left over;
    an all-zero difference can only come from rounding, and then q itself is returned.
    """
    r = torch.clamp(q - p, min=0.0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), q)


def draw_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """probs (F, V) -> (tokens (F, k) in draw order, valid (F, k) bool).

    Gumbel-top-k, in its exponential form: with E(x) ~ Exp(1) i.i.d., ordering tokens by p(x) / E(x) (the same
    order as log p(x) + Gumbel) and reading the k largest gives exactly the sequence of k draws one would get
    by sampling x1 ~ p, then x2 ~ p without x1 renormalized, and so on (the Plackett-Luce identity), in one
    batched op. Tokens of probability 0 have key 0 and come last: a row with fewer than k of positive
    probability yields invalid (valid=False) entries at its end.
    """
    k = min(k, probs.shape[-1])
    u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float32)    # [0, 1)
    exp1 = -torch.log(u.clamp_min(torch.finfo(torch.float32).tiny))                               # Exp(1)
    top = torch.topk(probs.float() / exp1, k, dim=-1)
    return top.indices, top.values > 0


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on `device` seeded with `seed`; pass the same one to growth and verification of a
    round, and its state advancing gives fresh randomness every call."""
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))
