"""Which fabric domains and CPU cores each TP rank of a node uses (S5b, S6a, S9a).

A pure decision over a `transfer_core.topology.Topology`: it opens nothing and pins nothing.
The node's one transfer engine gets `domain_nics` and `domain_cpus` (one entry per domain);
rank i's page writes go through `domains_of(i)` (S6a, matched TP: rank i to rank i), the
decoder's rank i's KV through its own (`transfer_plan.rank_descriptors`); a replicated or DP
deployment's per-request draw of a source rank and domain (S9a) is the transfer plan's
(`transfer_plan.plan_request`). `disagg topology` prints this map.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from disagg.errors import ConfigError
from transfer_core.topology import Topology

_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where one TP rank runs: its device, NUMA node, NICs, engine domains and CPU cores.

    `nics` is empty when the rank's domains are stand-ins (no RDMA NIC, or a CPU device);
    `cpus` is empty only when sysfs shows no CPU at all (then nothing is pinned).
    """

    rank: int
    device: str
    numa_node: int | None
    nics: tuple[str, ...]
    domains: tuple[int, ...]
    cpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NodePlacement:
    """The map of a whole node: its ranks, and per engine domain its NIC and pinned cores.

    `domain_nics[d]` is None for a stand-in domain (the provider picks its own interface).
    """

    ranks: tuple[RankPlacement, ...]
    domain_nics: tuple[str | None, ...]
    domain_cpus: tuple[tuple[int, ...], ...]

    @property
    def num_domains(self) -> int:
        """Engine domains of the node, all ranks together."""
        return len(self.domain_nics)

    def domains_of(self, rank: int) -> tuple[int, ...]:
        """The engine domains rank `rank`'s pages go through."""
        return self._rank(rank).domains

    def _rank(self, rank: int) -> RankPlacement:
        if not 0 <= rank < len(self.ranks):
            raise ConfigError(f"rank {rank} is not a rank of this node (tp {len(self.ranks)})")
        return self.ranks[rank]


def plan_placement(topology: Topology, tp: int, device: str,
                   domains_per_rank: int = 1) -> NodePlacement:
    """The placement a node with `tp` ranks on `device` uses on this topology.

    `device` is the node's: "cpu" (every rank on the CPU), "cuda" or "cuda:B" (rank r on GPU
    B + r). A GPU rank with RDMA NICs on the machine gets the NICs nearest its GPU (same NUMA
    node, then fewest PCIe hops) and one domain per NIC, pinned to that GPU's NUMA node's
    cores; `domains_per_rank` is then unused, the NICs decide. Otherwise each rank gets
    `domains_per_rank` stand-in domains over the provider's own interface: a GPU rank on its
    GPU's NUMA node, a CPU rank on the NUMA nodes with CPUs in turn. Domains are numbered
    rank by rank. The same topology and arguments always give the same map.

    Two NUMA nodes of two cores each, no GPU, no NIC, TP 3 with two stand-ins per rank:

    >>> from transfer_core.topology import NumaNode
    >>> box = Topology((NumaNode(0, (0, 1)), NumaNode(1, (2, 3))), nics=(), gpus=(), groups=())
    >>> node = plan_placement(box, tp=3, device="cpu", domains_per_rank=2)
    >>> [(r.rank, r.numa_node, r.domains, r.cpus) for r in node.ranks]
    [(0, 0, (0, 1), (0, 1)), (1, 1, (2, 3), (2, 3)), (2, 0, (4, 5), (0, 1))]
    >>> node.num_domains, node.domain_nics
    (6, (None, None, None, None, None, None))

    Every domain belongs to exactly one rank and is pinned to that rank's cores:

    >>> sorted(d for r in node.ranks for d in r.domains) == list(range(node.num_domains))
    True
    >>> all(node.domain_cpus[d] == r.cpus for r in node.ranks for d in r.domains)
    True
    """
    if tp < 1:
        raise ConfigError(f"tp must be at least 1, got {tp}")
    if domains_per_rank < 1:
        raise ConfigError(f"domains_per_rank must be at least 1, got {domains_per_rank}")
    gpus = _rank_gpus(topology, tp, device)
    has_rdma = any(nic.is_rdma for nic in topology.nics)
    with_cpus = [node for node in topology.numa_nodes if node.cpus]
    ranks: list[RankPlacement] = []
    domain_nics: list[str | None] = []
    domain_cpus: list[tuple[int, ...]] = []
    for rank in range(tp):
        gpu = gpus[rank] if gpus else None
        if gpu is not None:
            group = topology.group_for(gpu)
            numa_node = group.numa_node if group.numa_node >= 0 else None
            cpus = group.cpus
            nics = tuple(nic.name for nic in group.nics if nic.is_rdma) if has_rdma else ()
        elif with_cpus:
            home = with_cpus[rank % len(with_cpus)]
            numa_node, cpus, nics = home.id, home.cpus, ()
        else:
            numa_node, cpus, nics = None, (), ()
        # One domain per NIC: each has its own progress thread and queue, so a rank with two
        # NICs drives both at once (S6a's "more NICs, more bandwidth").
        rank_nics: list[str | None] = list(nics) if nics else [None] * domains_per_rank
        first = len(domain_nics)
        domain_nics.extend(rank_nics)
        domain_cpus.extend([cpus] * len(rank_nics))
        ranks.append(RankPlacement(rank, "cpu" if gpu is None else f"cuda:{gpu}", numa_node,
                                   nics, tuple(range(first, len(domain_nics))), cpus))
    return NodePlacement(tuple(ranks), tuple(domain_nics), tuple(domain_cpus))


def _rank_gpus(topology: Topology, tp: int, device: str) -> list[int]:
    """GPU index of each rank (empty on "cpu"); a device sysfs does not show is an error."""
    match = _DEVICE.match(device)
    if match is None:
        raise ConfigError(f"unknown device {device!r}: expected cpu, cuda or cuda:N")
    if match.group(1) == "cpu":
        if match.group(2) is not None:
            raise ConfigError(f"unknown device {device!r}: expected cpu, cuda or cuda:N")
        return []
    base = int(match.group(2) or 0)
    found = [gpu.index for gpu in topology.gpus]
    for rank in range(tp):
        if base + rank not in found:
            shown = f"cuda:0..cuda:{len(found) - 1}" if found else "none"
            raise ConfigError(f"device cuda:{base + rank} (rank {rank} of tp {tp} on {device!r}) "
                              f"is not on this machine: sysfs shows {len(found)} NVIDIA "
                              f"GPU(s) ({shown})")
    return [base + rank for rank in range(tp)]
