"""Grouped-query self-attention over the paged cache: MHA, GQA and MQA (S3b, S3c).

This rank's query heads and the KV heads it stores (`tensor_parallel.py`); K and V of the new
tokens go into the cache before attention, so each query sees its own key through the cache
like every other.
"""

from __future__ import annotations

import torch
from torch import nn

from disagg.model.attention import AttentionMetadata, paged_attention
from disagg.model.kv_cache import KVCache
from disagg.model.rope import RotaryEmbedding
from disagg.model.tensor_parallel import Cut, TPShard
from disagg.model_config import ModelConfig


class Attention(nn.Module):
    """Grouped-query self-attention over the paged cache (this rank's heads, with TP)."""

    def __init__(self, config: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        self.queries = shard.query_heads(config)
        self.num_heads = len(self.queries)
        self.num_kv_heads = len(shard.kv_heads())
        self.head_dim = config.head_dim
        self.shard = shard
        # A replicated cache holds every head; this rank attends with its own.
        heads = shard.attention_heads(config)
        self.kv_heads = None if heads == slice(0, self.num_kv_heads) else heads
        self.scale = config.head_dim ** -0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def tp_cuts(self) -> dict[str, Cut]:
        """Which slice of each full weight this rank holds (names relative to this module)."""
        d = self.head_dim
        q_rows, kv_rows = Cut.rows(self.queries, d), Cut.rows(self.shard.kv_heads(), d)
        return {"q_proj.weight": q_rows, "k_proj.weight": kv_rows, "v_proj.weight": kv_rows,
                "o_proj.weight": q_rows.along(1)}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: KVCache, layer_idx: int, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rope(q, positions), rope(k, positions)
        kv_cache.write(layer_idx, k, v, meta.slot_page_ids, meta.slot_offsets)
        o = paged_attention(q, kv_cache, layer_idx, meta, self.scale, self.kv_heads)
        # Row-parallel: each rank's partial sum. Once the all-reduce returns, every rank has
        # entered it, so every rank's KV append above is done (S3c, the leader's bump follows).
        return self.shard.all_reduce(self.o_proj(o.reshape(num_tokens, -1)))
