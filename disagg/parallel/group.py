"""The collectives of one node's TP ranks, through `torch.distributed` (S3c).

gloo on CPU, NCCL on CUDA, rendezvous through a file in the node's private directory (no port
to pick, nothing reachable from outside). Only the all-reduce after each row-parallel
projection travels here (on the device with NCCL); the leader's steps go over each rank's Unix
socket (`step.py`). Ranks compute exactly what the leader computes, on their own heads, so
nothing else needs to be said.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective waits this long for a rank before failing: beyond it, a live but stuck rank is
# as good as a dead one (a dead rank's closed sockets fail a collective at once).
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Where the ranks of one node meet: `world_size` processes, the rendezvous file."""

    store_path: str
    world_size: int
    backend: str = "gloo"  # "nccl" for CUDA ranks

    @staticmethod
    def for_device(store_path: str, world_size: int, device: str) -> GroupSpec:
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        return GroupSpec(store_path, world_size, backend)


def join(spec: GroupSpec, rank: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Enter the group as `rank`; returns once every rank has joined."""
    dist.init_process_group(spec.backend, init_method=f"file://{spec.store_path}", rank=rank,
                            world_size=spec.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def leave() -> None:
    """Leave the group (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; returns it."""
    dist.all_reduce(x)
    return x
