"""Read a Hugging Face config.json (and generation_config.json) into a `ModelConfig` (S3b, S9).

One reader for every architecture the model runs: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and
DeepSeek-V3, each read as its transformers modelling file reads it (which fields it uses, and
its config class's defaults for those a file leaves out). Whatever the model cannot run exactly
(a sliding window shorter than the context, another activation, longrope, quantized weights,
...) is refused with a `ModelLoadError` naming the file and field, rather than run approximately.
DeepSeek-V3's multi-token-prediction layers, which transformers does not load either, are
counted here (`mtp_layers`) so that the loader can pass over their tensors.
"""

from __future__ import annotations

from typing import Any

from disagg.config import ModelConfig
from disagg.errors import ConfigError, ModelLoadError
from disagg.model_config import Architecture, MLAConfig, MoEConfig, RopeScaling

# Each supported `architectures` value, and the `model_type` that goes with it.
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3",
}
# The config classes' defaults where a config.json leaves a field out.
_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768,
                  "qwen3_moe": 32768, "deepseek_v3": 4096}
_QWEN3_HEAD_DIM = 128


def config_from_hf(raw: dict[str, Any], generation: dict[str, Any] | None, source: str,
                   name: str = "custom") -> ModelConfig:
    """A `ModelConfig` from a parsed config.json (old or new rope format) and generation config."""
    arch = _architecture(raw, source)
    _check_unquantized(raw, source)
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act={raw['hidden_act']!r} is unsupported "
                             "(only 'silu')")
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{source}: mlp_bias=true is unsupported (the MLP has no biases)")
    num_heads = _field(raw, "num_attention_heads", source)
    hidden_size = _field(raw, "hidden_size", source)
    trained_length = _field(raw, "max_position_embeddings", source, _MAX_POSITIONS[arch])
    theta, scaling = _rope(raw, source, trained_length)
    # Dynamic NTK exists to run past the trained length (its base grows from there on), so
    # the context served is factor times it, as vLLM does; the rope keeps the trained length.
    max_positions = (int(trained_length * scaling.factor)
                     if scaling is not None and scaling.rope_type == "dynamic" else trained_length)
    _check_full_attention(raw, arch, source, max_positions)
    head_dim = raw.get("head_dim") or (_QWEN3_HEAD_DIM if arch == "qwen3"
                                       else hidden_size // num_heads)
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    mla = _mla(raw, source) if arch == "deepseek_v3" else None
    if mla is not None:  # the cache's one "head" is the latent row (model_config.py)
        num_kv_heads, head_dim = 1, mla.latent_dim
    # Qwen2 biases Q, K and V always and o_proj never; Llama, Qwen3 and DeepSeek's
    # attention_bias biases every projection; Mistral's modelling has no biases at all.
    q_bias = arch == "qwen2" or (arch != "mistral" and bool(raw.get("attention_bias")))
    eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
    bos = (generation or {}).get("bos_token_id", raw.get("bos_token_id"))
    try:
        return ModelConfig(
            vocab_size=_field(raw, "vocab_size", source),
            hidden_size=hidden_size,
            intermediate_size=_field(raw, "intermediate_size", source),
            num_layers=_field(raw, "num_hidden_layers", source),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=bos,
            eos_token_ids=_as_ids(eos),
            name=name,
            architecture=arch,
            attention_bias=q_bias,
            o_proj_bias=q_bias and arch != "qwen2",
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            rope_scaling=scaling,
            moe=_moe(raw, arch, source),
            mla=mla,
        )
    except ConfigError as error:
        raise ModelLoadError(f"{source}: {error}") from error


def _architecture(raw: dict[str, Any], source: str) -> Architecture:
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or [
        cls for cls, arch in ARCHITECTURES.items() if arch == model_type]
    known = [ARCHITECTURES[cls] for cls in architectures if cls in ARCHITECTURES]
    if not known or known[0] != model_type:
        raise ModelLoadError(f"{source}: unsupported checkpoint (model_type={model_type!r}, "
                             f"architectures={architectures!r}); supported architectures: "
                             f"{', '.join(ARCHITECTURES)}")
    return known[0]


def mtp_layers(raw: dict[str, Any]) -> int:
    """How many multi-token-prediction layers follow the decoder layers in the checkpoint
    (DeepSeek-V3's `num_nextn_predict_layers`, 1 when left out as in transformers' config; 0
    for the other architectures). Their tensors are `model.layers.{num_hidden_layers + i}.*`."""
    if raw.get("model_type") != "deepseek_v3":
        return 0
    count = raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 1))
    return count if isinstance(count, int) and count > 0 else 0


def _check_unquantized(raw: dict[str, Any], source: str) -> None:
    """Refuse quantized checkpoints (DeepSeek-V3/R1's fp8 weights with `weight_scale_inv`
    block scales, GPTQ, AWQ, ...): the loader reads plain tensors and never dequantizes."""
    quantization = raw.get("quantization_config")
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    raise ModelLoadError(f"{source}: quantization_config (quant_method={method!r}) is "
                         "unsupported: only unquantized float32, bfloat16 or float16 weights are "
                         "loaded (we do not dequantize; use a BF16 copy of the checkpoint)")


def _check_full_attention(raw: dict[str, Any], arch: Architecture, source: str,
                          max_positions: int) -> None:
    """Refuse windowed attention, which the model does not implement, naming the field."""
    if arch == "mistral":
        window = raw.get("sliding_window")
        if window is not None and window < max_positions:
            raise ModelLoadError(f"{source}: sliding_window={window} is unsupported: windowed "
                                 f"attention is not implemented (null or >= the context of "
                                 f"{max_positions} positions runs as full attention)")
    elif arch in ("qwen2", "qwen3", "qwen3_moe"):
        if raw.get("use_sliding_window"):
            raise ModelLoadError(f"{source}: use_sliding_window=true is unsupported (windowed "
                                 "attention is not implemented)")
        windowed = [kind for kind in raw.get("layer_types") or [] if kind != "full_attention"]
        if windowed:
            raise ModelLoadError(f"{source}: layer_types {sorted(set(windowed))} are "
                                 "unsupported (only 'full_attention')")


def _rope(raw: dict[str, Any], source: str, trained_length: int,
          ) -> tuple[float, RopeScaling | None]:
    # Newer transformers write `rope_parameters: {rope_theta, rope_type, ...}`; older ones a
    # top-level `rope_theta` and an optional `rope_scaling` dict (whose type may be "type").
    field = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = dict(raw.get(field) or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"{source}: partial_rotary_factor={partial} is unsupported (RoPE "
                             "rotates every dimension of the head)")
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "dynamic", "yarn", "llama3"):
        raise ModelLoadError(f"{source}: {field} rope_type={rope_type!r} is unsupported "
                             "(default, linear, dynamic, yarn, llama3)")

    def number(key: str, default: float | None = None) -> float | None:
        value = params.get(key)
        if value is None and default is None and key in _REQUIRED[rope_type]:
            raise ModelLoadError(f"{source}: {field} {key} is required for rope_type "
                                 f"{rope_type!r}")
        return default if value is None else float(value)

    # transformers: a top-level original_max_position_embeddings wins, then the rope dict's,
    # then the model's own length.
    original = raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings") or trained_length
    if rope_type == "dynamic":
        original = trained_length  # dynamic NTK grows from the model's own length
    factor = number("factor", trained_length / original if rope_type == "yarn" else None)
    try:
        return theta, RopeScaling(
            rope_type=rope_type, factor=factor,
            original_max_position_embeddings=None if rope_type == "linear" else int(original),
            low_freq_factor=number("low_freq_factor", 1.0 if rope_type != "llama3" else None),
            high_freq_factor=number("high_freq_factor", 4.0 if rope_type != "llama3" else None),
            beta_fast=number("beta_fast", 32.0), beta_slow=number("beta_slow", 1.0),
            mscale=number("mscale"), mscale_all_dim=number("mscale_all_dim"),
            attention_factor=number("attention_factor"),
            truncate=bool(params.get("truncate", True)))
    except ConfigError as error:
        raise ModelLoadError(f"{source}: {field}: {error}") from error


_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": (),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def _moe(raw: dict[str, Any], arch: Architecture, source: str) -> MoEConfig | None:
    try:
        if arch == "qwen3_moe":
            experts = raw.get("num_experts", raw.get("num_local_experts"))
            return MoEConfig(
                num_experts=_field({"num_experts": experts}, "num_experts", source),
                num_experts_per_tok=_field(raw, "num_experts_per_tok", source),
                moe_intermediate_size=_field(raw, "moe_intermediate_size", source),
                routing="softmax", norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                decoder_sparse_step=_field(raw, "decoder_sparse_step", source, 1),
                mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()))
        if arch == "deepseek_v3":
            for key, expected in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"),
                                  ("moe_layer_freq", 1)):
                if raw.get(key, expected) != expected:
                    raise ModelLoadError(f"{source}: {key}={raw[key]!r} is unsupported "
                                         f"(DeepSeek-V3 routes with {key}={expected!r})")
            return MoEConfig(
                num_experts=_field(raw, "n_routed_experts", source),
                num_experts_per_tok=_field(raw, "num_experts_per_tok", source),
                moe_intermediate_size=_field(raw, "moe_intermediate_size", source),
                routing="sigmoid_grouped", norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                num_shared_experts=_field(raw, "n_shared_experts", source, 1),
                n_group=_field(raw, "n_group", source, 8),
                topk_group=_field(raw, "topk_group", source, 4),
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
                first_dense_layers=_field(raw, "first_k_dense_replace", source, 3))
    except ConfigError as error:
        raise ModelLoadError(f"{source}: {error}") from error
    return None


def _mla(raw: dict[str, Any], source: str) -> MLAConfig:
    q_lora_rank = raw.get("q_lora_rank")
    try:
        return MLAConfig(
            kv_lora_rank=_field(raw, "kv_lora_rank", source),
            qk_nope_head_dim=_field(raw, "qk_nope_head_dim", source),
            qk_rope_head_dim=_field(raw, "qk_rope_head_dim", source),
            v_head_dim=_field(raw, "v_head_dim", source),
            q_lora_rank=None if q_lora_rank is None else _field(raw, "q_lora_rank", source),
            rope_interleave=bool(raw.get("rope_interleave", True)))
    except ConfigError as error:
        raise ModelLoadError(f"{source}: {error}") from error


def _field(raw: dict[str, Any], name: str, source: str, default: int | None = None) -> int:
    value = raw.get(name)
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelLoadError(f"{source}: field {name!r} is missing or not an integer "
                             f"(got {value!r})")
    return value


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
