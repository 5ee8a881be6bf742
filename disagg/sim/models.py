"""Model shapes for the cluster simulator: parameter, FLOP and KV byte counts (S1, S9).

Presets for DeepSeek-R1 (MLA attention, 256-expert MoE), Qwen3-Coder-480B-A35B (GQA, 160-expert
MoE) and SmolLM2-135M (dense Llama), each constant copied from the model's published
`config.json` or paper. This is arithmetic on shapes, not a model you can run: the engine's
runnable `ModelConfig` converts here with `from_model_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from disagg.config import ModelConfig
from disagg.errors import ConfigError

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
    """The simulator's view of an engine `ModelConfig` (a dense Llama; fp32 by default)."""
    return SimModel(name=config.name, num_layers=config.num_layers,
                    hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                    num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                    head_dim=config.head_dim, intermediate_size=config.intermediate_size,
                    num_dense_layers=config.num_layers,
                    tie_word_embeddings=config.tie_word_embeddings, weight_bytes=weight_bytes,
                    kv_bytes=kv_bytes, lm_head_bytes=weight_bytes)


PRESETS: dict[str, SimModel] = {
    # DeepSeek-V3 config.json (deepseek-ai/DeepSeek-R1 on Hugging Face; R1 shares V3's shape):
    # 61 layers, 3 dense, 256 routed + 1 shared expert, top-8, MLA with a 512 latent and
    # 64-dim RoPE key; fp8 (e4m3) weights as published. MTP: one module (V3 report §2.2),
    # used for speculative decoding. Kernel count: SGLang's absorbed-MLA + fused-MoE decode
    # layer (norms, 5 projections, 2 bmm, rope, cache write, attention, 2 all-reduces,
    # gate, top-k, align, 2 grouped GEMMs, activation, sum, shared expert, fp8 quant).
    "deepseek-r1": SimModel(
        name="deepseek-r1", num_layers=61, hidden_size=7168, vocab_size=129280,
        num_heads=128, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432,
        num_dense_layers=3, num_experts=256, num_experts_per_token=8, num_shared_experts=1,
        moe_intermediate_size=2048, weight_bytes=1.0, kv_bytes=2.0, mtp_layers=1,
        kernels_per_layer=25),
    # Qwen/Qwen3-Coder-480B-A35B-Instruct config.json: 62 layers, GQA 96 query / 8 KV heads
    # of 128, 160 experts top-8 (no shared expert), moe_intermediate_size 2560. Weights as
    # in the official -FP8 checkpoint. No MTP module. Kernels: GQA + fused-MoE layer.
    "qwen3-coder-480b": SimModel(
        name="qwen3-coder-480b", num_layers=62, hidden_size=6144, vocab_size=151936,
        num_heads=96, num_kv_heads=8, head_dim=128, num_experts=160, num_experts_per_token=8,
        moe_intermediate_size=2560, weight_bytes=1.0, kv_bytes=2.0, kernels_per_layer=20),
    # HuggingFaceTB/SmolLM2-135M config.json: 30 layers, hidden 576, 9 heads / 3 KV heads of
    # 64, intermediate 1536, vocab 49152, tied embeddings; bf16 weights as published.
    "smollm2-135m": SimModel(
        name="smollm2-135m", num_layers=30, hidden_size=576, vocab_size=49152, num_heads=9,
        num_kv_heads=3, head_dim=64, intermediate_size=1536, num_dense_layers=30,
        tie_word_embeddings=True, weight_bytes=2.0, kv_bytes=2.0, kernels_per_layer=12),
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
