"""Tests of `transfer_core.topology` on fake sysfs trees built in tmp_path (S5b)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from transfer_core.topology import detect_topology, parse_cpulist, pin_current_thread

GPU_CLASS = "0x030200"
NIC_CLASS = "0x020000"


class FakeSysfs:
    """Builds the few sysfs files `detect_topology` reads, with real symlinks like the kernel."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def node(self, node_id: int, cpulist: str) -> None:
        path = self.root / f"sys/devices/system/node/node{node_id}"
        path.mkdir(parents=True)
        (path / "cpulist").write_text(cpulist + "\n")

    def pci(self, chain: list[str], vendor: str, pci_class: str, numa: int) -> Path:
        """A PCI function at the end of `chain` (root complex first), listed in /sys/bus/pci."""
        path = self.root / "sys/devices" / Path(*chain)
        path.mkdir(parents=True)
        for name, value in (("vendor", vendor), ("class", pci_class), ("numa_node", numa)):
            (path / name).write_text(f"{value}\n")
        bus = self.root / "sys/bus/pci/devices"
        bus.mkdir(parents=True, exist_ok=True)
        (bus / chain[-1]).symlink_to(path)
        return path

    def gpu(self, chain: list[str], numa: int) -> Path:
        return self.pci(chain, "0x10de", GPU_CLASS, numa)

    def nic(self, chain: list[str], numa: int, ib: str | None, net: str | None) -> Path:
        path = self.pci(chain, "0x15b3", NIC_CLASS, numa)
        for kind, name in (("infiniband", ib), ("net", net)):
            if name is not None:
                self.class_entry(kind, name, path)
        return path

    def class_entry(self, kind: str, name: str, device: Path | None) -> None:
        entry = self.root / "sys/class" / kind / name
        entry.mkdir(parents=True)
        if device is not None:
            (entry / "device").symlink_to(device)


@pytest.fixture
def fake(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs(tmp_path)


@pytest.fixture
def two_node_box(fake: FakeSysfs) -> FakeSysfs:
    """Two NUMA nodes; node 0 has two PCIe switches, each with one GPU and one NIC."""
    fake.node(0, "0-3")
    fake.node(1, "4-7")
    pairs = [("0000:03:00.0", "0000:04:00.0"), ("0000:13:00.0", "0000:14:00.0")]
    for sw, (gpu, nic) in enumerate(pairs):
        up = ["pci0000:00", f"0000:00:0{sw + 1}.0", f"0000:{sw}1:00.0"]
        fake.gpu([*up, f"0000:{sw}2:00.0", gpu], numa=0)
        fake.nic([*up, f"0000:{sw}2:01.0", nic], numa=0, ib=f"mlx5_{sw}", net=f"ibp{sw}")
    # Node 1: one GPU and one NIC under another root complex.
    fake.gpu(["pci0000:80", "0000:80:01.0", "0000:81:00.0"], numa=1)
    fake.nic(["pci0000:80", "0000:80:02.0", "0000:82:00.0"], numa=1, ib="mlx5_2", net=None)
    # A management Ethernet port, an NVSwitch bridge and a BMC VGA: none of them chosen.
    fake.nic(["pci0000:00", "0000:00:1f.6"], numa=0, ib=None, net="eno1")
    fake.pci(["pci0000:80", "0000:80:03.0"], "0x10de", "0x068000", 1)
    fake.pci(["pci0000:00", "0000:00:1e.0"], "0x1a03", "0x030000", 0)
    fake.class_entry("net", "lo", None)
    fake.class_entry("net", "docker0", None)
    return fake


def test_parse_cpulist_ranges_singles_and_empty() -> None:
    """Kernel cpulists mix ranges and single CPUs; memory-only nodes have none."""
    assert parse_cpulist("0-2,8,10-11\n") == (0, 1, 2, 8, 10, 11)
    assert parse_cpulist("\n") == ()


def test_numa_nodes_and_their_cpus(two_node_box: FakeSysfs) -> None:
    """Each node directory yields its CPU list."""
    topo = detect_topology(two_node_box.root)
    assert [(n.id, n.cpus) for n in topo.numa_nodes] == [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]


def test_only_nvidia_gpus_in_pci_order(two_node_box: FakeSysfs) -> None:
    """NVSwitch bridges and other vendors' VGA devices are not GPUs; indices follow PCI order."""
    topo = detect_topology(two_node_box.root)
    assert [(g.index, g.pci_address) for g in topo.gpus] == [
        (0, "0000:03:00.0"),
        (1, "0000:13:00.0"),
        (2, "0000:81:00.0"),
    ]


def test_each_gpu_gets_the_nic_behind_its_own_switch(two_node_box: FakeSysfs) -> None:
    """Same NUMA node first, then fewest PCIe hops: one NIC per GPU here."""
    topo = detect_topology(two_node_box.root)
    assert [[n.name for n in g.nics] for g in topo.groups] == [["mlx5_0"], ["mlx5_1"], ["mlx5_2"]]
    assert [g.cpus for g in topo.groups] == [(0, 1, 2, 3), (0, 1, 2, 3), (4, 5, 6, 7)]
    assert topo.group_for(2).numa_node == 1


def test_rdma_device_and_net_interface_merge(two_node_box: FakeSysfs) -> None:
    """mlx5_0 and ibp0 share one PCI function and become one NIC with both names."""
    nic = detect_topology(two_node_box.root).group_for(0).nics[0]
    assert (nic.ib_device, nic.net_device, nic.pci_address) == ("mlx5_0", "ibp0", "0000:04:00.0")


def test_virtual_net_devices_are_skipped(two_node_box: FakeSysfs) -> None:
    """lo and docker0 have no device link, so they are not NICs."""
    names = {n.net_device for n in detect_topology(two_node_box.root).nics}
    assert names == {"ibp0", "ibp1", "eno1", None}


def test_plain_ethernet_is_used_when_there_is_no_rdma_nic(fake: FakeSysfs) -> None:
    """Without any RDMA device the GPU is grouped with its node's Ethernet port."""
    fake.node(0, "0-1")
    fake.node(1, "2-3")
    fake.gpu(["pci0000:00", "0000:00:01.0", "0000:01:00.0"], numa=0)
    fake.nic(["pci0000:00", "0000:00:02.0", "0000:02:00.0"], numa=0, ib=None, net="eth0")
    fake.nic(["pci0000:40", "0000:40:02.0", "0000:41:00.0"], numa=1, ib=None, net="eth1")
    assert [n.name for n in detect_topology(fake.root).group_for(0).nics] == ["eth0"]


def test_numa_minus_one_on_a_single_node_machine_means_node_zero(fake: FakeSysfs) -> None:
    """One node and numa_node -1 everywhere: everything is on that node."""
    fake.node(0, "0-7")
    fake.gpu(["pci0000:00", "0000:00:01.0", "0000:01:00.0"], numa=-1)
    fake.nic(["pci0000:00", "0000:00:02.0", "0000:02:00.0"], numa=-1, ib="efa_0", net=None)
    group = detect_topology(fake.root).group_for(0)
    assert (group.numa_node, group.cpus, [n.name for n in group.nics]) == (
        0,
        tuple(range(8)),
        ["efa_0"],
    )


def test_numa_minus_one_gpu_takes_the_node_of_its_root_complex(fake: FakeSysfs) -> None:
    """A GPU without numa_node inherits the node of a NIC under the same root complex."""
    fake.node(0, "0-1")
    fake.node(1, "2-3")
    fake.gpu(["pci0000:80", "0000:80:01.0", "0000:81:00.0"], numa=-1)
    fake.nic(["pci0000:00", "0000:00:02.0", "0000:02:00.0"], numa=0, ib="mlx5_0", net=None)
    fake.nic(["pci0000:80", "0000:80:02.0", "0000:82:00.0"], numa=1, ib="mlx5_1", net=None)
    group = detect_topology(fake.root).group_for(0)
    assert (group.numa_node, group.cpus, [n.name for n in group.nics]) == (1, (2, 3), ["mlx5_1"])


def test_unknown_numa_falls_back_to_all_cpus_and_nearest_nic(fake: FakeSysfs) -> None:
    """With no node to go by, the GPU gets every CPU and the NIC fewest hops away."""
    fake.node(0, "0-1")
    fake.node(1, "2-3")
    fake.gpu(["pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0"], numa=-1)
    fake.nic(["pci0000:00", "0000:00:01.0", "0000:01:01.0"], numa=-1, ib="mlx5_0", net=None)
    fake.nic(["pci0000:00", "0000:00:03.0", "0000:03:00.0"], numa=-1, ib="mlx5_1", net=None)
    group = detect_topology(fake.root).group_for(0)
    assert (group.numa_node, group.cpus, [n.name for n in group.nics]) == (
        -1,
        (0, 1, 2, 3),
        ["mlx5_0"],
    )


def test_no_gpus_gives_no_groups(fake: FakeSysfs) -> None:
    """A CPU-only box still lists its NICs; asking for a GPU group is a ValueError."""
    fake.node(0, "0-3")
    fake.nic(["pci0000:00", "0000:00:02.0"], numa=0, ib=None, net="eth0")
    topo = detect_topology(fake.root)
    assert (topo.gpus, topo.groups, [n.name for n in topo.nics]) == ((), (), ["eth0"])
    with pytest.raises(ValueError, match="no GPU with index 0"):
        topo.group_for(0)


def test_kernel_without_numa_is_one_node_of_online_cpus(fake: FakeSysfs) -> None:
    """No node directory: one node 0 holding the online CPUs."""
    online = fake.root / "sys/devices/system/cpu/online"
    online.parent.mkdir(parents=True)
    online.write_text("0-5\n")
    topo = detect_topology(fake.root)
    assert [(n.id, n.cpus) for n in topo.numa_nodes] == [(0, (0, 1, 2, 3, 4, 5))]


def test_real_machine_does_not_crash() -> None:
    """This host's own sysfs parses, whatever it holds."""
    topo = detect_topology()
    assert topo.numa_nodes
    assert len(topo.groups) == len(topo.gpus)


def test_pin_current_thread_affects_only_that_thread() -> None:
    """A worker pinned to one CPU reports it; the main thread keeps its affinity."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    result: list[tuple[int, ...]] = []
    worker = threading.Thread(target=lambda: result.append(pin_current_thread([cpu])))
    worker.start()
    worker.join()
    assert result == [(cpu,)]
    assert os.sched_getaffinity(0) == before


def test_pin_current_thread_needs_a_cpu() -> None:
    """An empty CPU set is a caller error, not a kernel error."""
    with pytest.raises(ValueError, match="at least one CPU"):
        pin_current_thread([])
