"""A short digest of a model's shape and weights: a prefiller and a decoder must agree on it
exactly before any KV crosses between them (S2: the handshake refuses a mismatch)."""

from __future__ import annotations

import hashlib
from dataclasses import fields

import torch

from disagg.model.loading.registry import LoadedModel


def model_fingerprint(loaded: LoadedModel) -> str:
    """A short digest of the model's shape and weights: peers must agree on it exactly."""
    digest = hashlib.sha256()
    for f in fields(loaded.config):
        digest.update(f"{f.name}={getattr(loaded.config, f.name)};".encode())
    for name in sorted(loaded.state_dict):
        tensor = loaded.state_dict[name].reshape(-1)
        # A strided sample of every tensor: enough to tell checkpoints apart, cheap to hash.
        sample = tensor[:: max(1, tensor.numel() // 256)].to(torch.float32).contiguous()
        digest.update(name.encode())
        digest.update(sample.numpy().tobytes())
    return f"{loaded.config.name}-{digest.hexdigest()[:16]}"
