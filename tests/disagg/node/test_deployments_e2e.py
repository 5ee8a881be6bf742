"""S9's two deployments end to end, each with its architecture at toy size, over real processes
and the real tcp fabric: their tokens equal a single node's, and the bytes they move are what
their attention stores per token (S9a, S9b, S6).

- `deepseek-r1`: an MLA + MoE model. Its cache holds one latent row per token, identical on
  every rank of the TP 4 prefiller (replicated by construction), and each of 3 DP decoders
  receives one copy, from a source rank picked per request.
- `qwen3-coder`: a Qwen3-MoE (GQA, 4 KV heads), TP 4 on both sides, HND: rank i -> rank i.
"""

from __future__ import annotations

import pytest

from disagg.apps.deployments import DEPLOYMENTS, apply_deployment
from disagg.kv_transfer.context_slot import context_slot_nbytes
from disagg.model_config import ModelConfig
from disagg.node.cluster_config import ClusterConfig
from tests.disagg.node.test_disagg_e2e import (
    disaggregated_tokens,
    random_prompts,
    single_node_tokens,
)

pytestmark = pytest.mark.fabric

MAX_TOKENS = 8
PAGE_SIZE = 4


@pytest.mark.slow  # 1 prefiller of 4 ranks + 3 decoders (+ 12 ranks for qwen3-coder): ~20 s
@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_deployment_matches_a_single_node_and_moves_its_attentions_bytes(name: str) -> None:
    model = ModelConfig.from_name(str(DEPLOYMENTS[name]["model"]))
    prompts = random_prompts([1, 6, 13, 22, 9, 30], vocab_size=model.vocab_size, seed=9)
    options = apply_deployment({"page_size": PAGE_SIZE, "chunk_size": 7, "num_pages": 128},
                               name, {})
    config = ClusterConfig.from_options(**options)
    ours, result = disaggregated_tokens(config, prompts, MAX_TOKENS)
    assert ours == single_node_tokens(model.name, prompts, MAX_TOKENS)
    # Every page of every layer once (a replicated latent is sent from one rank, not four),
    # in the model's own per-token size, plus one context write per prefilled request.
    prefilled = [p for p in prompts if len(p) > 1]
    page_bytes = PAGE_SIZE * model.kv_values_per_token_layer * 4  # float32
    pages = sum(-(-(len(p) - 1) // PAGE_SIZE) for p in prefilled)
    assert result["totals"]["kv_bytes"] == (pages * model.num_layers * page_bytes
                                            + len(prefilled) * context_slot_nbytes(model))


@pytest.mark.slow  # 1 prefiller + 1 decoder, one of them with a rank process: ~10 s
@pytest.mark.parametrize(("model", "prefill_tp", "decode_tp"), [
    ("tiny-mla-moe", 1, 2),  # one latent copy in, every decoder rank's copy filled
    ("tiny-mla-moe", 2, 1),  # two identical copies out, one sent
    ("tiny-qwen3-moe", 2, 1),  # GQA heads rebuilt into whole pages (S6b)
    ("tiny-qwen3-moe", 1, 2),
])
def test_mismatched_tp_across_the_split(model: str, prefill_tp: int, decode_tp: int) -> None:
    """Each architecture across TP degrees that differ: the single node's tokens; with MLA
    every decoder rank holds the whole latent (its checksum is checked on every copy)."""
    vocab = ModelConfig.from_name(model).vocab_size
    prompts = random_prompts([3, 17, 9], vocab_size=vocab, seed=4)
    config = ClusterConfig.from_options(model=model, num_decoders=1, page_size=PAGE_SIZE,
                                        chunk_size=7, prefill_tp=prefill_tp,
                                        decode_tp=decode_tp, kv_layout="HND")
    ours, _ = disaggregated_tokens(config, prompts, MAX_TOKENS)
    assert ours == single_node_tokens(model, prompts, MAX_TOKENS)
