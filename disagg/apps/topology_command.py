"""`disagg topology`: what sysfs shows of this machine, and the rank map a node would use (S5b).

It reads the topology (`transfer_core.topology`), plans the placement
(`disagg.node.rank_placement`) and prints both as rich tables, or one JSON object with
`--json`. It starts nothing and pins nothing. `disagg.apps.cli` adds it with `register(app)`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from disagg.errors import ConfigError
from disagg.node.rank_placement import NodePlacement, plan_placement
from transfer_core.topology import Topology, detect_topology

STAND_IN = "stand-in, provider's own"


def topology_report(topology: Topology, placement: NodePlacement) -> dict:
    """The topology and the placement as plain JSON-ready data."""
    return {
        "numa_nodes": [{"id": n.id, "cpus": list(n.cpus)} for n in topology.numa_nodes],
        "nics": [{"name": nic.name, "rdma": nic.is_rdma, "numa_node": nic.numa_node,
                  "ib_device": nic.ib_device, "net_device": nic.net_device,
                  "pci_address": nic.pci_address} for nic in topology.nics],
        "gpus": [{"index": g.index, "pci_address": g.pci_address, "numa_node": g.numa_node}
                 for g in topology.gpus],
        "ranks": [asdict(rank) for rank in placement.ranks],
        "domains": [{"index": d, "rank": next(r.rank for r in placement.ranks
                                              if d in r.domains),
                     "nic": nic, "cpus": list(placement.domain_cpus[d])}
                    for d, nic in enumerate(placement.domain_nics)],
    }


def _cpus(cpus: list[int] | tuple[int, ...]) -> str:
    """Kernel cpulist style, the inverse of `parse_cpulist`: (0, 1, 2, 5) -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"


def _tables(report: dict, tp: int, device: str) -> list[Table]:
    machine = Table(title="this machine (sysfs)")
    for column in ("kind", "name", "NUMA node", "CPUs / RDMA / PCI"):
        machine.add_column(column)
    for node in report["numa_nodes"]:
        machine.add_row("NUMA node", str(node["id"]), str(node["id"]), _cpus(node["cpus"]))
    for nic in report["nics"]:
        machine.add_row("NIC", nic["name"], str(nic["numa_node"]),
                        f"RDMA {'yes' if nic['rdma'] else 'no'}, {nic['pci_address']}")
    for gpu in report["gpus"]:
        machine.add_row("GPU", f"cuda:{gpu['index']}", str(gpu["numa_node"]), gpu["pci_address"])
    ranks = Table(title=f"ranks of a node: tp {tp} on {device}")
    for column in ("rank", "device", "NUMA node", "NICs", "engine domains", "CPUs"):
        ranks.add_column(column)
    for rank in report["ranks"]:
        ranks.add_row(str(rank["rank"]), rank["device"], str(rank["numa_node"]),
                      ", ".join(rank["nics"]) or "-", ", ".join(map(str, rank["domains"])),
                      _cpus(rank["cpus"]))
    domains = Table(title="the node's transfer-engine domains")
    for column in ("domain", "rank", "NIC", "pinned CPUs"):
        domains.add_column(column)
    for domain in report["domains"]:
        domains.add_row(str(domain["index"]), str(domain["rank"]), domain["nic"] or STAND_IN,
                        _cpus(domain["cpus"]))
    return [machine, ranks, domains]


def register(app: typer.Typer) -> None:
    """Add `topology` to the `disagg` app."""
    app.command("topology")(topology)


def topology(
    tp: Annotated[int, typer.Option(help="Tensor-parallel ranks of the node")] = 1,
    device: Annotated[str, typer.Option(
        help="The node's device: cpu, cuda or cuda:N (rank r on cuda:N+r)")] = "cpu",
    domains_per_rank: Annotated[int, typer.Option(
        help="Stand-in domains per rank where there is no RDMA NIC")] = 1,
    sysfs_root: Annotated[str, typer.Option(
        help="Directory holding sys/ (a copy of another machine's, or a test tree)")] = "/",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """The NUMA nodes, NICs and GPUs sysfs shows, and each TP rank's NICs, domains and CPUs."""
    if not Path(sysfs_root).is_dir():
        raise ConfigError(f"--sysfs-root {sysfs_root!r} is not a directory")
    found = detect_topology(sysfs_root)
    report = topology_report(found, plan_placement(found, tp, device, domains_per_rank))
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
        return
    console = Console()
    for table in _tables(report, tp, device):
        console.print(table)
