"""A short digest of the model a node runs: a prefiller and a decoder must agree on it exactly
before any KV crosses between them (S2: the handshake refuses a mismatch, naming "model").

Every node computes it the same way whatever its TP degree, from what it was asked to load,
without holding a weight: a TP node's process holds only rank 0's shard (S3c). It covers the
shape the node runs (every `ModelConfig` field but the name, so a Hub id and a path to the
same files agree), the weights' dtype, and where the weights come from:
- a checkpoint (a directory or a Hub id): the SHA-256 of each safetensors file's bytes, whole.
  Not its header and size alone: a fine-tune has exactly the base model's names, shapes and
  offsets. Not a sample of chunks: one changed tensor must change the digest. Hashing is read
  in chunks, files in parallel, and remembered per file (path, size, mtime, inode) in the model
  cache, so a restart reads nothing again; a file in the Hub cache is named by that very
  SHA-256 (huggingface_hub stores it as `blobs/<sha256>`), which is used without reading;
- a preset: its seed (the config fixes everything else, `init_random_weights`);
- SmolLM2: the GGUF file's SHA-256.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from disagg.config import PRESETS, ModelConfig
from disagg.model.loading.gguf import find_smollm2_gguf
from disagg.model.loading.gguf_cache import cache_root
from disagg.model.loading.registry import INIT_STD, PRESET_SEED, SMOLLM2_NAME, checkpoint_directory
from disagg.model.loading.safetensors_files import weight_files

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")


def model_fingerprint(spec: str, config: ModelConfig, dtype: torch.dtype) -> str:
    """The digest peers compare at handshake: `spec`'s weights (identified as the module
    docstring says), run with the shape `config` in `dtype`, e.g. ``llama-bfloat16-1f0c...``.

    The same on every node given the same spec and dtype, at any TP degree; no weight is read
    into memory (a checkpoint's files are hashed, once per machine).
    """
    shape = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)
             if field.name != "name"}
    dtype_name = str(dtype).removeprefix("torch.")
    parts = {"config": json.dumps(shape, sort_keys=True, default=_plain), "dtype": dtype_name,
             "weights": weights_identity(spec)}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return f"{config.architecture}-{dtype_name}-{digest[:16]}"


def weights_identity(spec: str) -> list[str]:
    """What `spec`'s weights are, as text: a preset's seed, or each weight file's SHA-256."""
    if spec in PRESETS:
        return [f"random init, seed {PRESET_SEED}, std {INIT_STD}"]
    if spec == SMOLLM2_NAME:
        return [f"gguf {file_sha256(find_smollm2_gguf())}"]
    directory, _ = checkpoint_directory(spec, weights=True)
    files, _ = weight_files(directory)
    workers = max(1, min(len(files), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers, thread_name_prefix="fingerprint") as pool:
        digests = list(pool.map(file_sha256, files))  # hashlib lets go of the GIL as it hashes
    return [f"{file.name} {digest}" for file, digest in zip(files, digests, strict=True)]


def file_sha256(path: Path) -> str:
    """The SHA-256 of the file's bytes: its Hub cache blob name, a remembered digest, or read."""
    resolved = path.resolve()
    if (resolved.parent.name == "blobs" and resolved.parent.parent.name.startswith("models--")
            and _SHA256.fullmatch(resolved.name)):
        return resolved.name  # huggingface_hub names a large file's blob by its SHA-256
    stat = resolved.stat()
    identity = [str(resolved), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns]
    memo = (cache_root() / "digests" /
            hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32])
    try:
        remembered = memo.read_text().strip()
        if _SHA256.fullmatch(remembered):
            return remembered
    except OSError:
        pass  # not hashed here yet
    with resolved.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    _remember(memo, digest)
    return digest


def _remember(memo: Path, digest: str) -> None:
    """Write `digest` as `memo`, renamed into place (a reader never sees half of it)."""
    staging = memo.with_name(f".{memo.name}.{uuid.uuid4().hex}")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        staging.write_text(digest)
        os.replace(staging, memo)
    except OSError as error:
        with contextlib.suppress(OSError):
            staging.unlink(missing_ok=True)
        logger.warning("cannot remember the digest of a weight file in %s (%s): it is read "
                       "again next time", memo.parent, error)


def _plain(value: object) -> object:
    """JSON for what `json` does not know in a config (a nested dataclass, a tuple)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)
