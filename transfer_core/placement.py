"""Which fabric domain (NIC) and which CPUs each domain of a `TransferEngine` gets (S5b, S6a).

A node maps each TP rank's shard to the NIC nearest its device and pins that NIC's progress
thread to the NIC's NUMA node (`topology.py` finds both); this module turns such a choice into
one `DomainPlan` per engine domain: an fi_info entry picked by libfabric domain name (verbs:
`mlx5_0`; efa: `rdmap16s27-rdm`, which starts with the device name) and a set of cores. It
only chooses; `DomainWorker` opens and pins. Without names, domains go round robin over the
distinct domains fi_getinfo lists (several engine domains share a NIC when it lists fewer).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from transfer_core.pyfabric import Info


@dataclass(frozen=True, slots=True)
class DomainPlan:
    """Engine domain d: the fi_info entry it opens and the cores its thread may run on."""

    info: Info
    cpus: tuple[int, ...] | None


def distinct_domains(infos: Sequence[Info]) -> list[Info]:
    """The first fi_info entry of each libfabric domain name, in fi_getinfo's order."""
    return list({i.domain_name: i for i in reversed(infos)}.values())[::-1]


def match_nic(infos: Sequence[Info], nic: str) -> Info:
    """The entry whose domain name is `nic`, or starts with `nic` and a dash (efa's
    `rdmap16s27-rdm`, verbs' `mlx5_0-xrc`); an exact name wins over a prefix."""
    names = distinct_domains(infos)
    for info in names:
        if info.domain_name == nic:
            return info
    for info in names:
        if info.domain_name.startswith(nic + "-"):
            return info
    offered = sorted(i.domain_name for i in names)
    raise ValueError(
        f"no fabric domain named {nic!r} on provider {infos[0].provider!r}: "
        f"fi_getinfo offers {offered}"
    )


def check_cpus(cpus: Sequence[int], what: str) -> tuple[int, ...]:
    """A non-empty set of cores this process may run on (checked now: a progress thread
    that cannot be pinned would fail later, far from the cause)."""
    chosen = tuple(cpus)
    if not chosen:
        raise ValueError(f"{what} names no CPU")
    allowed = os.sched_getaffinity(0)
    outside = [c for c in chosen if c not in allowed]
    if outside:
        raise ValueError(f"{what}: CPUs {outside} are not among this process's {sorted(allowed)}")
    return chosen


def plan_domains(
    infos: Sequence[Info],
    num_domains: int,
    cpus: Sequence[int] | None = None,
    domain_cpus: Sequence[Sequence[int]] | None = None,
    nics: Sequence[str | None] | None = None,
) -> list[DomainPlan]:
    """One plan per engine domain. `cpus`: one core per domain, round robin (the old way);
    `domain_cpus[d]`: the cores of domain d (e.g. its NIC's NUMA node); `nics[d]`: the
    domain name domain d opens on (None: the round-robin pick)."""
    if cpus is not None and domain_cpus is not None:
        raise ValueError("pass cpus (one core per domain, round robin) or domain_cpus, not both")
    for what, given in (("domain_cpus", domain_cpus), ("nics", nics)):
        if given is not None and len(given) != num_domains:
            raise ValueError(f"{what} has {len(given)} entries for num_domains={num_domains}")
    pool = distinct_domains(infos)
    plans = []
    for d in range(num_domains):
        nic = nics[d] if nics is not None else None
        info = match_nic(infos, nic) if nic is not None else pool[d % len(pool)]
        if domain_cpus is not None:
            cores: tuple[int, ...] | None = check_cpus(domain_cpus[d], f"domain_cpus[{d}]")
        elif cpus:
            cores = check_cpus([cpus[d % len(cpus)]], "cpus")
        else:
            cores = None
        plans.append(DomainPlan(info, cores))
    return plans
