"""A rank hands its KV memory to the leader in one message, on CPU and CUDA alike (S5a).

The leader's socket is a stream: a hello and an fd sent as two messages can reach it as one
read. Here the rank side writes its whole hand-over before the leader reads anything, which is
the order that broke; the CUDA path runs on CPU over a stand-in cuMem made of memfds.
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch

from disagg.config import CacheConfig
from disagg.errors import RankError
from disagg.model.sharding import Sharding
from disagg.parallel.group import GroupSpec
from disagg.parallel.rank_spec import RankSpec
from disagg.parallel.rank_worker import share_kv
from disagg.parallel.ranks import TPRanks
from disagg.parallel.shared_memory import HostRegion, create_region, map_region, send_message
from transfer_core.cuda import cumem

SHAPE = (2, 4, 2, 4, 2, 8)  # [layers, pages, K/V, page_size, heads, dim]
BUS_ID = "0000:1b:00.0"


class FakeAllocation:
    """A cuMem allocation's stand-in: a memfd rounded up to a 4 KiB 'granularity'."""

    def __init__(self, region: HostRegion, device: int = 0) -> None:
        self.region, self.size, self.device = region, region.nbytes, device

    def as_tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.region.tensor(dtype, shape)


def fake_cumem(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the cuMem calls both sides make; returns the bus ids the leader imported on."""
    imported_on: list[str] = []

    def allocate(nbytes: int, device: int = 0) -> FakeAllocation:
        return FakeAllocation(create_region(-(-nbytes // 4096) * 4096, "fake-cumem"), device)

    def export_allocation(allocation: FakeAllocation) -> tuple[int, str]:
        return os.dup(allocation.region.fd), BUS_ID

    def import_allocation(fd: int, size: int, bus_id: str) -> FakeAllocation:
        imported_on.append(bus_id)
        return FakeAllocation(map_region(fd, size))

    monkeypatch.setattr(cumem, "allocate", allocate)
    monkeypatch.setattr(cumem, "export_allocation", export_allocation)
    monkeypatch.setattr(cumem, "import_allocation", import_allocation)
    return imported_on


def make_spec() -> RankSpec:
    cache = CacheConfig(page_size=4, num_pages=4)
    return RankSpec("tiny", cache, Sharding(2, 4), 1, GroupSpec("", 2), "", node_id="t")


def leader(spec: RankSpec, sock: socket.socket) -> TPRanks:
    """A leader whose one child (rank 1) is this process."""
    child = SimpleNamespace(pid=os.getpid())
    return TPRanks(spec, "", sock, [child], lambda _: None)  # type: ignore[list-item]


@pytest.mark.parametrize("device", ["cpu", "cuda:0"], ids=["memfd", "cumem"])
def test_the_whole_hand_over_is_read_after_the_rank_sent_it(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank sends everything, then the leader reads one message: the hello and its fd,
    nothing left behind, and the leader's tensor is the rank's memory."""
    imported_on = fake_cumem(monkeypatch)
    spec = make_spec()
    rank_side, leader_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with rank_side, leader_side:
        buffer = share_kv(spec, device, rank_side, SHAPE)
        rank, mapped = leader(spec, leader_side)._receive_kv(leader_side)
        leader_side.setblocking(False)
        with pytest.raises(BlockingIOError):
            leader_side.recv(1)  # the hand-over was one message, and it is all read
    assert rank == 1 and tuple(mapped.shape) == SHAPE
    buffer.copy_(torch.arange(buffer.numel(), dtype=buffer.dtype).view(SHAPE))
    assert torch.equal(mapped, buffer)
    assert imported_on == ([BUS_ID] if device != "cpu" else [])


def test_a_hello_without_its_fd_is_refused() -> None:
    """A hello whose fd did not come with it is a RankError, not a wait for a second message."""
    spec = make_spec()
    rank_side, leader_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with rank_side, leader_side:
        send_message(rank_side, {"rank": 1, "pid": os.getpid(), "kind": "cumem", "nbytes": 64,
                                 "shape": [16], "dtype": "torch.float32"})
        with pytest.raises(RankError, match="sent 0 fds"):
            leader(spec, leader_side)._receive_kv(leader_side)
