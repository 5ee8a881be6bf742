"""A node's fabric domains and counter poller run where sysfs says its ranks live (S5b, S3b).

A fake two-NUMA machine (one core per node: this test box has cores 0 and 1) drives the real
builder: a TP 2 prefiller's rank 1 domains run on NUMA 1's core, rank 0's domains and the
counter poller on NUMA 0's; on a GPU machine each rank's domain opens on its own NIC.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from disagg.config import CacheConfig, ParallelConfig, SchedulerConfig
from disagg.node import builder
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.prefill_node import PrefillNode
from tests.disagg.node.test_rank_placement import _switch
from tests.transfer_core.test_topology import FakeSysfs

pytestmark = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0),
                                reason="needs cores 0 and 1 in this process's affinity")


def prefill_config(device: str = "cpu") -> NodeConfig:
    """A TP 2 prefiller of the tiny model, two domains per rank."""
    return NodeConfig("tiny", CacheConfig(page_size=4, num_pages=16),
                      SchedulerConfig(chunk_size=8, max_num_batched_tokens=8,
                                      mode="prefill_only"),
                      ParallelConfig(2), role=NodeRole.PREFILL, node_id="prefill-0",
                      device=device, domains_per_rank=2)


def two_numa_box(root: Path) -> FakeSysfs:
    fake = FakeSysfs(root)
    fake.node(0, "0")
    fake.node(1, "1")
    return fake


def affinity(thread: threading.Thread | None) -> set[int]:
    assert thread is not None and thread.native_id is not None
    return os.sched_getaffinity(thread.native_id)


def test_each_ranks_domains_and_the_poller_follow_sysfs(tmp_path: Path) -> None:
    """Domains 0-1 (rank 0) on core 0, domains 2-3 (rank 1) on core 1, the poller on rank 0's
    core: the builder hands the placement's cores to the engine and the messenger."""
    config = prefill_config()
    placement = builder.node_placement(config, two_numa_box(tmp_path).root)
    assert [(r.numa_node, r.domains, r.cpus) for r in placement.ranks] == [
        (0, (0, 1), (0,)), (1, (2, 3), (1,))]
    node = builder.build_node(config, placement=placement)
    try:
        assert isinstance(node, PrefillNode)
        domains = [affinity(w.thread) for w in node.transfer._domains]  # type: ignore[attr-defined]
        assert domains == [{0}, {0}, {1}, {1}]
        assert affinity(node.messenger.streamer._poller._thread) == {0}
    finally:
        node.close()


def test_each_gpu_ranks_domain_opens_on_its_own_nic(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU machine (a GPU and an RDMA NIC per NUMA node) the engine is asked for rank
    r's NIC and NUMA node's core per domain (no such NIC here: the call is recorded)."""
    fake = two_numa_box(tmp_path)
    _switch(fake, 0x10, numa=0, gpus=1, nics=["mlx5_0"])
    _switch(fake, 0x80, numa=1, gpus=1, nics=["mlx5_1"])
    config = prefill_config("cuda")
    asked: dict[str, Any] = {}
    monkeypatch.setattr(builder, "TransferEngine", lambda provider, node, num_domains, **kwargs:
                        asked.update(kwargs, num_domains=num_domains))
    monkeypatch.setattr(builder, "open_engine", lambda make, want_hmem: make(want_hmem))
    builder.open_transfer(config, builder.node_placement(config, fake.root))
    assert asked["nics"] == ["mlx5_0", "mlx5_1"]
    assert asked["domain_cpus"] == [(0,), (1,)]
    assert asked["num_domains"] == 2  # one per NIC: domains_per_rank is for stand-ins
