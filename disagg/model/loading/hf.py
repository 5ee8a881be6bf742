"""Load a Hugging Face checkpoint directory (config.json + safetensors), whole or one TP rank's
slices, in the dtype asked for (S3b, S3c).

The names and shapes expected are the model's own (`weight_shards.parameter_shapes`): Hugging
Face's state dict without the leading `model.`. Every name and full shape is checked from the
files' headers before a tensor is read (`safetensors_files.py`). Refuses anything it cannot run
exactly with a `ModelLoadError` naming the file and field, rather than loading it approximately;
passes over what transformers ignores too (DeepSeek-V3's multi-token-prediction layers, one
info line).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from disagg.config import ModelConfig
from disagg.errors import ModelLoadError
from disagg.model.loading.hf_config import config_from_hf, mtp_layers
from disagg.model.loading.safetensors_files import (
    StoredTensor,
    list_tensors,
    read_json_object,
    read_tensors,
    weight_files,
)
from disagg.model.loading.tokenizer import Tokenizer
from disagg.model.tensor_parallel import Cut
from disagg.model.weight_shards import parameter_shapes

logger = logging.getLogger(__name__)

_CHAT_TEMPLATE_FILE = "chat_template.jinja"


def check_state_dict(state_dict: dict[str, torch.Tensor], config: ModelConfig,
                     source: str) -> None:
    """Raise `ModelLoadError` naming `source` if a tensor is missing, extra or mis-shaped."""
    check_shapes({name: tuple(t.shape) for name, t in state_dict.items()}, config, source)


def check_shapes(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig, source: str) -> None:
    """`check_state_dict` over names and full shapes alone (a checkpoint's headers)."""
    expected = parameter_shapes(config)
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise ModelLoadError(f"{source}: missing tensor(s) {_few(missing)}")
    extra = [name for name in shapes if name not in expected]
    if extra:
        raise ModelLoadError(f"{source}: unexpected tensor(s) {_few(extra)}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape "
                                 f"{tuple(shapes[name])}, expected {shape}")


def read_hf_config(path: str | Path, name: str | None = None) -> ModelConfig:
    """The checkpoint's `ModelConfig` (config.json and generation_config.json), named `name`
    (default: the directory's name); no tensor is read."""
    return _read_config(Path(path), name)[0]


def _read_config(directory: Path, name: str | None) -> tuple[ModelConfig, dict[str, Any]]:
    """The `ModelConfig` and the parsed config.json it came from."""
    if not directory.is_dir():
        raise ModelLoadError(f"checkpoint directory {directory} does not exist")
    config_file = directory / "config.json"
    raw = _read_json(config_file, required=True) or {}
    generation = _read_json(directory / "generation_config.json", required=False)
    return config_from_hf(raw, generation, source=str(config_file),
                          name=name or directory.name), raw


def read_hf_tokenizer(path: str | Path, config: ModelConfig) -> Tokenizer | None:
    """The checkpoint's `tokenizer.json` with the config's token ids, or None without one."""
    tokenizer_file = Path(path) / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    return Tokenizer.from_file(tokenizer_file, config.bos_token_id, config.eos_token_ids)


def load_hf_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32,
                       cuts: Mapping[str, Cut] | None = None, name: str | None = None,
                       ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """Config, state dict (our names, each tensor cast to `dtype` as it is read) and tokenizer
    (None without `tokenizer.json`). With `cuts` (`weight_shards.rank_cuts`), a weight named
    there is read only as its cut's part: one TP rank's shard, never the full tensor."""
    directory = Path(path)
    config, raw = _read_config(directory, name)
    files, source = weight_files(directory)
    stored = list_tensors(files)
    _drop_mtp_layers(stored, config, mtp_layers(raw), source)
    if config.tie_word_embeddings:
        # Tied checkpoints may still store the (identical) output matrix; the model reuses
        # embed_tokens, so the copy is never read.
        stored.pop("lm_head.weight", None)
    check_shapes({n: where.shape for n, where in stored.items()}, config, source)
    state_dict = read_tensors(stored, cuts or {}, dtype)
    logger.info("loaded %s: %d layers, %d tensors%s", directory, config.num_layers,
                len(state_dict), f" ({len(cuts)} sliced)" if cuts else "")
    return config, state_dict, read_hf_tokenizer(directory, config)


def _drop_mtp_layers(stored: dict[str, StoredTensor], config: ModelConfig, count: int,
                     source: str) -> None:
    """Pass over DeepSeek-V3's multi-token-prediction layers, stored after the decoder layers
    (`layers.{num_layers}.*`, ...): transformers does not load them, and our MTP draft head
    (S8) is a module of its own, so their tensors are never read."""
    prefixes = tuple(f"layers.{config.num_layers + i}." for i in range(count))
    skipped = [name for name in stored if name.startswith(prefixes)]
    for name in skipped:
        del stored[name]
    if skipped:
        logger.info("%s: skipping %d tensors of %d multi-token-prediction layer(s) "
                    "(layers.%d and after), which transformers does not load either", source,
                    len(skipped), count, config.num_layers)


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


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path} is missing")
        return None
    return read_json_object(path)


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")
