"""What a TP rank process is told at start, and what it tells its leader back (S5a).

The leader pickles a `RankSpec` into the rank's stdin (a child it just started: trusted),
then keeps the pipe open: its end is how the rank knows the leader is alive. The rank answers
over the leader's Unix socket with a `RankHello` (JSON) and the fd of its KV memory, both in
one message: on a stream socket two messages can reach the leader as one read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from disagg.config import CacheConfig
from disagg.errors import RankError
from disagg.model.sharding import Sharding
from disagg.parallel.group import GroupSpec


@dataclass(frozen=True)
class RankSpec:
    """One rank of a node: the model to load, its cache, its place in the group."""

    model: str  # the node's --model spec; every rank loads it and keeps its own shard
    cache: CacheConfig
    sharding: Sharding
    rank: int
    group: GroupSpec
    socket_path: str  # the leader's Unix socket: where the KV memory's fd goes
    device: str = "cpu"  # the node's device; rank r runs on `rank_device(device, r)`
    threads: int | None = None
    node_id: str = "node"
    dtype: torch.dtype = torch.float32  # of the weights and activations (`model/precision.py`)


def rank_device(device: str, rank: int) -> str:
    """Rank r of a node on `cuda:B` (or `cuda`: B = 0) runs on `cuda:B+r`; CPU ranks on cpu."""
    parsed = torch.device(device)
    if parsed.type != "cuda":
        return device
    return f"cuda:{(parsed.index or 0) + rank}"


@dataclass(frozen=True, slots=True)
class RankHello:
    """A rank's one message: who it is and the KV memory it sends (its fd rides with it)."""

    rank: int
    pid: int
    kind: str  # "memfd" (host memory) or "cumem" (the fd is a cuMem export)
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    pci_bus_id: str = ""  # cumem: the GPU that holds it (ordinals differ between processes)

    def to_header(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_header(header: dict[str, Any]) -> RankHello:
        try:
            hello = RankHello(**header)
            return RankHello(int(hello.rank), int(hello.pid), str(hello.kind),
                             int(hello.nbytes), tuple(int(n) for n in hello.shape),
                             str(hello.dtype), str(hello.pci_bus_id))
        except (TypeError, ValueError) as error:
            raise RankError(f"bad rank hello {header!r}: {error}") from None
