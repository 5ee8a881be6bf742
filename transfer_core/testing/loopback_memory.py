"""Memory of the loopback engine: registering regions, and the write parts that move bytes
between them (S5 test double; one immediate per page, as S4c's decoder counts).

`RegionTable` registers buffers the way `TransferEngine.register_memory` does (same
`resolve_buffer`, same `MemoryRegion` / `MemoryRegionDescriptor` classes, a key per region)
and is what a peer's write looks its key up in. A `WritePart` is what one domain of the real
engine posts: the pages of one stripe of a paged write, a single write, or a pure immediate.
It runs on the sender's `DeliveryQueue`; the immediates are then handed to the target engine,
which counts them on its own queue, as a receiver's progress thread would after polling.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer_core.completion import Completion
from transfer_core.memory_keys import random_key
from transfer_core.errors import PeerError, TransferError
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor, resolve_buffer


@dataclass(eq=False)
class LoopbackRegistration:
    """Stands in for `pyfabric.MemoryRegistration` in a `MemoryRegion`: a key, no fid."""

    key: int
    desc: None = None
    closed: bool = False

    def close(self) -> None:
        self.closed = True


class RegionTable:
    """The regions of one engine, by key; `provider` and `endpoints` go into descriptors."""

    def __init__(self, provider: str, endpoints: tuple[bytes, ...]) -> None:
        self._provider = provider
        self._endpoints = endpoints
        self._lock = threading.Lock()
        self._regions: dict[int, MemoryRegion] = {}
        self._names = itertools.count()

    def register(
        self, buffer: Any, name: str | None, remote_write: bool = True
    ) -> tuple[MemoryRegion, MemoryRegionDescriptor]:
        """Host memory only; the descriptor holds the VA (like shm's FI_MR_VIRT_ADDR). Keys
        are random 64-bit values, unique here, as the real engine's."""
        buf = resolve_buffer(buffer)
        if buf.cuda_device is not None:
            raise ValueError(
                f"provider {self._provider!r} was opened without FI_HMEM: cannot register CUDA "
                "memory (use TransferEngine(hmem=True) with a CUDA-enabled libfabric)"
            )
        name = name or f"mr{next(self._names)}"
        with self._lock:
            key = random_key(8)
            while key in self._regions:
                key = random_key(8)
            registrations = tuple(LoopbackRegistration(key) for _ in self._endpoints)
            descriptor = MemoryRegionDescriptor(
                name=name, provider=self._provider, base=buf.ptr, length=buf.nbytes,
                virt_addr=True, writable=buf.writable and remote_write,
                domains=tuple((a, key) for a in self._endpoints),
            )
            region = MemoryRegion(
                name, buf.ptr, buf.nbytes, buf.writable, registrations, descriptor, buf.keepalive
            )
            self._regions[key] = region
        return region, descriptor

    def __contains__(self, region: object) -> bool:
        with self._lock:
            return any(r is region for r in self._regions.values())

    def unregister(self, region: MemoryRegion) -> None:
        """ValueError for a region not registered here (as list.remove in the real engine)."""
        with self._lock:
            key = region.registrations[0].key
            if self._regions.get(key) is not region:
                raise ValueError(f"region {region.name!r} is not registered with this engine")
            del self._regions[key]
        region.close()

    def lookup(self, key: int) -> MemoryRegion | None:
        """The live region a peer's write with `key` lands in (what the NIC looks up)."""
        with self._lock:
            return self._regions.get(key)

    def close(self) -> None:
        with self._lock:
            regions = list(self._regions.values())
            self._regions.clear()
        for region in regions:
            region.close()


@dataclass(eq=False)
class WritePart:
    """Writes of `length` bytes from `src_mr` byte offsets `src_offsets` to byte offsets
    `dst_offsets` of `dst_mr` (length 0: a pure immediate), each carrying `imm` if set (an
    array: write i carries `imm[i]`).

    `engine` is the sending `LoopbackEngine` and `domain` the domain it posts on."""

    engine: Any
    domain: int
    done: Completion
    src_mr: MemoryRegion | None
    dst_mr: MemoryRegionDescriptor
    length: int
    imm: int | np.ndarray | None
    src_offsets: np.ndarray
    dst_offsets: np.ndarray

    @property
    def n(self) -> int:
        return int(self.dst_offsets.size)

    @property
    def peer_address(self) -> bytes:
        """The peer endpoint it goes to (domain d writes to the peer's d modulo its count)."""
        return self.dst_mr.domains[self.domain % len(self.dst_mr.domains)][0]

    def run(self) -> None:
        """Deliver on the sender's queue; the completion comes last (its callback may raise)."""
        dst = self.dst_mr
        address, key = dst.domains[self.domain % len(dst.domains)]  # as `peer_address`
        found = self.engine.fabric.lookup(address)
        if found is None:
            self.fail(PeerError(f"region {dst.name!r}: peer unreachable: no loopback engine "
                                f"at {address!r}"))
            return
        target, peer_domain = found
        region = target.regions.lookup(key)
        if region is None:
            # tcp;ofi_rxm drops the connection on an unknown key (`warmup.py`): a peer error.
            self.fail(PeerError(f"region {dst.name!r}: key {key} is not a writable region "
                                "at the peer"))
            return
        if not region.descriptor.writable:
            # Registered without remote write: tcp;ofi_rxm and shm complete such a write at
            # the sender and land nothing, no byte and no immediate (measured, 1.17).
            self.engine.counts.completed(self.domain, self.n)
            self.done.part_finished(None)
            return
        if self.length:
            error = self._copy(region)
            if error is not None:
                self.fail(error)
                return
        self.engine.counts.completed(self.domain, self.n, self.n * self.length)
        if isinstance(self.imm, np.ndarray):  # one per write, each its own (counts by value)
            for value, count in zip(*np.unique(self.imm, return_counts=True), strict=True):
                target.arrive(peer_domain, int(value), int(count))
        elif self.imm is not None:
            target.arrive(peer_domain, self.imm, self.n)  # one immediate per write, as RDMA
        self.done.part_finished(None)

    def fail(self, error: TransferError) -> None:
        """Nothing (more) of this part lands; `on_error` hears once for the whole transfer."""
        self.engine.counts.completed(self.domain, self.n)
        self.done.part_finished(error)

    def _copy(self, region: MemoryRegion) -> TransferError | None:
        src = self.src_mr
        if src is None or src.closed:
            return TransferError("the source region was unregistered before the write ran")
        # The descriptor's raddr (base VA + offset) against the live region, as a NIC checks a
        # forged or stale descriptor: nothing is written outside the registered bytes.
        offsets = self.dst_mr.remote_addr(0) + self.dst_offsets - region.ptr
        if int(offsets.min()) < 0 or int(offsets.max()) + self.length > region.length:
            return PeerError(f"region {self.dst_mr.name!r}: write outside the peer's region "
                             f"({region.length} bytes)")
        for s, d in zip(self.src_offsets.tolist(), offsets.tolist(), strict=True):
            ctypes.memmove(region.ptr + d, src.ptr + s, self.length)
        return None
