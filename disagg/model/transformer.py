"""A Llama-architecture transformer in pure PyTorch that reads and writes a paged KV cache (S3b).

RMSNorm, rotary embeddings (Hugging Face's rotate-half convention), grouped-query attention and
a SwiGLU MLP; embeddings tied or not. Parameter names follow Hugging Face's `LlamaForCausalLM`
without the leading ``model.`` so checkpoints load without renaming. Tokens of several requests
are packed on one axis (no padding); `AttentionMetadata` says which rows belong to whom.

After each layer's attention output projection the forward bumps a `LayerCounter` (a tensor
op, not a Python callback), so a captured CUDA graph still drives layer-by-layer transfers.

Given a `TPShard` the model is one tensor-parallel rank's part (`tensor_parallel.py`): its
query and KV heads, its slice of the MLP, and an all-reduce after o_proj and after down_proj.
Only the leader is built with a real counter, and it bumps after the o_proj all-reduce (S3c).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disagg.config import ModelConfig
from disagg.model.attention import AttentionMetadata, paged_attention
from disagg.model.kv_cache import KVCache
from disagg.model.layer_counter import LayerCounter, NullLayerCounter
from disagg.model.tensor_parallel import TPShard


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta**exponents)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x` ``[num_tokens, num_heads, head_dim]`` by each token's position."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query self-attention over the paged cache (this rank's heads, with TP)."""

    def __init__(self, config: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        self.num_heads = len(shard.query_heads(config))
        self.num_kv_heads = len(shard.kv_heads())
        self.head_dim = config.head_dim
        self.shard = shard
        # A replicated (MLA-style) cache holds every head; this rank attends with its own.
        heads = shard.attention_heads(config)
        self.kv_heads = None if heads == slice(0, self.num_kv_heads) else heads
        self.scale = config.head_dim ** -0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: KVCache, layer_idx: int, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rope(q, positions), rope(k, positions)
        # Append first: each query then sees its own key through the cache like every other.
        kv_cache.write(layer_idx, k, v, meta.slot_page_ids, meta.slot_offsets)
        o = paged_attention(q, kv_cache, layer_idx, meta, self.scale, self.kv_heads)
        # Row-parallel: each rank's partial sum. Once the all-reduce returns, every rank has
        # entered it, so every rank's KV append above is done (S3c, the leader's bump follows).
        return self.shard.all_reduce(self.o_proj(o.reshape(num_tokens, -1)))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        inner = config.intermediate_size // shard.size
        self.gate_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.down_proj = nn.Linear(inner, config.hidden_size, bias=False)
        self.all_reduce = shard.all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    def __init__(self, config: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, shard)


class Transformer(nn.Module):
    """The whole decoder: embeddings, layers, final norm, LM head."""

    def __init__(self, config: ModelConfig, layer_counter: LayerCounter | None = None,
                 shard: TPShard | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard or TPShard.single(config.num_kv_heads)
        if layer_counter is not None and not self.shard.is_leader:
            raise ValueError(f"only the leader bumps the layer counter (S3c), not rank "
                             f"{self.shard.rank}")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.shard)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                    config.rope_theta)
        # Bumped after each layer's attention (S3b): a prefiller's builder passes the counter
        # its poller watches; everyone else bumps nothing.
        self.layer_counter: LayerCounter = layer_counter or NullLayerCounter()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata,
                num_layers: int | None = None) -> torch.Tensor:
        """Run `input_ids` ``[num_tokens]`` through every layer; returns the final-norm hidden
        states ``[num_tokens, hidden_size]`` and leaves each layer's K/V in `kv_cache`. With
        `num_layers`, only the first ones run: an early-exit draft (decoders only, S8)."""
        h = self.embed_tokens(input_ids)
        for layer_idx, layer in enumerate(self.layers[:num_layers]):
            attn_out = layer.self_attn(layer.input_layernorm(h), positions, self.rope,
                                       kv_cache, layer_idx, meta)
            # This layer's K/V are in the cache now: let the messenger ship them (S3b).
            self.layer_counter.bump()
            h = h + attn_out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[num_rows, hidden_size]`` -> ``[num_rows, vocab_size]``."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face style state dict (names without ``model.``) into the model."""
        missing, unexpected = self.load_state_dict(state_dict, strict=False)
        missing = [name for name in missing if not name.startswith("rope.")]
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
