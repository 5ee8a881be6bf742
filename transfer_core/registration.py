"""A `TransferEngine`'s registered memory: each buffer registered with every domain (S5).

Each domain (NIC) registers the buffer under its own key, so a descriptor carries one
(endpoint, key) pair per domain and a peer's domain d writes through ours d modulo our count.
All or nothing: a failed registration closes the ones made before it. Key choice (random, or
the provider's own) is `memory_keys.py`. `Registrations` is the engine's list of its regions:
named there, asked whether a write's source is one of them, and all closed with the engine, so
that no registration outlives it (the loopback's `RegionTable` plays the same part).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from transfer_core.domain_worker import DomainWorker
from transfer_core.memory import BufferInfo, MemoryRegion, MemoryRegionDescriptor
from transfer_core.pyfabric import lib


def register_on(
    domains: Sequence[DomainWorker], provider: str, buf: BufferInfo, name: str, remote_write: bool
) -> MemoryRegion:
    """Register `buf` with every domain; the region's descriptor is what peers get."""
    writable = buf.writable and remote_write
    access = lib.FI_WRITE | (lib.FI_REMOTE_WRITE if writable else 0)
    registrations = []
    try:
        for worker in domains:
            registrations.append(worker.register(buf.ptr, buf.nbytes, access, buf.cuda_device))
    except BaseException:
        for registration in registrations:
            registration.close()
        raise
    descriptor = MemoryRegionDescriptor(
        name=name,
        provider=provider,
        base=buf.ptr,
        length=buf.nbytes,
        virt_addr=bool(domains[0].info.mr_mode & lib.FI_MR_VIRT_ADDR),
        writable=writable,
        domains=tuple((w.address, r.key) for w, r in zip(domains, registrations, strict=True)),
    )
    return MemoryRegion(
        name, buf.ptr, buf.nbytes, buf.writable, tuple(registrations), descriptor, buf.keepalive
    )


class Registrations:
    """The regions one engine registered with its `domains` (a list its builder fills)."""

    def __init__(self, domains: Sequence[DomainWorker]) -> None:
        self._domains = domains
        self._regions: dict[int, MemoryRegion] = {}  # by id: a write's check is one lookup
        self._names = itertools.count()

    def register(self, buf: BufferInfo, name: str | None, remote_write: bool) -> MemoryRegion:
        """`buf` registered with every domain, named `name` (None: ``mr<n>``)."""
        name = name or f"mr{next(self._names)}"
        provider = self._domains[0].info.provider
        region = register_on(self._domains, provider, buf, name, remote_write)
        self._regions[id(region)] = region
        return region

    def check(self, region: MemoryRegion) -> None:
        """ValueError naming `region` unless it is registered here (a write's source must be)."""
        if self._regions.get(id(region)) is not region:
            raise ValueError(f"region {region.name!r} is not registered with this engine")

    def remove(self, region: MemoryRegion) -> None:
        """Forget `region` (its owner closes it); ValueError for one not registered here."""
        self.check(region)
        del self._regions[id(region)]

    def close(self) -> None:
        """Close every region still registered."""
        regions, self._regions = list(self._regions.values()), {}
        for region in regions:
            region.close()
