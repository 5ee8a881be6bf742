"""Sampling with speculation keeps the target's distribution: chi-square tests (S8).

A small-vocabulary model (8 tokens, an LM head scaled so the distributions are far from
uniform) serves the same prompt 2000 times with seeds 0..1999 and temperature 1. The first
output token comes from the prefill; the next ones from one speculative chunk (k = 2), so they
went through draft sampling and rejection sampling. Their empirical distributions must match
the exact marginals computed from the model without speculation, and must not match the
distribution of the first token (the test can tell distributions apart).
"""

from __future__ import annotations

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.engine.request import SamplingParams
from disagg.model.loading.registry import init_random_weights
from disagg.speculative.speculator import Speculator, build_speculative_engine
from tests.disagg.speculative.test_verify import chi_square_p_value

CONFIG = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, name="chi2")
PROMPT = [1, 2, 3]
NUM_REQUESTS = 2000


def make_engine(num_requests: int, spec: SpeculativeConfig | None = None) -> LLMEngine:
    weights = init_random_weights(CONFIG, seed=2)
    weights["lm_head.weight"] = weights["lm_head.weight"] * 12  # peaked, not one-hot
    config = EngineConfig(
        CONFIG, CacheConfig(page_size=4, num_pages=4 * num_requests + 64),
        SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=8 * num_requests,
                        chunk_size=64))
    if spec is None:
        return build_engine(config, weights)
    return build_speculative_engine(config, weights, spec)


def next_token_probs(sequences: list[list[int]]) -> torch.Tensor:
    """``[len(sequences), vocab]``: the target's next-token distribution after each one."""
    engine = make_engine(len(sequences))
    for sequence in sequences:
        engine.add_request(sequence, SamplingParams(max_tokens=1))
    return engine.runner.execute(engine.scheduler.schedule()).logits.softmax(-1)


@pytest.fixture(scope="module")
def marginals() -> list[torch.Tensor]:
    """Exact distributions of output tokens 0, 1 and 2 (summing over the earlier ones)."""
    vocab = range(CONFIG.vocab_size)
    first = next_token_probs([PROMPT])[0]
    second = next_token_probs([[*PROMPT, x] for x in vocab])  # [x, y]
    third = next_token_probs([[*PROMPT, x, y] for x in vocab for y in vocab])  # [x * 8 + y, z]
    pairs = first[:, None] * second  # P(x, y)
    return [first, first @ second, pairs.reshape(-1) @ third]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["early-exit", "mtp"])
def test_speculative_samples_follow_the_target(kind: str, marginals: list[torch.Tensor]
                                               ) -> None:
    """Output tokens 1 and 2 (from a speculative chunk) pass a chi-square test against the
    target's exact marginals; token 1 fails it against token 0's distribution."""
    engine = make_engine(NUM_REQUESTS, SpeculativeConfig(kind, 2, draft_layers=1))
    speculator = engine.finisher
    assert isinstance(speculator, Speculator)
    requests = [engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=1.0,
                                                          seed=seed))
                for seed in range(NUM_REQUESTS)]
    while engine.has_unfinished():
        engine.step()
    engine.allocator.check_invariants(expect_all_free=True)
    # Both outcomes happened many times: acceptance and rejection paths are exercised.
    assert 500 < speculator.stats.accepted < speculator.stats.drafted - 500
    for index in (1, 2):
        counts = torch.bincount(torch.tensor([r.output_token_ids[index] for r in requests]),
                                minlength=CONFIG.vocab_size)
        assert chi_square_p_value(counts, marginals[index]) > 1e-3, (index, counts)
        if index == 1:
            assert chi_square_p_value(counts, marginals[0]) < 1e-6
