"""Read a Hugging Face config.json (and generation_config.json) into a `ModelConfig` (S3b, S9).

Refuses, with a `ModelLoadError` naming the file and field, whatever the model cannot run
exactly, rather than running it approximately.
"""

from __future__ import annotations

from typing import Any

from disagg.config import ModelConfig
from disagg.errors import ConfigError, ModelLoadError


def config_from_hf(raw: dict[str, Any], generation: dict[str, Any] | None, source: str,
                   name: str = "custom") -> ModelConfig:
    """A `ModelConfig` from a parsed config.json (old or new rope format) and generation config."""
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or ["LlamaForCausalLM"]
    if model_type != "llama" or "LlamaForCausalLM" not in architectures:
        raise ModelLoadError(f"{source}: not a Llama checkpoint (model_type={model_type!r}, "
                             f"architectures={architectures!r}); only 'llama' is supported")
    for field in ("attention_bias", "mlp_bias"):
        if raw.get(field):
            raise ModelLoadError(f"{source}: {field}=true is unsupported (the model has no biases)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act={raw['hidden_act']!r} is unsupported "
                             "(only 'silu')")
    num_heads = _field(raw, "num_attention_heads", source)
    hidden_size = _field(raw, "hidden_size", source)
    eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
    bos = (generation or {}).get("bos_token_id", raw.get("bos_token_id"))
    try:
        return ModelConfig(
            vocab_size=_field(raw, "vocab_size", source),
            hidden_size=hidden_size,
            intermediate_size=_field(raw, "intermediate_size", source),
            num_layers=_field(raw, "num_hidden_layers", source),
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw, source),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=bos,
            eos_token_ids=_as_ids(eos),
            name=name,
        )
    except ConfigError as error:
        raise ModelLoadError(f"{source}: {error}") from error


def _rope_theta(raw: dict[str, Any], source: str) -> float:
    # Newer transformers write `rope_parameters: {rope_theta, rope_type}`; older ones a top-level
    # `rope_theta` plus an optional `rope_scaling` dict. Only unscaled ("default") RoPE is exact.
    params = raw.get("rope_parameters")
    if params is not None:
        field = "rope_parameters"
        rope_type = params.get("rope_type", "default")
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        field = "rope_scaling"
        scaling = raw.get("rope_scaling") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        theta = raw.get("rope_theta", 10000.0)
    if rope_type != "default":
        raise ModelLoadError(f"{source}: {field} rope_type={rope_type!r} is unsupported "
                             "(only 'default' RoPE without scaling)")
    return float(theta)


def _field(raw: dict[str, Any], name: str, source: str) -> int:
    value = raw.get(name)
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
