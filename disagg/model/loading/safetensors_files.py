"""A checkpoint's safetensors files, read whole or as one tensor-parallel rank's slices (S3b, S3c).

A checkpoint holds one `model.safetensors`, or shards that `model.safetensors.index.json` names.
Every file is opened with `safetensors.safe_open` (memory-mapped): names and shapes come from
its header, so a checkpoint is checked before any tensor is read, and a rank given its `Cut`s
(`weight_shards.rank_cuts`) reads only its part of each split weight (`get_slice`): a rank of
a large model never holds a full q_proj or down_proj. Each tensor is cast to the target dtype
as soon as it is read. Not here: config.json (`hf_config.py`), finding the directory (`hub.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from disagg.errors import ModelLoadError
from disagg.model.tensor_parallel import Cut

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some older exports saved alongside the weights; the model recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies: its file, its name there (with ``model.``) and its full shape."""

    file: Path
    key: str
    shape: tuple[int, ...]


def weight_files(directory: Path) -> tuple[list[Path], str]:
    """The checkpoint's safetensors files and the name errors give them (the file or index)."""
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file():
        return [single], str(single)
    if not index.is_file():
        raise ModelLoadError(f"{directory}: no weights found (expected {SINGLE_FILE} or "
                             f"{INDEX_FILE}; .bin checkpoints are not supported)")
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"{index}: no 'weight_map' object")
    files = [directory / shard for shard in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{index}: shard {file.name} is missing")
    return files, str(index)


def list_tensors(files: list[Path]) -> dict[str, StoredTensor]:
    """Our name (no ``model.``) -> where the tensor lies, from the files' headers alone."""
    stored: dict[str, StoredTensor] = {}
    for file in files:
        with _open(file) as handle:
            for key in handle.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                shape = tuple(handle.get_slice(key).get_shape())
                stored[key.removeprefix("model.")] = StoredTensor(file, key, shape)
    return stored


def read_tensors(stored: Mapping[str, StoredTensor], cuts: Mapping[str, Cut],
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of `stored` as `dtype`; those named in `cuts` only as the cut's part
    (rank 1 of 2 of a ``[64, 64]`` q_proj, `Cut(0, 32, 64)`: rows 32-63 are all it reads)."""
    by_file: dict[Path, list[str]] = {}
    for name, where in stored.items():
        by_file.setdefault(where.file, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with _open(file) as handle:
            for name in names:
                tensor = _read(handle, stored[name].key, cuts.get(name))
                tensors[name] = tensor.to(dtype)
    return tensors


def _read(handle: Any, key: str, cut: Cut | None) -> torch.Tensor:  # noqa: ANN401
    if cut is None:
        return handle.get_tensor(key)
    # Only the cut's rows (or columns) are copied out of the mapped file.
    index = [slice(None)] * (cut.dim + 1)
    index[cut.dim] = slice(cut.start, cut.stop)
    return handle.get_slice(key)[tuple(index)]


def _open(file: Path) -> Any:  # noqa: ANN401 - safetensors' handle has no public type
    try:
        return safe_open(str(file), framework="pt")
    except Exception as error:  # safetensors raises its own untyped errors on bad files
        raise ModelLoadError(f"{file}: cannot read safetensors: {error}") from error


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path` (an index, a config), or a ModelLoadError naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{path}: cannot parse JSON: {error}") from error
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data
