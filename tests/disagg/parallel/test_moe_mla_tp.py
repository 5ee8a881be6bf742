"""The deployments' architectures as real TP rank processes (S3c, S9a, S9b).

DeepSeek-V3's shape (MLA + MoE): TP 2 and 4 give TP 1's greedy tokens, and every rank's cache
holds the same latent rows, bit for bit: each rank computes the whole latent, so the cache is
replicated by construction (S9a). Qwen3-MoE: every expert's intermediate dimension sliced across
ranks, one all-reduce per block, TP 2 and 4 equal TP 1.
"""

from __future__ import annotations

import pytest
import torch

from disagg.engine.llm_engine import build_engine
from disagg.model.loading.registry import load_model
from tests.disagg.parallel.test_ranks import PARAMS, engine_config, prompts, tokens


def test_mla_moe_ranks_hold_identical_latents_and_match_one_process() -> None:
    """TP 2 of `tiny-mla-moe`: TP 1's tokens, and rank 1's latent pages equal rank 0's."""
    loaded = load_model("tiny-mla-moe")
    engine = build_engine(engine_config(loaded, 2, "HND"), loaded.state_dict,
                          model_spec="tiny-mla-moe")
    try:
        ours = [r.output_token_ids for r in engine.generate(prompts(loaded.config.vocab_size),
                                                            PARAMS)]
        shards = engine.kv_cache.shards
        assert engine.kv_cache.sharding.replicated and len(shards) == 2
        assert shards[0].buffer.shape[2:4] == (1, 1)  # one part (the latent), one "head"
        assert shards[0].buffer.abs().sum() > 0
        assert torch.equal(shards[0].buffer, shards[1].buffer)
    finally:
        engine.close()
    assert ours == tokens("tiny-mla-moe", 1, "HND")


@pytest.mark.slow  # rank processes: 3 more torch starts
@pytest.mark.parametrize("tp", [4])
def test_mla_moe_tp4_matches_one_process(tp: int) -> None:
    assert tokens("tiny-mla-moe", tp, "NHD") == tokens("tiny-mla-moe", 1, "NHD")


@pytest.mark.slow  # rank processes
@pytest.mark.parametrize("tp", [2, 4])
def test_qwen3_moe_matches_one_process(tp: int) -> None:
    assert tokens("tiny-qwen3-moe", tp, "HND") == tokens("tiny-qwen3-moe", 1, "HND")
