"""`LoopbackEngine`: an in-process stand-in for `TransferEngine`, for unit tests of messenger
logic (S5 surface, S4c counting) without libfabric endpoints or a second process.

It offers what callers use of `TransferEngine` and behaves the same where a caller can tell:
the argument and bounds checks are the real engine's own (`write_checks`), descriptors and
addresses are the real classes and round-trip through bytes, a paged write delivers one
immediate per page, on_done/on_error and counter callbacks run on an engine thread (the
`DeliveryQueue`, standing in for a progress thread), a callback's exception resurfaces on the
owner's next call, and a write to a gone peer fails through `on_error` with `PeerError`.
`tests/transfer_core/testing/test_loopback_contract.py` runs one scenario on both engines.

Differences, on purpose: ops never time out (`timeout_s` is accepted and ignored), bytes move
(memmove, `loopback_memory.py`) when the sender's queue runs the write, and three test hooks
exist: `hold()` / `release()` park outgoing writes, `drop_imm(predicate)` loses arriving
immediates, and `deliver_inline=True` runs everything in the caller's thread.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transfer_core import write_checks as checks
from transfer_core.domain_worker import Completion, OnDone, OnError
from transfer_core.errors import ProviderNotFoundError, TransferError, TransferTimeoutError
from transfer_core.imm_counter import ImmCounterMap
from transfer_core.memory import EngineAddress, MemoryRegion, MemoryRegionDescriptor
from transfer_core.memory_paths import MEMORY_PATHS
from transfer_core.owner_errors import OwnerErrors
from transfer_core.pyfabric import Stats
from transfer_core.testing.loopback_memory import RegionTable, WritePart
from transfer_core.testing.loopback_wire import (
    DeliveryQueue,
    LoopbackFabric,
    default_fabric,
)

__all__ = ["LoopbackEngine", "LoopbackFabric", "default_fabric"]

PROVIDER = "loopback"
_engine_ids = itertools.count()


class LoopbackEngine:
    """`TransferEngine`'s caller-facing API over a `LoopbackFabric`; see the module docstring.

    `provider`, `node`, `cpus`, `domain_cpus`, `nics`, `delivery_complete` and `max_inflight`
    are accepted so that factories written for `TransferEngine` (e.g. `staging.open_engine`)
    can build one, and ignored; `hmem=True` raises ProviderNotFoundError, as a provider
    without FI_HMEM would."""

    def __init__(
        self,
        provider: str | Sequence[str] = PROVIDER,
        node: str | None = None,
        num_domains: int = 1,
        cpus: Sequence[int] | None = None,
        *,
        fabric: LoopbackFabric | None = None,
        deliver_inline: bool = False,
        hmem: bool = False,
        delivery_complete: bool = False,
        timeout_s: float = 30.0,
        max_inflight: int | None = None,
        memory_path: str = "auto",
        domain_cpus: Sequence[Sequence[int]] | None = None,
        nics: Sequence[str | None] | None = None,
    ) -> None:
        del provider, node, cpus, delivery_complete, max_inflight  # see the class docstring
        del domain_cpus, nics
        if num_domains < 1:
            raise ValueError(f"num_domains must be >= 1, got {num_domains}")
        if memory_path not in MEMORY_PATHS:
            raise ValueError(f"unknown memory_path {memory_path!r}: expected one of {MEMORY_PATHS}")
        if hmem:
            raise ProviderNotFoundError("the loopback provider has no FI_HMEM")
        self.memory_path = memory_path
        self.timeout_s = timeout_s
        self.fabric = fabric or default_fabric()
        self.deliver_inline = deliver_inline
        self._hook_dropped = 0
        self._drop: Callable[[int], bool] | None = None
        self._errors = OwnerErrors("loopback engine")
        self._lock = threading.Lock()
        self._counters = ImmCounterMap(fire=self._fire)
        self._round_robin = itertools.count()
        self._stats = [[0, 0, 0, 0] for _ in range(num_domains)]  # posted, done, imms, bytes
        self._closed = False
        name = f"loopback-delivery-{next(_engine_ids)}"
        self.delivery = DeliveryQueue(name, deliver_inline, self._errors.guard)
        self._endpoints = self.fabric.attach(self, num_domains)
        self._address = EngineAddress(PROVIDER, self._endpoints)
        self.regions = RegionTable(PROVIDER, self._endpoints)

    # -- identity ---------------------------------------------------------------------------

    @property
    def provider(self) -> str:
        return PROVIDER

    @property
    def num_domains(self) -> int:
        return len(self._endpoints)

    @property
    def supports_hmem(self) -> bool:
        return False

    @property
    def address(self) -> bytes:
        return self._address.to_bytes()

    # -- memory -----------------------------------------------------------------------------

    def register_memory(
        self, buffer: Any, name: str | None = None, *, remote_write: bool = True
    ) -> tuple[MemoryRegion, MemoryRegionDescriptor]:
        """As `TransferEngine.register_memory`: host memory only, the descriptor holds the
        region's VA (like shm's FI_MR_VIRT_ADDR) and one (endpoint, key) per domain; a write
        into a region registered without `remote_write` lands nothing, as on tcp and shm."""
        self._check_open()
        return self.regions.register(buffer, name, remote_write)

    def unregister_memory(self, region: MemoryRegion) -> None:
        self.regions.unregister(region)

    # -- writes -----------------------------------------------------------------------------

    def submit_write(
        self, src_mr: MemoryRegion, offset: int, length: int, imm_data: int | None,
        dst_mr: MemoryRegionDescriptor, dst_offset: int, on_done: OnDone | None = None,
        on_error: OnError | None = None, *, timeout_s: float | None = None,
        domain: int | None = None,
    ) -> None:  # fmt: skip
        """As `TransferEngine.submit_write`."""
        self._check_write(src_mr, dst_mr, imm_data)
        checks.check_single(src_mr, offset, length, dst_mr, dst_offset)
        d = self._pick(domain)
        done = Completion(1, on_done, on_error, self._errors.report)
        at = np.zeros(1, np.int64)  # one write: offsets relative to `offset` / `dst_offset`
        self._post(WritePart(self, d, done, src_mr, dst_mr, length, imm_data,
                             offset + at, dst_offset + at))  # fmt: skip

    def write_and_wait(
        self, src_mr: MemoryRegion, offset: int, length: int, imm_data: int | None,
        dst_mr: MemoryRegionDescriptor, dst_offset: int, *, timeout_s: float | None = None,
        domain: int | None = None,
    ) -> None:  # fmt: skip
        """As `TransferEngine.write_and_wait`: returns once done, raises the write's error
        (here through `submit_write` and a wait, as nothing to reap exists)."""
        done, failed = threading.Event(), []
        self.submit_write(src_mr, offset, length, imm_data, dst_mr, dst_offset, done.set,
                          lambda e: (failed.append(e), done.set()), domain=domain)  # fmt: skip
        if not done.wait(self.timeout_s if timeout_s is None else timeout_s):
            raise TransferTimeoutError("loopback waited write not finished")
        if failed:
            raise failed[0]

    def submit_paged_writes(
        self, length: int, src_mr: MemoryRegion, src_page_indices: Sequence[int] | np.ndarray,
        src_stride: int, src_offset: int, dst_mr: MemoryRegionDescriptor,
        dst_page_indices: Sequence[int] | np.ndarray, dst_stride: int, dst_offset: int,
        imm_data: int | None, on_done: OnDone | None = None, on_error: OnError | None = None,
        *, timeout_s: float | None = None, domains: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        """As `TransferEngine.submit_paged_writes`: one immediate per page, striped the same."""
        self._check_write(src_mr, dst_mr, imm_data)
        src, dst = checks.check_paged(
            length, src_mr, src_page_indices, src_stride, src_offset,
            dst_mr, dst_page_indices, dst_stride, dst_offset,
        )  # fmt: skip
        parts = checks.stripe(src.size, checks.check_domains(domains, self.num_domains))
        done = Completion(len(parts), on_done, on_error, self._errors.report)
        for d, lo, hi in parts:
            self._post(WritePart(self, d, done, src_mr, dst_mr, length, imm_data,
                                 src_offset + src[lo:hi] * src_stride,
                                 dst_offset + dst[lo:hi] * dst_stride))  # fmt: skip

    def submit_imm(
        self, imm_data: int, dst_mr: MemoryRegionDescriptor, on_done: OnDone | None = None,
        on_error: OnError | None = None, *, timeout_s: float | None = None,
        domain: int | None = None,
    ) -> None:  # fmt: skip
        """As `TransferEngine.submit_imm`: a zero-byte write carrying one immediate."""
        self._check_write(None, dst_mr, imm_data)
        if imm_data is None:
            raise ValueError("submit_imm needs an imm value")
        d = self._pick(domain)
        done = Completion(1, on_done, on_error, self._errors.report)
        zero = np.zeros(1, np.int64)
        self._post(WritePart(self, d, done, None, dst_mr, 0, imm_data, zero, zero))

    def connect(self, peer_address: bytes, *, timeout_s: float | None = None) -> None:
        """As `TransferEngine.connect`: checks the peer is on the fabric; counts nothing."""
        self._check_open()
        if threading.current_thread() is self.delivery.thread:
            raise RuntimeError("LoopbackEngine.connect() would block its own callback thread")
        self.fabric.check_reachable(PROVIDER, peer_address, self.num_domains)

    # -- immediate counters -----------------------------------------------------------------

    def expect_imm_count(self, imm: int, count: int, on_reached: OnDone) -> tuple[int, int] | None:
        self._check_open()
        return self._counters.expect(imm, count, on_reached)

    def remove_imm_count(self, imm: int) -> tuple[int, int] | None:
        return self._counters.remove(imm)

    def pending_imm_counts(self) -> dict[int, tuple[int, int]]:
        return self._counters.pending()

    def imm_counted(self, imm: int) -> int:
        return self._counters.counted(imm)

    @property
    def dropped_imms(self) -> int:
        """As `TransferEngine.dropped_imms`, plus the arrivals `drop_imm` lost."""
        return self._hook_dropped + self._counters.dropped

    def stats(self) -> list[Stats]:
        """Per domain: writes posted and completed, immediates received, bytes written by
        writes that landed (no EAGAIN here)."""
        with self._lock:
            return [Stats(p, c, 0, i, 0, 0, p - c, b) for p, c, i, b in self._stats]

    # -- test hooks -------------------------------------------------------------------------

    def hold(self) -> None:
        """Park writes submitted from now on (they stay "in flight") until `release()`."""
        self.delivery.hold()

    def release(self) -> None:
        """Deliver the parked writes, in submission order."""
        self.delivery.release()

    def held_writes(self) -> int:
        """Write parts parked by `hold()` (a paged write is one part per domain)."""
        return self.delivery.held()

    def drop_imm(self, predicate: Callable[[int], bool] | None) -> None:
        """Arriving immediates whose value matches are not counted (the bytes still land);
        `None` stops dropping. `dropped_imms` counts the lost ones too."""
        self._drop = predicate

    # -- lifecycle --------------------------------------------------------------------------

    def close(self, drain_s: float = 5.0) -> None:
        """As `TransferEngine.close`: queued writes get `drain_s` to finish (parked ones
        cannot), the rest fail through `on_error`; then the engine leaves the fabric."""
        if self._closed:
            return
        if threading.current_thread() is self.delivery.thread:
            raise RuntimeError("LoopbackEngine.close() called from its own callback thread")
        self._closed = True
        error = TransferError("engine closed before the operation finished (loopback)")
        for cancel in self.delivery.stop(drain_s):
            self._errors.guard(cancel, error)
        self.fabric.detach(self._endpoints)
        self.regions.close()

    def __enter__(self) -> LoopbackEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (WritePart calls the first two) -------------------------------------------

    def count_posted(self, d: int, n: int, completed: bool, nbytes: int = 0) -> None:
        with self._lock:
            self._stats[d][1 if completed else 0] += n
            self._stats[d][3] += nbytes

    def arrive(self, d: int, imm: int, count: int) -> None:
        """`count` immediates of value `imm` landed on our domain `d` (from any thread)."""
        self.delivery.put(lambda: self._count(d, imm, count))

    def _count(self, d: int, imm: int, count: int) -> None:
        drop = self._drop
        dropped = drop is not None and drop(imm)
        with self._lock:
            self._stats[d][2] += count
            self._hook_dropped += count if dropped else 0
        if not dropped:
            self._counters.on_imm(imm, count)

    def _post(self, part: WritePart) -> None:
        self.count_posted(part.domain, part.n, completed=False)
        self.delivery.put(part.run, part.fail, holdable=True)

    def _pick(self, domain: int | None) -> int:
        if domain is None:
            return next(self._round_robin) % self.num_domains
        return checks.check_domain(domain, self.num_domains)

    def _check_write(
        self, src_mr: MemoryRegion | None, dst_mr: MemoryRegionDescriptor, imm_data: int | None
    ) -> None:
        self._check_open()
        if src_mr is not None and src_mr not in self.regions:
            raise ValueError(f"region {src_mr.name!r} is not registered with this engine")
        checks.check_target(PROVIDER, dst_mr, imm_data)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("engine is closed")
        self._errors.raise_first()

    def _fire(self, callback: OnDone) -> None:
        """Counter callbacks run on our delivery thread, as the real engine's on its own."""
        if self.deliver_inline or threading.current_thread() is self.delivery.thread:
            self._errors.guard(callback)
        else:
            self.delivery.put(callback)
