"""The shape of a decoder-only model: attention, feed-forward, RoPE and presets (S3b, S9).

One `ModelConfig` describes every architecture the engine runs: Llama, Mistral, Qwen2 (biases on
Q/K/V), Qwen3 (RMSNorm over each query and key head) and two mixture-of-experts families,
Qwen3-MoE and DeepSeek-V3 (`MoEConfig`), the latter with Multi-head Latent Attention
(`MLAConfig`). Frozen and validated on construction, so a bad value fails where it is written.

`num_kv_heads` and `head_dim` always describe what the paged cache stores per token and layer.
For grouped-query attention that is each KV head's key and value (`kv_parts` 2). MLA stores one
row per token: the normalised latent `c_KV` followed by the RoPE key shared by every head, so
its cache has one "head" of `kv_lora_rank + qk_rope_head_dim` values and no V (`kv_parts` 1).
That row is the same on every tensor-parallel rank (S9a).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from disagg.errors import ConfigError

Architecture = Literal["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]
ARCHITECTURES: tuple[Architecture, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
                                           "deepseek_v3")
RopeType = Literal["linear", "dynamic", "yarn", "llama3"]
ROPE_TYPES: tuple[RopeType, ...] = ("linear", "dynamic", "yarn", "llama3")
# Qwen3-MoE: softmax over every expert, top-k. DeepSeek-V3: sigmoid scores, a bias that only
# steers the choice, top-k within the best groups.
Routing = Literal["softmax", "sigmoid_grouped"]
ROUTINGS: tuple[Routing, ...] = ("softmax", "sigmoid_grouped")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling as transformers' `rope_parameters` define it (`model/rope.py`).

    Fields a type does not use keep their defaults; `None` means "transformers' default for
    this type" (for yarn's `attention_factor`, 0.1 ln(factor) + 1).
    """

    rope_type: RopeType
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn (DeepSeek)
    mscale_all_dim: float | None = None  # yarn (DeepSeek)
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"unknown rope_type {self.rope_type!r}: expected one of {ROPE_TYPES}")
        if self.factor <= 0:
            raise ConfigError(f"rope factor must be positive, got {self.factor}")
        original = self.original_max_position_embeddings
        if original is not None and original <= 0:
            raise ConfigError(f"rope original_max_position_embeddings must be positive, got "
                              f"{original}")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture-of-experts feed-forward (`model/moe.py`): which layers, how tokens route."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routing: Routing = "softmax"
    norm_topk_prob: bool = True
    num_shared_experts: int = 0  # DeepSeek: experts every token goes through
    n_group: int = 1  # DeepSeek: experts form groups; only the best `topk_group` are routed to
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_dense_layers: int = 0  # DeepSeek's first_k_dense_replace: these layers stay dense
    decoder_sparse_step: int = 1  # Qwen3-MoE: every step-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # Qwen3-MoE: dense layers by index

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ConfigError(f"unknown MoE routing {self.routing!r}: expected one of {ROUTINGS}")
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
                     "topk_group", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"MoE {name} must be positive, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"MoE routes each token to {self.num_experts_per_tok} experts of "
                              f"{self.num_experts}")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(f"MoE n_group={self.n_group} must divide {self.num_experts} experts "
                              f"and be >= topk_group={self.topk_group}")

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` runs the experts (else the dense MLP)."""
        if layer_idx < self.first_dense_layers or layer_idx in self.mlp_only_layers:
            return False
        return (layer_idx + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head Latent Attention's dimensions (DeepSeek-V2/V3, `model/latent_attention.py`)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: queries come from one projection, no low rank
    rope_interleave: bool = True  # DeepSeek's checkpoints pair RoPE dims (0,1), (2,3), ...

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"MLA {name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"MLA q_lora_rank must be positive or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"MLA qk_rope_head_dim={self.qk_rope_head_dim} must be even")

    @property
    def qk_head_dim(self) -> int:
        """Width of one query (and up-projected key) head: the no-RoPE part, then the RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the cache stores per token and layer: c_KV, then the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a decoder-only transformer (see the module docstring for the cache fields)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "custom"
    architecture: Architecture = "llama"
    attention_bias: bool = False  # biases on the Q, K and V projections (Qwen2, ...)
    o_proj_bias: bool = False  # and on o_proj (Llama's and Qwen3's attention_bias, not Qwen2)
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head, before RoPE
    rope_scaling: RopeScaling | None = None
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None

    def __post_init__(self) -> None:
        for attr in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, attr) <= 0:
                raise ConfigError(f"model {self.name}: {attr} must be positive, got "
                                  f"{getattr(self, attr)}")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"model {self.name}: unknown architecture {self.architecture!r}: "
                              f"expected one of {ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model {self.name}: num_heads={self.num_heads} is not a multiple "
                              f"of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"model {self.name}: head_dim={self.head_dim} must be even for RoPE")
        if self.mla is not None and (self.num_kv_heads, self.head_dim) != (1, self.mla.latent_dim):
            raise ConfigError(f"model {self.name}: with MLA the cache stores one latent row per "
                              f"token: num_kv_heads must be 1 and head_dim "
                              f"{self.mla.latent_dim} (kv_lora_rank + qk_rope_head_dim), got "
                              f"{self.num_kv_heads} and {self.head_dim}")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (1 for MHA, num_heads for MQA and MLA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_parts(self) -> int:
        """Tensors the cache stores per token: K and V (2), or MLA's one latent row (1)."""
        return 1 if self.mla is not None else 2

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates per head: every one, or MLA's shared RoPE part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def kv_values_per_token_layer(self) -> int:
        """Values the cache holds per token and layer (times the KV dtype's size: bytes)."""
        return self.kv_parts * self.num_kv_heads * self.head_dim

    @staticmethod
    def from_name(name: str) -> ModelConfig:
        """A named random-init preset, e.g. `ModelConfig.from_name("tiny")`."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}: expected one of {sorted(PRESETS)}")
        return PRESETS[name]


# Random-init presets. `tiny` has 4 KV heads so TP degrees 1, 2 and 4 divide it. The last two
# are S9's deployments at toy size: `tiny-mla-moe` is DeepSeek-V3's shape (MLA, a dense first
# layer, then shared + routed experts with grouped sigmoid routing), `tiny-qwen3-moe` is
# Qwen3-Coder's (GQA with q/k norms, softmax-routed experts). Every TP degree up to 4 divides
# their heads, intermediate sizes and experts.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=8, num_kv_heads=4, head_dim=8, eos_token_ids=(0,),
                        max_position_embeddings=4096, name="tiny"),
    "small": ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_layers=4,
                         num_heads=8, num_kv_heads=8, head_dim=32, eos_token_ids=(0,),
                         max_position_embeddings=4096, name="small"),
    "tiny-mla-moe": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
        num_kv_heads=1, head_dim=40, rms_norm_eps=1e-6, eos_token_ids=(0,),
        max_position_embeddings=4096, name="tiny-mla-moe", architecture="deepseek_v3",
        moe=MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      routing="sigmoid_grouped", num_shared_experts=1, n_group=2,
                      topk_group=1, routed_scaling_factor=2.5, first_dense_layers=1),
        mla=MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16, q_lora_rank=24)),
    "tiny-qwen3-moe": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
        num_kv_heads=4, head_dim=16, rms_norm_eps=1e-6, eos_token_ids=(0,),
        max_position_embeddings=4096, name="tiny-qwen3-moe", architecture="qwen3_moe",
        qk_norm=True,
        moe=MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)),
}
