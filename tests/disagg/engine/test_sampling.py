"""Sampling: greedy is argmax, seeds reproduce, top-k / top-p keep the right tokens."""

from __future__ import annotations

import torch

from disagg.engine.request import SamplingParams
from disagg.engine.sampling import apply_top_k_top_p, sample_token


def test_greedy_is_argmax() -> None:
    """temperature 0 picks the largest logit."""
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample_token(logits, SamplingParams(temperature=0.0)) == 1


def test_same_seed_same_tokens() -> None:
    """Two generators with one seed draw the same sequence."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    draws = [[sample_token(logits, params, g) for _ in range(20)]
             for g in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))]
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1


def test_top_k_keeps_k_largest() -> None:
    """top_k=2 leaves exactly the two largest logits finite."""
    kept = apply_top_k_top_p(torch.tensor([1.0, 5.0, 3.0, 4.0]), top_k=2, top_p=1.0)
    assert torch.isfinite(kept).tolist() == [False, True, False, True]


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    """With probabilities 0.5, 0.3, 0.2, top_p=0.7 keeps the first two (0.5 < 0.7 <= 0.8)."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    kept = apply_top_k_top_p(logits, top_k=0, top_p=0.7)
    assert torch.isfinite(kept).tolist() == [True, True, False]


def test_sampling_follows_the_distribution() -> None:
    """Empirical frequencies of 4000 draws are close to softmax(logits / T)."""
    logits = torch.tensor([1.0, 0.0, -1.0])
    params = SamplingParams(temperature=0.5)
    generator = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.tensor([sample_token(logits, params, generator)
                                          for _ in range(4000)]), minlength=3)
    expected = (logits / 0.5).softmax(-1)
    torch.testing.assert_close(counts / 4000, expected, atol=0.03, rtol=0)
