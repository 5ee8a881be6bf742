"""`FaultyTransport`: fault injection as a wrapper over any `Transport`, deterministic by seed
(S5, S4c).

It wraps a real engine (or the loopback) and its fabric: every operation still happens,
unless the `FaultPlan` says otherwise. Faults: delayed (hence reordered) operations, failed
writes (reported through `on_error`, nothing posted), lost and duplicated immediates on the
receiving side (a tap on the inner engine's counters, `Transport.tap_imms`), and a peer that
stops answering (after N operations its submissions are swallowed and time out). One seeded
`random.Random` drives every decision, in the order operations are made. Faults act on the
request data path, writes that carry an immediate: a write without one (the ownership proof a
prefiller writes at handshake, S5) is posted as it is and counts as no operation, so a fault
plan never stops a node from joining. Waited writes (`write_and_wait`) are posted as they are
too: the fault plan does not cover them yet. A node runs with one under `--faults` (tests).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transfer_core.completion import OnDone, OnError
from transfer_core.errors import FabricError, TransferTimeoutError
from transfer_core.imm_counter import ImmBatch, ImmTap
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor
from transfer_core.pyfabric import Stats
from transfer_core.transport import PagedWrite, Transport


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Probabilities per operation (sender side) or per arrival (receiver side)."""

    seed: int = 0
    delay: float = 0.0  # probability an operation is posted late (reordering it)
    max_delay_s: float = 0.02
    fail_write: float = 0.0  # probability a write call fails without being posted
    drop_imm: float = 0.0  # probability an arriving immediate is not counted
    duplicate_imm: float = 0.0  # probability an arriving immediate is counted twice
    stop_after: int | None = None  # operations after which this side stops answering

    @staticmethod
    def parse(spec: str) -> FaultPlan:
        """ "seed=1,drop_imm=0.01,stop_after=50" -> FaultPlan (for `--faults` on serve)."""
        fields: dict[str, Any] = {}
        for item in filter(None, spec.split(",")):
            name, _, value = item.partition("=")
            if name not in FaultPlan.__dataclass_fields__:
                raise ValueError(f"unknown fault {name!r} in {spec!r}")
            fields[name] = int(value) if name in ("seed", "stop_after") else float(value)
        return FaultPlan(**fields)


class FaultyTransport:
    """`inner` with the faults of `plan` injected; a `Transport` itself.

    `injected` counts each fault made so far; `operations` the data-path operations seen."""

    def __init__(self, inner: Transport, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._rng_lock = threading.Lock()
        self.operations = 0
        self.injected = dict.fromkeys(
            ("delay", "fail_write", "drop_imm", "duplicate_imm", "swallowed"), 0
        )
        # Arrivals at the inner engine pass through the receiver's faults before they count.
        inner.tap_imms(self._receiver_faults)

    # -- identity and memory: the inner engine's ----------------------------------------------

    @property
    def timeout_s(self) -> float:
        return self.inner.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.inner.timeout_s = value

    @property
    def provider(self) -> str:
        return self.inner.provider

    @property
    def num_domains(self) -> int:
        return self.inner.num_domains

    @property
    def supports_hmem(self) -> bool:
        return self.inner.supports_hmem

    @property
    def memory_path(self) -> str:
        return self.inner.memory_path

    @property
    def address(self) -> bytes:
        return self.inner.address

    def register_memory(
        self, buffer: Any, name: str | None = None, *, remote_write: bool = True
    ) -> tuple[MemoryRegion, MemoryRegionDescriptor]:
        return self.inner.register_memory(buffer, name, remote_write=remote_write)

    def unregister_memory(self, region: MemoryRegion) -> None:
        self.inner.unregister_memory(region)

    # -- sender: through the fault plan ------------------------------------------------------

    def connect(self, peer_address: bytes, *, timeout_s: float | None = None) -> None:
        """As the inner engine's: the handshake is not part of the data path."""
        self.inner.connect(peer_address, timeout_s=timeout_s)

    def abandon_peer(self, peer_address: bytes) -> None:
        """As the inner engine's (operations swallowed or still to be posted late are not
        covered: they time out, or post, as drawn)."""
        self.inner.abandon_peer(peer_address)

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
        """The inner engine's, through the fault plan if it carries an imm."""

        def post() -> None:
            self.inner.post_write(
                src_mr,
                offset,
                length,
                imm_data,
                dst_mr,
                dst_offset,
                on_done,
                on_error,
                timeout_s=timeout_s,
                domain=domain,
            )

        if imm_data is None:  # a handshake's ownership proof: posted as it is (see the docstring)
            post()
            return
        self._sender_fault(post, on_error, timeout_s)

    def post_paged_writes(
        self,
        write: PagedWrite,
        on_done: OnDone | None = None,
        on_error: OnError | None = None,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """The inner engine's, through the fault plan."""

        def post() -> None:
            self.inner.post_paged_writes(write, on_done, on_error, timeout_s=timeout_s)

        self._sender_fault(post, on_error, timeout_s)

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
        """The inner engine's, through the fault plan."""

        def post() -> None:
            self.inner.post_imm(
                imm_data, dst_mr, on_done, on_error, timeout_s=timeout_s, domain=domain
            )

        self._sender_fault(post, on_error, timeout_s)

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
        """The inner engine's, as it is: the fault plan does not cover waited writes yet."""
        self.inner.write_and_wait(
            src_mr, offset, length, imm_data, dst_mr, dst_offset, timeout_s=timeout_s, domain=domain
        )

    # -- receiver: the inner engine's counters, fed through `_receiver_faults` ---------------

    def expect_imm_count(self, imm: int, count: int, on_reached: OnDone) -> tuple[int, int] | None:
        return self.inner.expect_imm_count(imm, count, on_reached)

    def expect_soon(self, imm: int, at_once: bool = False) -> bool:
        return self.inner.expect_soon(imm, at_once)

    def remove_imm_count(self, imm: int) -> tuple[int, int] | None:
        return self.inner.remove_imm_count(imm)

    def pending_imm_counts(self) -> dict[int, tuple[int, int]]:
        return self.inner.pending_imm_counts()

    def imm_counted(self, imm: int) -> int:
        return self.inner.imm_counted(imm)

    @property
    def dropped_imms(self) -> int:
        """The inner engine's; the arrivals this plan dropped are in `injected["drop_imm"]`."""
        return self.inner.dropped_imms

    def tap_imms(self, tap: ImmTap) -> None:
        """A tap after this plan's: it sees arrivals once the faults were applied."""
        self.inner.tap_imms(tap)

    # -- lifecycle ---------------------------------------------------------------------------

    def stats(self) -> list[Stats]:
        return self.inner.stats()

    def close(self, drain_s: float = 5.0) -> None:
        self.inner.close(drain_s)

    def __enter__(self) -> FaultyTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the faults ----------------------------------------------------------------------------

    def _roll(self, probability: float) -> bool:
        with self._rng_lock:
            return probability > 0 and self._rng.random() < probability

    def _sender_fault(
        self, post: Callable[[], None], on_error: OnError | None, timeout_s: float | None
    ) -> None:
        """Post, post late, fail or swallow one data-path operation, as the plan draws."""
        with self._rng_lock:
            self.operations += 1
            stop_after = self.plan.stop_after
            stopped = stop_after is not None and self.operations > stop_after
        if stopped:
            self.injected["swallowed"] += 1
            timeout = timeout_s or self.timeout_s
            if on_error is not None:
                error = TransferTimeoutError(f"injected: peer stopped answering ({timeout} s)")
                threading.Timer(timeout, on_error, args=(error,)).start()
            return
        if self._roll(self.plan.fail_write):
            self.injected["fail_write"] += 1
            if on_error is not None:
                error = FabricError("fi_writedata", 5, "injected write failure")
                threading.Timer(0.001, on_error, args=(error,)).start()
            return
        if self._roll(self.plan.delay):
            self.injected["delay"] += 1
            with self._rng_lock:
                wait = self._rng.uniform(0, self.plan.max_delay_s)
            threading.Timer(wait, self._post_late, args=(post, on_error)).start()
            return
        post()

    @staticmethod
    def _post_late(post: Callable[[], None], on_error: OnError | None) -> None:
        try:
            post()
        except Exception as error:  # refused late (closed engine, bounds): report, never lose
            if on_error is None:
                raise
            on_error(error)  # type: ignore[arg-type]  (a ValueError too, as the engine raised)

    def _receiver_faults(self, imms: ImmBatch) -> ImmBatch:
        """Each arrival dropped or counted twice, as the plan draws."""
        kept = []
        for imm, count in imms:
            for _ in range(count):
                if self._roll(self.plan.drop_imm):
                    self.injected["drop_imm"] += 1
                    continue
                copies = 2 if self._roll(self.plan.duplicate_imm) else 1
                self.injected["duplicate_imm"] += copies - 1
                kept.append((imm, copies))
        return kept
