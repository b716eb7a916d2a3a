"""Distributions: temperature / top-k / top-p, residuals, without-replacement draws, seeded generators."""
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from offspec.config import SamplingConfig
from offspec.spec.sampling import draw_without_replacement, greedy, make_generator, process_logits, residual, sample


def test_greedy_keeps_the_plain_softmax():
    # At T = 0 the probabilities only rank tree candidates: no truncation, no temperature.
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    probs = process_logits(logits, SamplingConfig(temperature=0.0, top_k=1, top_p=0.1))
    torch.testing.assert_close(probs, torch.softmax(logits, -1))
    assert greedy(logits).tolist() == [0]


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # 0.5 + 0.3 = 0.8 reaches top_p = 0.8: the third token is dropped.
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # top_p = 0.81 needs the third token too.
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_p=0.81))
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # The most likely token always survives.
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_p=0.01))
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_top_k_and_temperature():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0])
    probs = process_logits(logits, SamplingConfig(temperature=0.5, top_k=2))
    expected = torch.softmax(torch.tensor([6.0, 4.0]), -1)
    torch.testing.assert_close(probs, torch.tensor([expected[0], 0.0, expected[1], 0.0]))


def test_matches_transformers_warpers_on_batches():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(0)) * 3    # (..., V)
    for T, k, p in [(0.6, 0, 0.9), (1.0, 10, 1.0), (1.3, 7, 0.7)]:
        ours = process_logits(logits, SamplingConfig(temperature=T, top_k=k, top_p=p))
        flat = TemperatureLogitsWarper(T)(None, logits.reshape(-1, 50))
        if k:
            flat = TopKLogitsWarper(k)(None, flat)
        if p < 1.0:
            flat = TopPLogitsWarper(p)(None, flat)
        torch.testing.assert_close(ours, torch.softmax(flat, -1).reshape(3, 5, 50))


def test_residual():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    p = torch.tensor([0.7, 0.1, 0.1, 0.1])
    # max(q - p, 0) = [0, 0.2, 0.1, 0] -> normalized
    torch.testing.assert_close(residual(q, p), torch.tensor([0.0, 2 / 3, 1 / 3, 0.0]))
    # Identical distributions leave nothing over (only reachable by rounding): q comes back unchanged.
    torch.testing.assert_close(residual(q, q), q)


def test_draws_without_replacement_follow_sequential_sampling():
    """The ordered first two draws of Gumbel-top-k have the exact sequential law p(a) p(b) / (1 - p(a))."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    n = 20000
    tokens, valid = draw_without_replacement(p.expand(n, 5), 3, make_generator(0))   # (n, 3)
    assert valid[:, :3].all() and tokens.shape == (n, 3)
    assert (tokens != 4).all()                       # zero probability is never drawn while others remain
    assert all(len(set(row)) == 3 for row in tokens[:200].tolist())
    pairs = [(a, b) for a, b in itertools.permutations(range(4), 2)]
    law = np.array([float(p[a] * p[b] / (1 - p[a])) for a, b in pairs])
    expected = law / law.sum() * n                   # law sums to 1 up to float32 rounding
    index = {pair: i for i, pair in enumerate(pairs)}
    observed = np.bincount([index[(a, b)] for a, b in tokens[:, :2].tolist()], minlength=len(pairs))
    assert chisquare(observed, expected).pvalue > 1e-3


def test_draws_beyond_the_support_are_marked_invalid():
    p = torch.tensor([[0.0, 0.6, 0.0, 0.4]])
    tokens, valid = draw_without_replacement(p, 4, make_generator(1))
    assert valid.tolist() == [[True, True, False, False]]
    assert sorted(tokens[0, :2].tolist()) == [1, 3]


def test_generators_are_seeded_and_advance():
    probs = torch.full((64, 10), 0.1)
    a = sample(probs, make_generator(7))
    b = sample(probs, make_generator(7))
    assert torch.equal(a, b) and a.shape == (64,)
    g = make_generator(7)
    first, second = sample(probs, g), sample(probs, g)
    assert not torch.equal(first, second)            # fresh randomness on every call
    assert sample(torch.tensor([0.0, 1.0, 0.0]), g).item() == 1


@pytest.mark.parametrize("T", [0.6, 1.0])
def test_process_logits_rows_are_distributions(T):
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 4
    probs = process_logits(logits.to(torch.bfloat16), SamplingConfig(temperature=T, top_p=0.9, top_k=20))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    assert ((probs > 0).sum(-1) <= 20).all()
