"""`LoopbackEngine`: an in-process `Transport`, for unit tests of messenger logic (S5 surface,
S4c counting) without libfabric endpoints or a second process.

It offers what callers use of `TransferEngine` and behaves the same where a caller can tell:
the argument and bounds checks are the real engine's own (`write_checks`, `PagedWrite`), so
are the counters (`imm_counting.ImmCounting`), descriptors and addresses are the real classes
and round-trip through bytes, a paged write delivers one immediate per page, on_done/on_error
and counter callbacks run on an engine thread (the `DeliveryQueue`, standing in for a progress
thread), a callback's exception resurfaces on the owner's next call, and a write to a gone
peer fails through `on_error` with `PeerError`. `tests/transfer_core/test_transport.py` holds
both engines to the protocol; `tests/transfer_core/testing/test_loopback_contract.py` runs one
scenario on both.

Differences, on purpose: ops never time out (`timeout_s` is accepted and ignored), bytes move
(memmove, `loopback_memory.py`) when the sender's queue runs the write, and three test hooks
exist: `hold()` / `release()` park outgoing writes, `drop_imm(predicate)` loses arriving
immediates, and `deliver_inline=True` runs everything in the caller's thread.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transfer_core import write_checks as checks
from transfer_core.completion import Completion, OnDone, OnError
from transfer_core.errors import (
    PeerError,
    ProviderNotFoundError,
    TransferError,
    TransferTimeoutError,
)
from transfer_core.imm_counter import ImmCounterMap
from transfer_core.imm_counting import ImmCounting
from transfer_core.memory import EngineAddress, MemoryRegion, MemoryRegionDescriptor
from transfer_core.memory_paths import check_memory_path
from transfer_core.owner_errors import OwnerErrors
from transfer_core.pyfabric import Stats
from transfer_core.testing.loopback_counts import LoopbackCounts
from transfer_core.testing.loopback_memory import RegionTable, WritePart
from transfer_core.testing.loopback_wire import (
    DeliveryQueue,
    LoopbackFabric,
    default_fabric,
)
from transfer_core.transport import PagedWrite

__all__ = ["LoopbackEngine", "LoopbackFabric", "default_fabric"]

PROVIDER = "loopback"
_engine_ids = itertools.count()


class LoopbackEngine(ImmCounting):
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
        num_domains = checks.check_num_domains(num_domains)
        self.memory_path = check_memory_path(memory_path)
        if hmem:
            raise ProviderNotFoundError("the loopback provider has no FI_HMEM")
        self.timeout_s = timeout_s
        self.fabric = fabric or default_fabric()
        self.deliver_inline = deliver_inline
        self._drop: Callable[[int], bool] | None = None
        self._errors = OwnerErrors("loopback engine")
        # Deliveries never nap here: `expect_soon` changes nothing but the map's soon values.
        self.imm_counters = ImmCounterMap(fire=self._fire)
        self._round_robin = itertools.count()
        self.counts = LoopbackCounts(num_domains)  # `WritePart` counts its completions here
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

    def post_write(
        self,
        src_mr: MemoryRegion,
        offset: int,
        length: int,
        imm_data: int | None,
        dst_mr: MemoryRegionDescriptor,
        dst_offset: int,
        on_done: OnDone | None = None,
        on_error: OnError | None = None,
        *,
        timeout_s: float | None = None,
        domain: int | None = None,
    ) -> None:
        """As `TransferEngine.post_write`."""
        self._check_write(src_mr, dst_mr, imm_data)
        checks.check_single(src_mr, offset, length, dst_mr, dst_offset)
        d = self._pick(domain)
        done = Completion(1, on_done, on_error, self._errors.report)
        at = np.zeros(1, np.int64)  # one write: offsets relative to `offset` / `dst_offset`
        part = WritePart(
            self, d, done, src_mr, dst_mr, length, imm_data, offset + at, dst_offset + at
        )
        self._post(part)

    def write_and_wait(
        self,
        src_mr: MemoryRegion,
        offset: int,
        length: int,
        imm_data: int | None,
        dst_mr: MemoryRegionDescriptor,
        dst_offset: int,
        *,
        timeout_s: float | None = None,
        domain: int | None = None,
    ) -> None:
        """As `TransferEngine.write_and_wait`: returns once done, raises the write's error
        (here through `post_write` and a wait, as nothing to reap exists)."""
        done, failed = threading.Event(), []

        def on_error(error: TransferError) -> None:
            failed.append(error)
            done.set()

        self.post_write(
            src_mr, offset, length, imm_data, dst_mr, dst_offset, done.set, on_error, domain=domain
        )
        if not done.wait(self.timeout_s if timeout_s is None else timeout_s):
            raise TransferTimeoutError("loopback waited write not finished")
        if failed:
            raise failed[0]

    def post_paged_writes(
        self,
        write: PagedWrite,
        on_done: OnDone | None = None,
        on_error: OnError | None = None,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """As `TransferEngine.post_paged_writes`: one immediate per page, striped the same."""
        self._check_write(write.src_mr, write.dst_mr, write.imm)
        parts = checks.stripe(
            write.num_pages, checks.check_domains(write.domains, self.num_domains)
        )
        done = Completion(len(parts), on_done, on_error, self._errors.report)
        src, dst = write.src_byte_offsets(), write.dst_byte_offsets()
        for d, lo, hi in parts:
            self._post(
                WritePart(
                    self,
                    d,
                    done,
                    write.src_mr,
                    write.dst_mr,
                    write.nbytes,
                    write.imm if write.imms is None else write.imms[lo:hi],
                    src[lo:hi],
                    dst[lo:hi],
                )
            )

    def post_imm(
        self,
        imm_data: int,
        dst_mr: MemoryRegionDescriptor,
        on_done: OnDone | None = None,
        on_error: OnError | None = None,
        *,
        timeout_s: float | None = None,
        domain: int | None = None,
    ) -> None:
        """As `TransferEngine.post_imm`: a zero-byte write carrying one immediate."""
        self._check_write(None, dst_mr, imm_data)
        if imm_data is None:
            raise ValueError("post_imm needs an imm value")
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

    def abandon_peer(self, peer_address: bytes) -> None:
        """As `TransferEngine.abandon_peer`: writes to that peer parked by `hold()` (the
        only ones still in flight here) fail with `PeerError` and never land."""
        self._check_open()
        gone = set(EngineAddress.from_bytes(peer_address).domains)

        def goes_there(job: Callable[[], None]) -> bool:
            part = getattr(job, "__self__", None)
            return isinstance(part, WritePart) and part.peer_address in gone

        error = PeerError("rma write: the peer was given up before the write completed")
        for cancel in self.delivery.take_held(goes_there):  # on_error on our thread, as ever
            self.delivery.put(functools.partial(cancel, error))

    # -- counters (expect_imm_count and the rest: inherited from ImmCounting, S4c) ----------

    @property
    def dropped_imms(self) -> int:
        """As `TransferEngine.dropped_imms`, plus the arrivals `drop_imm` lost."""
        return self.counts.hook_dropped + self.imm_counters.dropped

    def stats(self) -> list[Stats]:
        """Per domain: writes posted and completed, immediates received, bytes written by
        writes that landed (no EAGAIN here)."""
        return self.counts.stats()

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

    # -- internals (WritePart calls the first) ------------------------------------------------

    def arrive(self, d: int, imm: int, count: int) -> None:
        """`count` immediates of value `imm` landed on our domain `d` (from any thread)."""
        self.delivery.put(lambda: self._count(d, imm, count))

    def _count(self, d: int, imm: int, count: int) -> None:
        drop = self._drop
        dropped = drop is not None and drop(imm)
        self.counts.arrived(d, count, dropped)
        if not dropped:
            self.imm_counters.on_imms([(imm, count)])

    def _post(self, part: WritePart) -> None:
        self.counts.posted(part.domain, part.n)
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
