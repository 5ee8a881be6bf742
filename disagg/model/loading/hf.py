"""Load a Hugging Face checkpoint directory (config.json + safetensors) into fp32 tensors.

The names and shapes expected are the model's own (`weight_shards.parameter_shapes`): Hugging
Face's state dict without the leading `model.`. Refuses anything it cannot run exactly with a
`ModelLoadError` naming the file and field, rather than loading it approximately.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from disagg.config import ModelConfig
from disagg.errors import ModelLoadError
from disagg.model.loading.hf_config import config_from_hf
from disagg.model.loading.tokenizer import Tokenizer
from disagg.model.weight_shards import parameter_shapes

logger = logging.getLogger(__name__)

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Buffers some older exports saved alongside the weights; the model recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_state_dict(state_dict: dict[str, torch.Tensor], config: ModelConfig,
                     source: str) -> None:
    """Raise `ModelLoadError` naming `source` if a tensor is missing, extra or mis-shaped."""
    expected = parameter_shapes(config)
    missing = [name for name in expected if name not in state_dict]
    if missing:
        raise ModelLoadError(f"{source}: missing tensor(s) {_few(missing)}")
    extra = [name for name in state_dict if name not in expected]
    if extra:
        raise ModelLoadError(f"{source}: unexpected tensor(s) {_few(extra)}")
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape "
                                 f"{tuple(state_dict[name].shape)}, expected {shape}")


def load_hf_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor],
                                                  Tokenizer | None]:
    """Config, fp32 state dict (our names) and tokenizer (None without `tokenizer.json`)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"checkpoint directory {directory} does not exist")
    config_file = directory / "config.json"
    raw = _read_json(config_file, required=True)
    generation = _read_json(directory / "generation_config.json", required=False)
    config = config_from_hf(raw, generation, source=str(config_file), name=directory.name)
    state_dict = _load_tensors(directory, config)
    tokenizer_file = directory / "tokenizer.json"
    tokenizer = None
    if tokenizer_file.is_file():
        tokenizer = Tokenizer.from_file(tokenizer_file, config.bos_token_id, config.eos_token_ids)
    logger.info("loaded %s: %d layers, %d tensors", directory, config.num_layers, len(state_dict))
    return config, state_dict, tokenizer


def read_hf_chat_template(directory: str | Path) -> str | None:
    """The checkpoint's chat template as transformers finds it, or None.

    `chat_template.jinja` wins over `tokenizer_config.json`'s `chat_template`, which is a string
    or a list of `{"name", "template"}` entries whose "default" one is used.
    """
    jinja_file = Path(directory) / _CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    config_file = Path(directory) / "tokenizer_config.json"
    value = (_read_json(config_file, required=False) or {}).get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(entry, dict) for entry in value):
        raise ModelLoadError(f"{config_file}: chat_template must be a string or a list of "
                             "{name, template} objects")
    named = {entry.get("name"): entry.get("template") for entry in value}
    if isinstance(named.get("default"), str):
        return named["default"]
    logger.warning("%s: no 'default' among the chat templates %s; chat is disabled",
                   config_file, sorted(map(str, named)))
    return None


def _load_tensors(directory: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single, index = directory / _SINGLE_FILE, directory / _INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = _read_json(index, required=True).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no 'weight_map' object")
        files = [directory / shard for shard in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{index}: shard {file.name} is missing")
    else:
        raise ModelLoadError(f"{directory}: no weights found (expected {_SINGLE_FILE} or "
                             f"{_INDEX_FILE}; .bin checkpoints are not supported)")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except Exception as error:  # safetensors raises its own untyped errors on bad files
            raise ModelLoadError(f"{file}: cannot read safetensors: {error}") from error
        for name, tensor in tensors.items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            state_dict[name.removeprefix("model.")] = tensor.to(torch.float32)
    if config.tie_word_embeddings:
        # Tied checkpoints may still store the (identical) output matrix; the model reuses
        # embed_tokens, so the copy is dropped.
        state_dict.pop("lm_head.weight", None)
    check_state_dict(state_dict, config, source=str(files[0] if len(files) == 1 else index))
    return state_dict


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path} is missing")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{path}: cannot parse JSON: {error}") from error
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")
