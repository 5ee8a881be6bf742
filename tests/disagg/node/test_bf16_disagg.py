"""Disaggregated serving at `--dtype bfloat16`: real prefiller and decoder processes over the
real tcp fabric (S3b, S4, S6).

The tokens equal a single bf16 node's, and what crossed the wire is half a float32 run's: every
page write moves bf16 K/V (the context slot keeps shipping the hidden state as float32,
`context_slot.py`, so it weighs the same). The byte counts are the nodes' own: the
prefiller's `bytes_total` (what it posted) and the decoder's `kv_bytes_total` (what its
receipts counted), which the demo's totals add up per request and label with the KV dtype.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, SchedulerConfig, check_dtype
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.kv_transfer.context_slot import context_slot_nbytes
from disagg.model.loading.registry import load_model
from disagg.node.cluster_config import ClusterConfig
from tests.disagg.node.test_disagg_e2e import disaggregated_tokens, random_prompts

pytestmark = pytest.mark.fabric

MAX_TOKENS = 10
PAGE_SIZE = 4


def single_node_tokens(model: str, prompts: list[list[int]], dtype: str) -> list[list[int]]:
    """The reference: one node at `dtype` (weights and KV), greedy."""
    loaded = load_model(model)
    config = EngineConfig(loaded.config, CacheConfig(page_size=PAGE_SIZE, num_pages=256,
                                                     dtype=check_dtype(dtype)),
                          SchedulerConfig(), dtype=check_dtype(dtype))
    requests = build_engine(config, loaded.state_dict).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS))
    return [r.output_token_ids for r in requests]


def bytes_moved(result: dict[str, Any]) -> tuple[float, float, int]:
    """(prefiller's bytes posted, decoder's bytes received, the demo's total)."""
    metrics = result["metrics"]

    def total(node: str, name: str) -> float:
        return sum(v for k, v in metrics[node].items() if k.startswith(name))

    return (total("prefill-0", "disagg:kv_sent_bytes_total"),
            total("decode-0", "disagg:kv_bytes_total"), result["totals"]["kv_bytes"])


@pytest.mark.slow  # two clusters of 2 processes and a single node: about 10 s
@pytest.mark.parametrize("model", ["tiny", "tiny-mla-moe"])
def test_bf16_matches_a_bf16_node_and_moves_half_the_bytes(model: str) -> None:
    """GQA K/V pages and MLA's latent rows alike: same tokens as one bf16 node, every page in
    half the bytes of the float32 run, and both sides count the same bytes."""
    config = load_model(model).config
    prompts = random_prompts([1, 6, 13, 22], vocab_size=config.vocab_size, seed=11)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        cluster = ClusterConfig.from_options(model=model, num_decoders=1, page_size=PAGE_SIZE,
                                             chunk_size=7, dtype=dtype)
        assert cluster.node.cache.dtype == check_dtype(dtype)  # --kv-dtype auto follows it
        runs[dtype] = disaggregated_tokens(cluster, prompts, MAX_TOKENS)
    tokens, result = runs["bfloat16"]
    assert tokens == single_node_tokens(model, prompts, "bfloat16")
    prefilled = [p for p in prompts if len(p) > 1]  # a 1-token prompt ships nothing
    context = len(prefilled) * context_slot_nbytes(config)
    pages = sum(-(-(len(p) - 1) // PAGE_SIZE) for p in prefilled) * config.num_layers
    page_bytes = {}
    for dtype, (_, run) in runs.items():
        assert run["kv_dtype"] == dtype  # what the demo's totals are counted in
        posted, received, total = bytes_moved(run)
        assert posted == received == total
        page_bytes[dtype] = total - context
    element_size = torch.empty(0, dtype=torch.bfloat16).element_size()
    assert page_bytes["bfloat16"] == pages * PAGE_SIZE * config.kv_values_per_token_layer * (
        element_size)
    assert page_bytes["bfloat16"] * 2 == page_bytes["float32"]
