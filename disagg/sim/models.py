"""Model shapes for the cluster simulator: parameter, FLOP and KV byte counts (S1, S9).

Presets for DeepSeek-R1 (MLA attention, 256-expert MoE), Qwen3-Coder-480B-A35B (GQA, 160-expert
MoE) and SmolLM2-135M (dense Llama), converted from their published shapes in
`disagg/model_catalog.py` (the engine's own `ModelConfig`s) with `from_model_config`, plus the
precisions and kernel counts of their deployments. This is arithmetic on shapes, not a model
you can run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from disagg.config import ModelConfig
from disagg.errors import ConfigError
from disagg.model_catalog import published

AttentionKind = Literal["gqa", "mla"]


@dataclass(frozen=True, slots=True)
class SimModel:
    """The shape of a decoder-only transformer, as far as step times are concerned.

    `weight_bytes` is bytes per GEMM weight (1 for fp8), `kv_bytes` per KV-cache element.
    MLA fields follow DeepSeek-V3's config names; for GQA they stay 0.
    """

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    attention: AttentionKind = "gqa"
    num_kv_heads: int = 0  # gqa
    head_dim: int = 0  # gqa
    q_lora_rank: int = 0  # mla: 0 means a plain q projection
    kv_lora_rank: int = 0  # mla: the latent vector every head shares
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    intermediate_size: int = 0  # dense MLP layers
    num_dense_layers: int = 0  # leading dense layers of an MoE model
    num_experts: int = 0  # routed experts per MoE layer (0: dense model)
    num_experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    weight_bytes: float = 1.0
    kv_bytes: float = 2.0
    lm_head_bytes: float = 2.0  # the LM head usually stays in bf16 even in fp8 checkpoints
    mtp_layers: int = 0  # multi-token-prediction modules shipped with the checkpoint
    kernels_per_layer: int = 12  # GPU kernels one layer's forward launches (decode path)

    def __post_init__(self) -> None:
        if self.attention == "gqa" and (self.num_kv_heads <= 0 or self.head_dim <= 0):
            raise ConfigError(f"model {self.name}: GQA needs num_kv_heads and head_dim")
        if self.attention == "mla" and self.kv_lora_rank <= 0:
            raise ConfigError(f"model {self.name}: MLA needs kv_lora_rank")
        if self.num_experts and not 0 < self.num_experts_per_token <= self.num_experts:
            raise ConfigError(f"model {self.name}: bad num_experts_per_token "
                              f"{self.num_experts_per_token}")

    # Parameter counts (per layer unless named otherwise).

    @property
    def attention_params(self) -> int:
        """Weights of one attention block: projections in and out."""
        h = self.hidden_size
        if self.attention == "gqa":
            return h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim \
                + self.num_heads * self.head_dim * h
        qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk_dim
             if self.q_lora_rank else h * self.num_heads * qk_dim)
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_a + kv_b + self.num_heads * self.v_head_dim * h

    @property
    def expert_params(self) -> int:
        """One SwiGLU expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return self.num_layers - self.num_dense_layers if self.num_experts else 0

    @property
    def dense_mlp_params(self) -> int:
        """One dense SwiGLU MLP."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def embedding_params(self) -> int:
        """The token embedding table (the LM head is the same size)."""
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """Every weight of the main model (no MTP module)."""
        moe = self.num_moe_layers * (
            (self.num_experts + self.num_shared_experts) * self.expert_params
            + self.hidden_size * self.num_experts)  # + router
        dense = (self.num_layers - self.num_moe_layers) * self.dense_mlp_params
        heads = self.embedding_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.attention_params + moe + dense + heads

    @property
    def active_params(self) -> int:
        """Weights one token goes through (the embedding counted once, as papers do)."""
        moe = self.num_moe_layers * (
            (self.num_experts_per_token + self.num_shared_experts) * self.expert_params
            + self.hidden_size * self.num_experts)
        dense = (self.num_layers - self.num_moe_layers) * self.dense_mlp_params
        heads = self.embedding_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.attention_params + moe + dense + heads

    # KV cache and attention dimensions.

    @property
    def kv_elems_per_token(self) -> int:
        """KV-cache elements one token adds to one layer (MLA: the latent plus the RoPE key)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes of one token across all layers: what a prefiller ships per token.

        >>> round(PRESETS["deepseek-r1"].kv_bytes_per_token)  # 61 x 576 x 2 bytes
        70272
        """
        return self.num_layers * self.kv_elems_per_token * self.kv_bytes

    def attention_dims(self, decode: bool) -> tuple[int, int, int]:
        """(query heads, q·k dim, v dim) of the attention kernel.

        MLA decodes in the weight-absorbed form (every head attends over the shared 576-wide
        latent, as FlashMLA does) and prefills in the expanded form (per-head 192/128 dims).
        """
        if self.attention == "gqa":
            return self.num_heads, self.head_dim, self.head_dim
        if decode:
            return self.num_heads, self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank
        return (self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim,
                self.v_head_dim)

    def expected_active_experts(self, num_tokens: float) -> float:
        """Distinct routed experts that `num_tokens` tokens touch in one layer, on average.

        Assumes uniform routing (what load balancing aims for): each expert is missed by a
        token with probability 1 - k/E, so E * (1 - (1 - k/E)^T) are hit.
        """
        if not self.num_experts or num_tokens <= 0:
            return 0.0
        miss = 1.0 - self.num_experts_per_token / self.num_experts
        return self.num_experts * (1.0 - miss ** num_tokens)


def from_model_config(config: ModelConfig, weight_bytes: float = 4.0,
                      kv_bytes: float = 4.0) -> SimModel:
    """The simulator's view of an engine `ModelConfig`, any architecture (fp32 by default)."""
    mla, moe = config.mla, config.moe
    attention: AttentionKind = "mla" if mla is not None else "gqa"
    sparse = sum(moe.is_sparse(i) for i in range(config.num_layers)) if moe else 0
    shape: dict[str, int] = {"num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim}
    if mla is not None:
        shape = {"q_lora_rank": mla.q_lora_rank or 0, "kv_lora_rank": mla.kv_lora_rank,
                 "qk_nope_head_dim": mla.qk_nope_head_dim,
                 "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim}
    if moe is not None:
        shape |= {"num_experts": moe.num_experts, "num_experts_per_token": moe.num_experts_per_tok,
                  "num_shared_experts": moe.num_shared_experts,
                  "moe_intermediate_size": moe.moe_intermediate_size}
    return SimModel(name=config.name, num_layers=config.num_layers,
                    hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                    num_heads=config.num_heads, attention=attention,
                    intermediate_size=config.intermediate_size,
                    num_dense_layers=config.num_layers - sparse,
                    tie_word_embeddings=config.tie_word_embeddings, weight_bytes=weight_bytes,
                    kv_bytes=kv_bytes, lm_head_bytes=weight_bytes, **shape)


PRESETS: dict[str, SimModel] = {
    # DeepSeek-R1 (`model_catalog.py`): fp8 (e4m3) weights as published, the LM head in bf16.
    # MTP: one module (V3 report §2.2), used for speculative decoding. Kernel count: SGLang's
    # absorbed-MLA + fused-MoE decode layer (norms, 5 projections, 2 bmm, rope, cache write,
    # attention, 2 all-reduces, gate, top-k, align, 2 grouped GEMMs, activation, sum, shared
    # expert, fp8 quant).
    "deepseek-r1": replace(from_model_config(published("deepseek-r1"), 1.0, 2.0),
                           lm_head_bytes=2.0, mtp_layers=1, kernels_per_layer=25),
    # Qwen3-Coder-480B-A35B (`model_catalog.py`): weights as in the official -FP8 checkpoint.
    # No MTP module. Kernels: GQA + fused-MoE layer.
    "qwen3-coder-480b": replace(from_model_config(published("qwen3-coder-480b"), 1.0, 2.0),
                                lm_head_bytes=2.0, kernels_per_layer=20),
    # SmolLM2-135M (`model_catalog.py`): bf16 weights as published.
    "smollm2-135m": replace(from_model_config(published("smollm2-135m"), 2.0, 2.0),
                            kernels_per_layer=12),
}


def model_from_name(name: str) -> SimModel:
    """A preset by name; `ConfigError` naming the choices otherwise."""
    if name not in PRESETS:
        raise ConfigError(f"unknown simulator model {name!r}: expected one of {sorted(PRESETS)}")
    return PRESETS[name]


def with_dtype(model: SimModel, weight_bytes: float, kv_bytes: float) -> SimModel:
    """The same shape stored at other precisions (the LM head too: our engine keeps it in the
    weights' dtype)."""
    return replace(model, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
                   lm_head_bytes=weight_bytes)
