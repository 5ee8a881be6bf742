"""Verification of draft tokens: greedy prefix match and rejection sampling (S8).

The sampled case is checked the way the acceptance criterion asks: the distribution of the
first token a speculative chunk yields is the target's, by a chi-square test with fixed seeds;
the same statistic against the draft's own distribution must reject, so the test can fail.
"""

from __future__ import annotations

import pytest
import torch

from disagg.config import SpeculativeConfig
from disagg.engine.request import SamplingParams
from disagg.engine.sampling import apply_top_k_top_p
from disagg.errors import ConfigError
from disagg.speculative.verify import propose_token, token_probs, verify, verify_greedy, verify_sampled


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed `counts` under `probs` (cells of tiny expectation are pooled)."""
    expected = probs.double() * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def test_greedy_keeps_the_agreeing_prefix_and_adds_the_target_token() -> None:
    """Drafts up to the first disagreement are kept, then the target's own token follows."""
    logits = torch.eye(6)[[4, 1, 3, 5]]  # the target's argmax: 4, 1, 3, then 5
    assert verify_greedy([4, 1, 0], logits) == [4, 1, 3]
    assert verify_greedy([0, 1, 3], logits) == [4]
    assert verify_greedy([4, 1, 3], logits) == [4, 1, 3, 5]


def test_greedy_dispatch_ignores_draft_probabilities() -> None:
    """`verify` with temperature 0 is `verify_greedy`, whatever the drafts' distribution."""
    logits = torch.eye(5)[[2, 2]]
    assert verify([2], None, logits, SamplingParams(), None) == [2, 2]


def test_token_probs_match_the_sampler() -> None:
    """The target distribution used for acceptance is exactly what `sample_token` draws from:
    temperature, then top-k and top-p."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.8)
    probs = token_probs(logits, params)
    for row in range(3):
        expected = apply_top_k_top_p(logits[row] / 0.7, 10, 0.8).softmax(-1)
        torch.testing.assert_close(probs[row].float(), expected)


def test_proposed_draft_comes_with_its_distribution() -> None:
    """A sampled draft is drawn from the distribution returned with it (here: one-hot mass)."""
    logits = torch.tensor([0.0, 50.0, 0.0, 0.0])
    token, q = propose_token(logits, SamplingParams(temperature=1.0), None)
    assert token == 1
    assert q[1] > 0.99


@pytest.fixture
def distributions() -> tuple[torch.Tensor, torch.Tensor]:
    """A peaked target `p` ``[3, 6]`` and a different draft `q` ``[2, 6]``, fixed seed."""
    generator = torch.Generator().manual_seed(11)
    p = (torch.randn(3, 6, generator=generator) * 2).softmax(-1)
    q = (torch.randn(2, 6, generator=generator) * 2).softmax(-1)
    return p, q


def first_tokens(p: torch.Tensor, q: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Counts of the first token of `num_samples` speculative chunks (two drafts from q)."""
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(p.shape[1])
    for _ in range(num_samples):
        drafts = [int(torch.multinomial(q[j], 1, generator=generator)) for j in range(2)]
        counts[verify_sampled(drafts, q, p, generator)[0]] += 1
    return counts


def test_rejection_sampling_first_token_follows_the_target(
        distributions: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Chi-square: the first token is distributed as p[0], not as the draft's q[0]."""
    p, q = distributions
    counts = first_tokens(p, q, 4000)
    assert chi_square_p_value(counts, p[0]) > 1e-3
    assert chi_square_p_value(counts, q[0]) < 1e-6


def test_rejection_sampling_accepts_everything_when_draft_equals_target(
        distributions: tuple[torch.Tensor, torch.Tensor]) -> None:
    """With q == p every draft is kept and a bonus token follows (the ratio is one)."""
    p, _ = distributions
    generator = torch.Generator().manual_seed(0)
    drafts = [int(torch.multinomial(p[j], 1, generator=generator)) for j in range(2)]
    out = verify_sampled(drafts, p[:2], p, generator)
    assert out[:2] == drafts
    assert len(out) == 3


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"kind": "medusa"}, "unknown draft"),
    ({"kind": "mtp", "num_draft_tokens": 0}, "num_draft_tokens"),
    ({"kind": "early-exit", "draft_layers": -1}, "draft_layers"),
])
def test_config_rejects_bad_values(kwargs: dict, match: str) -> None:
    """A bad draft kind, count or depth fails where it is written."""
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig(**kwargs)


def test_early_exit_must_be_shallower_than_the_model() -> None:
    """An early exit at the last layer is the model itself: refused with the numbers."""
    from disagg.config import ModelConfig

    config = ModelConfig.from_name("tiny")
    assert SpeculativeConfig("early-exit").exit_layer(config) == 1
    with pytest.raises(ConfigError, match="shallower than the 2-layer"):
        SpeculativeConfig("early-exit", draft_layers=2).exit_layer(config)
