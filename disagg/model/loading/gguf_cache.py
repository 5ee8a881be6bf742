"""What `gguf.load_gguf_with_chat_template` makes of a file, kept on disk (S1, loading).

Reading SmolLM2's GGUF takes about 9 s on one core: the `gguf` package builds every element
of the metadata arrays (the 49,152-token vocabulary and its merges) as its own numpy view,
then every tensor is dequantized. A serving cluster loads the model once per node, and a test
run loads it many times, so the first load keeps its result (fp32 safetensors, the tokenizer as
Hugging Face JSON, the config and chat template) and later loads read that back in well under
a second.

An entry is keyed by the GGUF's resolved path, size and modification time, the model name,
and the source of the loading code itself: changing the file or the loader makes a new entry.
It is written under a name of its own and renamed into place, so concurrent loads never read a
half-written entry; the first complete one stays. An entry that cannot be read (truncated,
edited by hand) is logged, rebuilt and replaced; what a load that died left half-written is
swept by the next write. A cache that cannot be written (read-only
home, full disk) is logged and the load goes on from the GGUF. `DISAGG_CACHE_DIR` moves it
(default `$XDG_CACHE_HOME/disagg`, else `~/.cache/disagg`). The front door wants no weights:
`load_gguf_metadata_cached` reads an entry's config and tokenizer files only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from disagg.config import ModelConfig
from disagg.errors import ModelLoadError
from disagg.model.loading import gguf, tokenizer
from disagg.model.loading.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CACHE_ENV = "DISAGG_CACHE_DIR"
_WEIGHTS, _TOKENIZER, _META = "weights.safetensors", "tokenizer.json", "meta.json"

Loaded = tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, str | None]
Described = tuple[ModelConfig, Tokenizer, str | None]  # a `Loaded` without its weights


def cache_root() -> Path:
    """Where entries live: `DISAGG_CACHE_DIR`, else the XDG cache directory's `disagg`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "disagg"


def load_gguf_cached(path: str | Path, name: str = "custom") -> Loaded:
    """`gguf.load_gguf_with_chat_template(path, name)`, from the cache when it holds it."""
    try:
        key = entry_key(Path(path), name)
    except OSError:  # no such file: the loader names the problem (ModelLoadError)
        return gguf.load_gguf_with_chat_template(path, name)
    entry = cache_root() / "gguf" / key
    unreadable = False
    if entry.is_dir():
        try:
            return _read(entry)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError,
                ModelLoadError) as error:
            logger.warning("model cache entry %s is unreadable (%s): rebuilding it", entry, error)
            unreadable = True
    loaded = gguf.load_gguf_with_chat_template(path, name)
    try:
        _write(entry, loaded, str(path), replace=unreadable)
    except OSError as error:
        logger.warning("cannot write the model cache entry %s (%s): loading from the GGUF "
                       "each time", entry, error)
    return loaded


def entry_key(path: Path, name: str) -> str:
    """A digest of what the loaded result depends on."""
    resolved = path.resolve()
    stat = resolved.stat()
    code = b"".join(Path(module.__file__).read_bytes() for module in (gguf, tokenizer)
                    if module.__file__ is not None)
    identity = json.dumps([str(resolved), stat.st_size, stat.st_mtime_ns, name,
                           hashlib.sha256(code).hexdigest()])
    return hashlib.sha256(identity.encode()).hexdigest()[:32]


def load_gguf_metadata_cached(path: str | Path, name: str = "custom") -> Described:
    """The config, tokenizer and chat template of `load_gguf_cached(path, name)`, without the
    weights: from the cache entry's metadata and tokenizer files when it has one (its weights
    file is not opened), else from the GGUF's metadata (`gguf.read_gguf_metadata`: no tensor
    dequantized; no entry is written, since an entry holds the weights)."""
    try:
        entry = cache_root() / "gguf" / entry_key(Path(path), name)
    except OSError:  # no such file: the loader names the problem (ModelLoadError)
        return gguf.read_gguf_metadata(path, name)
    if (entry / _META).is_file():
        try:
            return _read_description(entry)[0]
        except (OSError, ValueError, KeyError, TypeError, ModelLoadError) as error:
            logger.warning("model cache entry %s is unreadable (%s): reading the GGUF's "
                           "metadata", entry, error)
    return gguf.read_gguf_metadata(path, name)


def _read_description(entry: Path) -> tuple[Described, str]:
    """The entry's config, tokenizer and chat template, and the GGUF it was made from."""
    meta = json.loads((entry / _META).read_text())
    fields = dict(meta["config"], eos_token_ids=tuple(meta["config"]["eos_token_ids"]))
    loaded_tokenizer = Tokenizer.from_file(entry / _TOKENIZER, meta["bos_token_id"],
                                           meta["eos_token_ids"])
    return (ModelConfig(**fields), loaded_tokenizer, meta["chat_template"]), meta["source"]


def _read(entry: Path) -> Loaded:
    (config, loaded_tokenizer, chat_template), source = _read_description(entry)
    state_dict = load_file(entry / _WEIGHTS)
    logger.info("loaded %s from the model cache (%d tensors)", source, len(state_dict))
    return config, state_dict, loaded_tokenizer, chat_template


def _sweep(directory: Path) -> None:
    """Remove staging directories (`.KEY.PID.NONCE`, hundreds of MB) of loads that died."""
    # Here, not at the top: importing the transfer core loads its fabric binding, which an
    # engine-only user of the model loader never needs.
    from transfer_core.leftovers import dead_leftover

    for path in directory.glob(".*.*.*"):
        parts = path.name.split(".")
        if len(parts) == 4 and dead_leftover(path, parts[2], directory=True):
            shutil.rmtree(path, ignore_errors=True)


def _write(entry: Path, loaded: Loaded, source: str, replace: bool) -> None:
    """Write `loaded` as `entry`; an entry already there (a concurrent load's) stays, unless
    `replace` (it was unreadable)."""
    config, state_dict, loaded_tokenizer, chat_template = loaded
    entry.parent.mkdir(parents=True, exist_ok=True)
    _sweep(entry.parent)
    staging = entry.parent / f".{entry.name}.{os.getpid()}.{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        save_file(state_dict, staging / _WEIGHTS)
        loaded_tokenizer.save(staging / _TOKENIZER)
        meta = {"config": dataclasses.asdict(config), "source": source,
                "bos_token_id": loaded_tokenizer.bos_token_id,
                "eos_token_ids": list(loaded_tokenizer.eos_token_ids),
                "chat_template": chat_template}
        (staging / _META).write_text(json.dumps(meta))
        if replace:
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.rename(staging, entry)
        except OSError:
            if not (entry / _META).is_file():
                raise  # not a concurrent load's complete entry in the way
    finally:
        shutil.rmtree(staging, ignore_errors=True)
