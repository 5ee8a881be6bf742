"""Tests of `disagg.node.rank_placement` on fake sysfs trees (S5b, S6a, S9a)."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.errors import ConfigError
from disagg.node.rank_placement import NodePlacement, plan_placement
from tests.transfer_core.test_topology import FakeSysfs
from transfer_core.topology import detect_topology


def _switch(fake: FakeSysfs, index: int, numa: int, gpus: int, nics: list[str | None],
            ib: bool = True) -> None:
    """One PCIe switch with `gpus` GPUs and one NIC per name in `nics`, under root complex
    `index` (so switches never share a bridge)."""
    up = [f"pci0000:{index:02x}", f"0000:{index:02x}:01.0", f"0000:{index:02x}:02.0"]
    for g in range(gpus):
        fake.gpu([*up, f"0000:{index:02x}:03.{g}"], numa=numa)
    for n, name in enumerate(nics):
        fake.nic([*up, f"0000:{index:02x}:04.{n}"], numa=numa, ib=name if ib else None,
                 net=None if ib else name)


@pytest.fixture
def fake(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs(tmp_path)


def _four_gpus_two_nics(fake: FakeSysfs) -> FakeSysfs:
    fake.node(0, "0-3")
    fake.node(1, "4-7")
    _switch(fake, 0x10, numa=0, gpus=2, nics=["mlx5_0"])
    _switch(fake, 0x80, numa=1, gpus=2, nics=["mlx5_1"])
    return fake


def _eight_gpus_four_nics(fake: FakeSysfs) -> FakeSysfs:
    fake.node(0, "0-7")
    fake.node(1, "8-15")
    for s in range(4):
        _switch(fake, 0x10 + 0x10 * s, numa=s // 2, gpus=2, nics=[f"mlx5_{s}"])
    return fake


def _plan(fake: FakeSysfs, tp: int, device: str, domains_per_rank: int = 1) -> NodePlacement:
    return plan_placement(detect_topology(fake.root), tp, device, domains_per_rank)


def test_each_gpu_rank_gets_its_nearest_rdma_nic(fake: FakeSysfs) -> None:
    """2 NUMA nodes, 4 GPUs, 2 NICs: ranks 0-1 share mlx5_0 and node 0's cores, 2-3 mlx5_1."""
    node = _plan(_four_gpus_two_nics(fake), tp=4, device="cuda")
    assert [(r.device, r.numa_node, r.nics, r.domains) for r in node.ranks] == [
        ("cuda:0", 0, ("mlx5_0",), (0,)),
        ("cuda:1", 0, ("mlx5_0",), (1,)),
        ("cuda:2", 1, ("mlx5_1",), (2,)),
        ("cuda:3", 1, ("mlx5_1",), (3,)),
    ]
    assert node.domain_nics == ("mlx5_0", "mlx5_0", "mlx5_1", "mlx5_1")
    assert node.domain_cpus == ((0, 1, 2, 3),) * 2 + ((4, 5, 6, 7),) * 2


def test_eight_gpus_four_nics_pair_up_by_switch(fake: FakeSysfs) -> None:
    """Rank i's only domain is on the NIC behind its own switch: mlx5_{i // 2}."""
    node = _plan(_eight_gpus_four_nics(fake), tp=8, device="cuda")
    assert node.domain_nics == tuple(f"mlx5_{i // 2}" for i in range(8))
    assert [node.domains_of(i) for i in range(8)] == [(i,) for i in range(8)]
    assert [r.cpus for r in node.ranks] == [tuple(range(8))] * 4 + [tuple(range(8, 16))] * 4


def test_device_base_offsets_every_rank(fake: FakeSysfs) -> None:
    """A node on cuda:6 with TP 2 runs its ranks on cuda:6 and cuda:7, with their NIC."""
    node = _plan(_eight_gpus_four_nics(fake), tp=2, device="cuda:6")
    assert [(r.device, r.nics) for r in node.ranks] == [("cuda:6", ("mlx5_3",)),
                                                         ("cuda:7", ("mlx5_3",))]


def test_two_equally_near_nics_give_a_rank_two_domains(fake: FakeSysfs) -> None:
    """One domain per (rank, NIC) pair, each pinned to the rank's cores; domains_per_rank
    does not apply where real NICs decide."""
    fake.node(0, "0-1")
    _switch(fake, 0x10, numa=0, gpus=1, nics=["mlx5_0", "mlx5_1"])
    node = _plan(fake, tp=1, device="cuda", domains_per_rank=3)
    assert (node.ranks[0].nics, node.domains_of(0)) == (("mlx5_0", "mlx5_1"), (0, 1))
    assert node.domain_cpus == ((0, 1), (0, 1))


def test_cpu_only_ranks_round_robin_over_nodes_with_cpus(fake: FakeSysfs) -> None:
    """No GPU: stand-in domains, ranks spread over nodes 0 and 1; memory-only node 2 skipped."""
    fake.node(0, "0-1")
    fake.node(1, "2-3")
    fake.node(2, "")
    node = _plan(fake, tp=3, device="cpu", domains_per_rank=2)
    assert [(r.device, r.numa_node, r.cpus, r.domains, r.nics) for r in node.ranks] == [
        ("cpu", 0, (0, 1), (0, 1), ()),
        ("cpu", 1, (2, 3), (2, 3), ()),
        ("cpu", 0, (0, 1), (4, 5), ()),
    ]
    assert node.domain_nics == (None,) * 6
    assert node.domain_cpus == ((0, 1),) * 2 + ((2, 3),) * 2 + ((0, 1),) * 2


def test_cpu_device_uses_stand_ins_even_beside_rdma_nics(fake: FakeSysfs) -> None:
    """CPU ranks leave the NIC to the provider: no name is given to any domain."""
    node = _plan(_four_gpus_two_nics(fake), tp=2, device="cpu")
    assert node.domain_nics == (None, None)
    assert [r.numa_node for r in node.ranks] == [0, 1]


def test_gpus_beside_nics_that_are_not_rdma_get_stand_ins(fake: FakeSysfs) -> None:
    """Ethernet only: stand-in domains, each rank still on its GPU's NUMA node and cores."""
    fake.node(0, "0-3")
    fake.node(1, "4-7")
    _switch(fake, 0x10, numa=0, gpus=1, nics=["eth0"], ib=False)
    _switch(fake, 0x80, numa=1, gpus=1, nics=["eth1"], ib=False)
    node = _plan(fake, tp=2, device="cuda", domains_per_rank=2)
    assert [(r.numa_node, r.nics, r.domains, r.cpus) for r in node.ranks] == [
        (0, (), (0, 1), (0, 1, 2, 3)),
        (1, (), (2, 3), (4, 5, 6, 7)),
    ]
    assert node.domain_nics == (None,) * 4


def test_same_topology_same_map(fake: FakeSysfs) -> None:
    """Planning twice gives equal maps (no set or dict order leaks in)."""
    _eight_gpus_four_nics(fake)
    assert _plan(fake, tp=8, device="cuda") == _plan(fake, tp=8, device="cuda")


@pytest.mark.parametrize(("tp", "device", "per_rank", "message"), [
    (2, "cuda:1", 1, r"device cuda:2 \(rank 1 of tp 2 on 'cuda:1'\).*2 NVIDIA GPU\(s\)"),
    (1, "cuda:5", 1, "device cuda:5 .*cuda:0..cuda:1"),
    (0, "cpu", 1, "tp must be at least 1, got 0"),
    (1, "cpu", 0, "domains_per_rank must be at least 1, got 0"),
    (1, "tpu", 1, "unknown device 'tpu'"),
    (1, "cpu:1", 1, "unknown device 'cpu:1'"),
])
def test_bad_arguments_name_what_is_wrong(fake: FakeSysfs, tp: int, device: str, per_rank: int,
                                         message: str) -> None:
    """On a 2-GPU tree, a missing GPU, a bad count or device string is a ConfigError."""
    fake.node(0, "0-3")
    _switch(fake, 0x10, numa=0, gpus=2, nics=["mlx5_0"])
    with pytest.raises(ConfigError, match=message):
        _plan(fake, tp, device, per_rank)


def test_cuda_on_a_machine_without_gpus_is_refused(fake: FakeSysfs) -> None:
    """No GPU in sysfs: asking for cuda says so."""
    fake.node(0, "0-1")
    with pytest.raises(ConfigError, match=r"device cuda:0 .*0 NVIDIA GPU\(s\) \(none\)"):
        _plan(fake, 1, "cuda")


def test_an_unknown_rank_is_refused(fake: FakeSysfs) -> None:
    """A rank past tp is a ConfigError naming it, not an index error."""
    fake.node(0, "0-1")
    node = _plan(fake, tp=2, device="cpu")
    with pytest.raises(ConfigError, match="rank 2 is not a rank of this node"):
        node.domains_of(2)
