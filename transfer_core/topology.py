"""Node topology from sysfs: NUMA nodes and their CPUs, NICs, NVIDIA GPUs, and which go together.

`detect_topology(sysfs_root)` reads only files under `sysfs_root` (default `/`), so tests build
fake trees in a temporary directory. Each GPU is grouped with the NICs and CPU cores nearest to
it (S5b): same NUMA node first, then fewest PCIe hops. `pin_current_thread` pins the calling
thread, e.g. a transfer or poller thread, to the chosen cores. It does not query CUDA: GPU
indices follow PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID, no CUDA_VISIBLE_DEVICES remapping).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

logger = logging.getLogger(__name__)

NVIDIA_VENDOR = 0x10DE
# PCI class codes (upper 16 bits of the 24-bit class): 3D controller, VGA controller.
GPU_CLASSES = (0x0302, 0x0300)
_PCI_ADDRESS = re.compile(r"^[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


@dataclass(frozen=True, slots=True)
class NumaNode:
    """One NUMA node and the CPUs on it (empty for memory-only nodes)."""

    id: int
    cpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Nic:
    """A physical network device, possibly seen as both an RDMA device and a net interface.

    `ib_device` is the `/sys/class/infiniband` name (e.g. `mlx5_0`, EFA's `rdmap16s27`),
    `net_device` the interface name (e.g. `eth0`); libfabric's verbs/efa domains use the first,
    tcp the second. `pci_path` runs from the root complex down to the device.
    """

    pci_address: str
    numa_node: int
    pci_path: tuple[str, ...]
    ib_device: str | None = None
    net_device: str | None = None

    @property
    def name(self) -> str:
        """The RDMA device name if there is one, else the interface name."""
        return self.ib_device or self.net_device or self.pci_address

    @property
    def is_rdma(self) -> bool:
        """Whether the NIC shows up under `/sys/class/infiniband` (verbs, EFA)."""
        return self.ib_device is not None


@dataclass(frozen=True, slots=True)
class Gpu:
    """An NVIDIA GPU; `index` is its rank in PCI bus order."""

    index: int
    pci_address: str
    numa_node: int
    pci_path: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class GpuGroup:
    """A GPU with the NICs and CPUs nearest to it; `numa_node` is -1 when unknown."""

    gpu: Gpu
    nics: tuple[Nic, ...]
    cpus: tuple[int, ...]
    numa_node: int


@dataclass(frozen=True, slots=True)
class Topology:
    """Everything `detect_topology` found; `groups[i]` belongs to `gpus[i]`."""

    numa_nodes: tuple[NumaNode, ...]
    nics: tuple[Nic, ...]
    gpus: tuple[Gpu, ...]
    groups: tuple[GpuGroup, ...]

    @property
    def all_cpus(self) -> tuple[int, ...]:
        """Every CPU of every NUMA node, sorted."""
        return tuple(sorted({c for node in self.numa_nodes for c in node.cpus}))

    def group_for(self, gpu_index: int) -> GpuGroup:
        """The group of the GPU with this index."""
        for group in self.groups:
            if group.gpu.index == gpu_index:
                return group
        raise ValueError(f"no GPU with index {gpu_index}; found {[g.index for g in self.gpus]}")


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse a kernel cpulist such as ``0-3,8-11``.

    >>> parse_cpulist("0-2,8,10-11")
    (0, 1, 2, 8, 10, 11)
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(cpus))


def pci_distance(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """PCIe hops between two devices: up from each to their deepest common bridge.

    Devices under different root complexes share no prefix, so every hop counts.

    >>> pci_distance(("pci0000:00", "0000:00:01.0", "0000:01:00.0"),
    ...              ("pci0000:00", "0000:00:01.0", "0000:01:00.1"))
    2
    """
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return len(a) + len(b) - 2 * common


def detect_topology(sysfs_root: str | os.PathLike[str] = "/") -> Topology:
    """Read NUMA nodes, NICs and NVIDIA GPUs under `sysfs_root` and group them (S5b)."""
    root = Path(sysfs_root)
    numa_nodes = _read_numa_nodes(root)
    single_node = numa_nodes[0].id if len(numa_nodes) == 1 else None
    nics = _read_nics(root, single_node)
    gpus = _read_gpus(root, single_node)
    groups = tuple(_group(gpu, nics, numa_nodes) for gpu in gpus)
    topology = Topology(numa_nodes, nics, gpus, groups)
    logger.debug("detected topology: %s", topology)
    return topology


def pin_current_thread(cpus: Iterable[int]) -> tuple[int, ...]:
    """Pin the calling thread to `cpus` and return its new affinity.

    Linux's `sched_setaffinity(0, ...)` acts on the calling thread only, so this pins one
    worker thread without touching the rest of the process. CPUs outside the process's
    cgroup cpuset make the kernel refuse with `OSError` (EINVAL).
    """
    wanted = set(cpus)
    if not wanted:
        raise ValueError("pin_current_thread needs at least one CPU")
    os.sched_setaffinity(0, wanted)
    return tuple(sorted(os.sched_getaffinity(0)))


def _read_numa_nodes(root: Path) -> tuple[NumaNode, ...]:
    node_dir = root / "sys/devices/system/node"
    nodes = []
    for path in node_dir.glob("node*"):
        if path.name[4:].isdigit():
            nodes.append(NumaNode(int(path.name[4:]), _read_cpulist(path / "cpulist")))
    if nodes:
        return tuple(sorted(nodes, key=lambda node: node.id))
    # Kernels built without NUMA have no node directory: the whole machine is one node.
    online = _read_cpulist(root / "sys/devices/system/cpu/online")
    return (NumaNode(0, online),)


def _read_nics(root: Path, single_node: int | None) -> tuple[Nic, ...]:
    by_address: dict[str, Nic] = {}
    for kind in ("infiniband", "net"):
        for entry in sorted((root / "sys/class" / kind).glob("*")):
            device = entry / "device"
            # Virtual interfaces (lo, bridges, veth, bonds) have no device link.
            if not device.exists():
                continue
            address, path = _pci_location(device)
            # An RDMA device and its net interface share one PCI function: merge them.
            nic = by_address.get(address) or Nic(address, _read_numa(device, single_node), path)
            if kind == "infiniband" and nic.ib_device is None:
                nic = replace(nic, ib_device=entry.name)
            elif kind == "net" and nic.net_device is None:
                nic = replace(nic, net_device=entry.name)
            by_address[address] = nic
    return tuple(by_address[a] for a in sorted(by_address))


def _read_gpus(root: Path, single_node: int | None) -> tuple[Gpu, ...]:
    found = []
    for device in sorted((root / "sys/bus/pci/devices").glob("*")):
        vendor = _read_int(device / "vendor", base=16)
        pci_class = _read_int(device / "class", base=16)
        if vendor != NVIDIA_VENDOR or pci_class is None or (pci_class >> 8) not in GPU_CLASSES:
            continue
        address, path = _pci_location(device)
        found.append((address, _read_numa(device, single_node), path))
    found.sort()
    return tuple(Gpu(i, address, node, path) for i, (address, node, path) in enumerate(found))


def _group(gpu: Gpu, nics: tuple[Nic, ...], numa_nodes: tuple[NumaNode, ...]) -> GpuGroup:
    node = gpu.numa_node
    if node < 0:
        node = _infer_node(gpu, nics)
    # Prefer RDMA devices: an ordinary Ethernet port is only used when the node has none.
    pool = [nic for nic in nics if nic.is_rdma] or list(nics)
    candidates = [nic for nic in pool if node >= 0 and nic.numa_node == node] or pool
    if candidates and gpu.pci_path:
        best = min(pci_distance(gpu.pci_path, nic.pci_path) for nic in candidates)
        candidates = [nic for nic in candidates if pci_distance(gpu.pci_path, nic.pci_path) == best]
    cpus = next((n.cpus for n in numa_nodes if n.id == node and n.cpus), None)
    if cpus is None:
        cpus = tuple(sorted({c for n in numa_nodes for c in n.cpus}))
    return GpuGroup(gpu, tuple(candidates), cpus, node)


def _infer_node(gpu: Gpu, nics: tuple[Nic, ...]) -> int:
    """A GPU without numa_node takes the node of a NIC under the same root complex, if any."""
    if not gpu.pci_path:
        return -1
    for nic in nics:
        if nic.numa_node >= 0 and nic.pci_path[:1] == gpu.pci_path[:1]:
            return nic.numa_node
    return -1


def _pci_location(device: Path) -> tuple[str, tuple[str, ...]]:
    """PCI address and the chain of bridges to it, from the device's resolved sysfs path.

    A virtio or vmbus NIC resolves below (or outside) its PCI function; the last PCI address
    on the path is then the function, and a device with none keeps its own name and no path.
    """
    resolved = device.resolve()
    parts = resolved.parts
    start = next((i for i, p in enumerate(parts) if p.startswith("pci") and ":" in p), None)
    if start is None:
        return resolved.name, ()
    chain = [p for p in parts[start + 1 :] if _PCI_ADDRESS.match(p)]
    if not chain:
        return resolved.name, ()
    return chain[-1], (parts[start], *chain)


def _read_numa(device: Path, single_node: int | None) -> int:
    node = _read_int(device / "numa_node")
    if node is None or node < 0:
        # Single-node machines often report -1; there is only one answer anyway.
        return single_node if single_node is not None else -1
    return node


def _read_cpulist(path: Path) -> tuple[int, ...]:
    try:
        return parse_cpulist(path.read_text())
    except FileNotFoundError:
        return ()


def _read_int(path: Path, base: int = 10) -> int | None:
    try:
        return int(path.read_text().strip(), base)
    except (FileNotFoundError, ValueError):
        return None
