"""Speculative decoding at `--dtype bfloat16` (S8): the MTP head is built in the target's dtype
(the same draws as in float32, then cast, so a prefiller and its decoders still agree without
shipping weights), it takes the float32 hidden state the context slot carries, and greedy
speculation yields the plain bf16 engine's tokens (before, the bf16 target's LM head met the
float32 head's output and the batch failed).
"""

from __future__ import annotations

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from disagg.engine.llm_engine import build_engine, load_transformer
from disagg.engine.request import SamplingParams
from disagg.model.draft_heads import build_mtp_head, mtp_kv_cache
from disagg.model.loading.registry import init_random_weights
from disagg.speculative.proposers import CatchUp, mtp_catch_up
from disagg.speculative.speculator import build_speculative_engine

CONFIG = ModelConfig.from_name("tiny")
WEIGHTS = init_random_weights(CONFIG, seed=0)
BF16 = torch.bfloat16


def engine_config() -> EngineConfig:
    return EngineConfig(CONFIG, CacheConfig(page_size=4, num_pages=256, dtype=BF16),
                        SchedulerConfig(chunk_size=7, max_num_batched_tokens=32), dtype=BF16)


def test_the_mtp_head_is_the_float32_head_rounded() -> None:
    """Every parameter in bf16, each the float32 head's value rounded: the same on any node."""
    full, half = build_mtp_head(CONFIG), build_mtp_head(CONFIG, dtype=BF16)
    for (name, a), (_, b) in zip(full.named_parameters(), half.named_parameters(), strict=True):
        assert b.dtype == BF16, name
        assert torch.equal(a.to(BF16), b), name


def test_mtp_catch_up_takes_the_shipped_float32_hidden_state() -> None:
    """What the context slot delivers is float32; a bf16 head runs it and returns bf16."""
    target = load_transformer(engine_config(), WEIGHTS)
    cache = mtp_kv_cache(CONFIG, engine_config().cache, "cpu")
    hidden = torch.randn(3, CONFIG.hidden_size)  # float32
    out, logits = mtp_catch_up(build_mtp_head(CONFIG, dtype=BF16), target, cache,
                               [CatchUp([0], 0, hidden, [5, 6, 7])])
    assert (out.dtype, logits.dtype) == (BF16, BF16)
    assert logits.shape == (1, CONFIG.vocab_size)


@pytest.mark.parametrize("kind", ["mtp", "early-exit"])
def test_greedy_speculation_at_bf16_gives_the_plain_engines_tokens(kind: str) -> None:
    """Prompts of 1 to 17 tokens, 10 greedy tokens each, with drafts verified in chunks."""
    prompts = [[5, 6, 7, 8, 9], [3], [11 + i for i in range(17)]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = build_engine(engine_config(), WEIGHTS).generate(prompts, params)
    engine = build_speculative_engine(engine_config(), WEIGHTS,
                                      SpeculativeConfig(kind=kind, draft_layers=1))
    ours = engine.generate(prompts, params)
    assert [r.output_token_ids for r in ours] == [r.output_token_ids for r in plain]
    assert all(len(r.output_token_ids) == 10 for r in ours)
    engine.allocator.check_invariants(expect_all_free=True)
