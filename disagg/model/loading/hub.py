"""Hugging Face Hub ids as `--model`: `Qwen/Qwen3-0.6B` becomes a snapshot directory of the
local Hub cache, downloaded into it first when it is missing and the Hub may be reached (S9a, S9b).

The cache is huggingface_hub's own (`HF_HUB_CACHE`, else `HF_HOME/hub`), so a model fetched by
`hf download` or transformers is found, and what we fetch serves them too. The cache is looked
at first: a cached model starts without a network call. Only the files the loaders read are
fetched (`TOKENIZER_FILES`, `WEIGHT_FILES`: never `.bin`, ONNX or GGUF copies), with
huggingface_hub's own progress bars. With `HF_HUB_OFFLINE=1` nothing touches the network.
Not here: reading those files (`hf.py`, `safetensors_files.py`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from disagg.errors import ModelLoadError

logger = logging.getLogger(__name__)

# What the front door needs (config, tokenizer, chat template), and what the nodes add.
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", "chat_template.jinja")
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_hub_id(spec: str) -> bool:
    """`owner/name` that is not a path on this machine (a directory of that name wins)."""
    return (_HUB_ID.fullmatch(spec) is not None and ".." not in spec and "--" not in spec
            and not Path(spec).expanduser().exists())


def hub_cache_dir() -> Path:
    """The Hub cache as huggingface_hub finds it, read from the environment now (huggingface_hub
    reads it once, at import)."""
    hub_cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if hub_cache:
        return Path(hub_cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) as set now, or as huggingface_hub read it."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or flag.strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_snapshot(repo_id: str, *, weights: bool = True) -> Path:
    """The directory of `repo_id`'s files (`main`), from the cache, else downloaded into it.

    `weights=False` wants only the config and tokenizer files (the front door's share).
    """
    from huggingface_hub import snapshot_download

    patterns = [*TOKENIZER_FILES, *(WEIGHT_FILES if weights else ())]
    cache_dir = hub_cache_dir()
    cached = _cached_snapshot(repo_id, patterns, cache_dir, weights)
    if cached is not None:
        return cached
    what = "" if weights else " (config and tokenizer)"
    if hub_offline():
        raise ModelLoadError(f"model {repo_id!r}{what} is not in the Hugging Face cache "
                             f"{cache_dir} and HF_HUB_OFFLINE is set: run `hf download "
                             f"{repo_id}` where the Hub can be reached, or unset HF_HUB_OFFLINE")
    logger.info("downloading %s%s from the Hugging Face Hub into %s", repo_id, what, cache_dir)
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=patterns, cache_dir=cache_dir))
    except (OSError, ValueError) as error:  # the Hub's errors are OSErrors; a bad id ValueError
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ModelLoadError(f"model {repo_id!r}: cannot download it from the Hugging Face Hub: "
                             f"{type(error).__name__}: {first_line}") from error
    missing = _missing(path, weights)
    if missing:
        raise ModelLoadError(f"model {repo_id!r} on the Hugging Face Hub has no {missing}: "
                             "not a safetensors checkpoint we can read")
    return path


def _cached_snapshot(repo_id: str, patterns: list[str], cache_dir: Path,
                     weights: bool) -> Path | None:
    """The cached snapshot if it holds everything we read, else None. Never the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=patterns, cache_dir=cache_dir,
                                      local_files_only=True))
    except LocalEntryNotFoundError:  # also IncompleteSnapshotError, its subclass
        return None
    # A snapshot an earlier tool filled in part (transformers' AutoConfig fetches config.json
    # alone) is there but incomplete; huggingface_hub cannot always tell.
    missing = _missing(path, weights)
    if missing:
        logger.info("cached snapshot %s has no %s", path, missing)
        return None
    return path


def _missing(path: Path, weights: bool) -> str:
    """The first required file `path` lacks, or "" when it has them all."""
    if not (path / "config.json").is_file():
        return "config.json"
    if not weights or (path / "model.safetensors").is_file():
        return ""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return "model.safetensors or model.safetensors.index.json"
    try:
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return ""  # the loader names what is wrong with the index
    absent = sorted(shard for shard in shards if not (path / shard).is_file())
    return absent[0] if absent else ""
