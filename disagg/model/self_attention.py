"""Grouped-query self-attention over the paged cache: MHA, GQA and MQA (S3b, S3c, S9b).

This rank's query heads and the KV heads it stores (`tensor_parallel.py`); K and V of the new
tokens go into the cache before attention, so each query sees its own key through the cache
like every other. The variants of the supported architectures: biases on Q, K and V (Qwen2,
and Llama's or Qwen3's `attention_bias`), one on o_proj (`o_proj_bias`), and Qwen3's RMSNorm
over each query and key head before RoPE (`qk_norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from disagg.model.attention import AttentionMetadata, paged_attention
from disagg.model.kv_cache import KVCache
from disagg.model.linear import Linear, linear
from disagg.model.norms import RMSNorm
from disagg.model.rope import RotaryAngles
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
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        # Qwen3: one weight over head_dim, shared by every head, whole on every rank.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def tp_cuts(self) -> dict[str, Cut]:
        """Which slice of each full weight this rank holds (names relative to this module).

        A Q/K/V bias is cut like its projection's rows; o_proj's bias is whole on every rank
        and added once, after the all-reduce."""
        d = self.head_dim
        q_rows, kv_rows = Cut.rows(self.queries, d), Cut.rows(self.shard.kv_heads(), d)
        cuts = {"q_proj.weight": q_rows, "k_proj.weight": kv_rows, "v_proj.weight": kv_rows,
                "o_proj.weight": q_rows.along(1)}
        if self.q_proj.bias is not None:
            cuts |= {"q_proj.bias": q_rows, "k_proj.bias": kv_rows, "v_proj.bias": kv_rows}
        return cuts

    def forward(self, x: torch.Tensor, angles: RotaryAngles, kv_cache: KVCache, layer_idx: int,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = angles.rotate(q), angles.rotate(k)
        kv_cache.write(layer_idx, k, v, meta.slot_page_ids, meta.slot_offsets)
        o = paged_attention(q, kv_cache, layer_idx, meta, self.scale, self.kv_heads)
        # Row-parallel: each rank's partial sum. Once the all-reduce returns, every rank has
        # entered it, so every rank's KV append above is done (S3c, the leader's bump follows).
        out = self.shard.all_reduce(linear(o.reshape(num_tokens, -1), self.o_proj.weight))
        # The bias joins the sum once, not once per rank.
        return out if self.o_proj.bias is None else out + self.o_proj.bias
