"""The names of the ways KV memory reaches the NIC (S5, S5a), defined once.

A caller asks for a path (`MEMORY_PATHS`: "auto" lets `staging.choose_memory_path` pick); a
registered tensor ends up on one of the `MEMORY_PATH_KINDS`. The engine, staging, the
loopback double and `disagg` (its node configs and the check of a peer's handshake) all
import these names from here; nothing else spells them.
"""

from __future__ import annotations

from typing import Literal

MemoryPathKind = Literal["host", "hmem", "staged"]
MemoryPathRequest = Literal["auto", "host", "hmem", "staged"]

# What a tensor's memory is registered as: as is (CPU), through FI_HMEM (CUDA), or through a
# pinned host shadow.
MEMORY_PATH_KINDS: tuple[MemoryPathKind, ...] = ("host", "hmem", "staged")
# What a user may ask for: one of the kinds, or "auto".
MEMORY_PATHS: tuple[MemoryPathRequest, ...] = ("auto", *MEMORY_PATH_KINDS)


def check_memory_path(path: str) -> str:
    """`path` if a caller may ask an engine for it, else a ValueError naming the choices."""
    if path not in MEMORY_PATHS:
        raise ValueError(f"unknown memory_path {path!r}: expected one of {MEMORY_PATHS}")
    return path
