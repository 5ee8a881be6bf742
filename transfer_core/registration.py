"""Registering one buffer with every domain of a `TransferEngine` (S5).

Each domain (NIC) registers the buffer under its own key, so a descriptor carries one
(endpoint, key) pair per domain and a peer's domain d writes through ours d modulo our count.
All or nothing: a failed registration closes the ones made before it. Key choice (random, or
the provider's own) is `memory_keys.py`.
"""

from __future__ import annotations

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
