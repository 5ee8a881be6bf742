"""DeepSeek-V3's Multi-head Latent Attention (MLA) over the paged latent cache (S3b, S3c, S9a).

Keys and values come from one low-rank latent per token: `kv_a_proj_with_mqa` gives `c_KV`
(normalised by `kv_a_layernorm`) and a RoPE key shared by every head; `kv_b_proj` would expand
`c_KV` into per-head keys and values. The cache stores only ``[c_KV ; rope(k_rope)]``
(`kv_lora_rank + qk_rope_head_dim` values per token and layer), and attention reads it in the
up-projected or the absorbed form (`latent_paged_attention.py`). Queries come from `q_proj`, or
through the low-rank `q_a_proj`, `q_a_layernorm`, `q_b_proj` when `q_lora_rank` is set.

Why the cache is replicated under TP, not sharded (S9a): the latent is not per head. Every
head's key and value are read out of the same `c_KV`, so there is no head axis to cut. Each
rank computes the whole latent (`kv_a_proj_with_mqa`, `kv_a_layernorm`, and the small `q_a_*`
path) and writes the identical rows into its own cache; only the per-head up-projections
(`q_b_proj` or `q_proj`, `kv_b_proj`) are split by heads and `o_proj` by columns, with one
all-reduce after it. A decoder can therefore take a request's KV from any one prefill rank.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from disagg.model.attention import AttentionMetadata
from disagg.model.kv_cache import KVCache
from disagg.model.latent_paged_attention import latent_paged_attention
from disagg.model.linear import Linear, linear
from disagg.model.norms import RMSNorm
from disagg.model.rope import RotaryAngles, RotaryEmbedding
from disagg.model.tensor_parallel import Cut, TPShard
from disagg.model_config import ModelConfig, RopeScaling

# DeepSeek builds its two latent norms with the RMSNorm default, not the model's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def softmax_scale(qk_head_dim: int, rope_scaling: RopeScaling | None) -> float:
    """``qk_head_dim ** -0.5``, times yarn's attention temperature squared when the scaling
    sets `mscale_all_dim` (DeepSeek-V3: longer contexts sharpen the softmax).

    >>> round(softmax_scale(192, RopeScaling("yarn", factor=40.0, mscale_all_dim=1.0)), 5)
    0.13523
    """
    scale = qk_head_dim**-0.5
    if rope_scaling is not None and rope_scaling.mscale_all_dim:
        mscale = _yarn_mscale(rope_scaling.factor, rope_scaling.mscale_all_dim)
        scale *= mscale * mscale
    return scale


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek pairs RoPE dims (0, 1), (2, 3), ...: move the even dims first and the odd ones
    after, so rotate-half RoPE (`rope.py`) rotates the same pairs. The order that results is
    the one the cache stores and the query uses, so scores are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """MLA: this rank's query heads over the whole latent, which every rank caches."""

    def __init__(self, config: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None, "LatentAttention needs config.mla"
        self.mla = mla
        self.shard = shard
        self.heads = shard.split(config.num_heads, "attention heads")
        self.num_heads = self.heads.stop - self.heads.start
        self.scale = softmax_scale(mla.qk_head_dim, config.rope_scaling)
        hidden, rank = config.hidden_size, mla.kv_lora_rank
        # Biases where DeepSeek puts them: the two down-projections and o_proj (o_proj_bias).
        bias = config.attention_bias
        q_size = self.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_size, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(rank, self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                   bias=False)
        self.o_proj = Linear(self.num_heads * mla.v_head_dim, hidden, bias=config.o_proj_bias)

    def tp_cuts(self) -> dict[str, Cut]:
        """Which slice of each full weight this rank holds (names relative to this module):
        the per-head projections by heads, o_proj by columns; the latent path stays whole."""
        heads, mla = range(self.heads.start, self.heads.stop), self.mla
        q_name = "q_proj.weight" if mla.q_lora_rank is None else "q_b_proj.weight"
        return {q_name: Cut.rows(heads, mla.qk_head_dim),
                "kv_b_proj.weight": Cut.rows(heads, mla.qk_nope_head_dim + mla.v_head_dim),
                "o_proj.weight": Cut.rows(heads, mla.v_head_dim).along(1)}

    def latent_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """What the cache stores for `x` ``[num_tokens, hidden_size]``: ``[num_tokens,
        kv_lora_rank + qk_rope_head_dim]``, the normalised `c_KV` then the rotated RoPE key."""
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.mla.kv_lora_rank, self.mla.qk_rope_head_dim], dim=-1)
        k_rope = self._rotate(k_rope[:, None], cos, sin)[:, 0]  # [num_tokens, qk_rope_head_dim]
        return torch.cat((self.kv_a_layernorm(c_kv), k_rope), dim=-1)

    def forward(self, x: torch.Tensor, angles: RotaryAngles, kv_cache: KVCache, layer_idx: int,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, mla = x.shape[0], self.mla
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        cos, sin = angles.cos, angles.sin  # [num_tokens, qk_rope_head_dim] each
        q_rope = self._rotate(q_rope, cos, sin)
        kv_cache.write_latent(layer_idx, self.latent_rows(x, cos, sin), meta.slot_page_ids,
                              meta.slot_offsets)
        # kv_b_proj's rows are per head: first the key's no-RoPE part, then the value.
        w_kv = self.kv_b_proj.weight.view(self.num_heads, -1, mla.kv_lora_rank)
        w_uk, w_uv = w_kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        o = latent_paged_attention(q_nope, q_rope, kv_cache, layer_idx, meta, w_uk, w_uv,
                                   self.scale)  # [num_tokens, num_heads, v_head_dim]
        # Row-parallel: each rank's partial sum. Once the all-reduce returns every rank has
        # written its latent rows above (S3c: the leader's layer bump follows).
        out = self.shard.all_reduce(linear(o.reshape(num_tokens, -1), self.o_proj.weight))
        # The bias joins the sum once, not once per rank.
        return out if self.o_proj.bias is None else out + self.o_proj.bias

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.mla.rope_interleave:
            x = deinterleave(x)
        return RotaryEmbedding.rotate(x, cos, sin)
