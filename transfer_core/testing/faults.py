"""A fault-injecting `TransferEngine` for tests, deterministic by seed (issue 8).

It wraps the real engine and the real fabric: every operation still happens, unless the fault
plan says otherwise. Faults: delayed (hence reordered) operations, failed writes (reported
through `on_error`, nothing posted), lost and duplicated immediates on the receiving side, and a
peer that stops answering (after N operations its submissions are swallowed and time out).
One seeded `random.Random` drives every decision, in the order operations are made. Faults
act on the request data path, writes that carry an immediate: a write without one (the
ownership proof a prefiller writes at handshake, S5) is posted as it is and counts as no
operation, so a fault plan never stops a node from joining. Waited writes (`write_and_wait`,
`prepare_write`) are posted as they are too: the fault plan does not cover them yet.
"""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass
from typing import Any

from transfer_core.engine import TransferEngine
from transfer_core.errors import FabricError, TransferTimeoutError

logger = logging.getLogger(__name__)


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
        """"seed=1,drop_imm=0.01,stop_after=50" -> FaultPlan (for `--faults` on serve)."""
        fields: dict[str, Any] = {}
        for item in filter(None, spec.split(",")):
            name, _, value = item.partition("=")
            if name not in FaultPlan.__dataclass_fields__:
                raise ValueError(f"unknown fault {name!r} in {spec!r}")
            fields[name] = int(value) if name in ("seed", "stop_after") else float(value)
        return FaultPlan(**fields)


class FaultyTransferEngine(TransferEngine):
    """`TransferEngine` with injected faults; see `FaultPlan`."""

    def __init__(self, *args: Any, faults: FaultPlan, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = faults
        self._rng = random.Random(faults.seed)
        self._rng_lock = threading.Lock()
        self._ops = 0
        self.injected = {"delay": 0, "fail_write": 0, "drop_imm": 0, "duplicate_imm": 0,
                         "swallowed": 0}

    def _roll(self, probability: float) -> bool:
        with self._rng_lock:
            return probability > 0 and self._rng.random() < probability

    def _sender_fault(self, op: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        with self._rng_lock:
            self._ops += 1
            stopped = self.faults.stop_after is not None and self._ops > self.faults.stop_after
        on_error = kwargs.get("on_error")
        if stopped:
            self.injected["swallowed"] += 1
            timeout = kwargs.get("timeout_s") or self.timeout_s
            if on_error is not None:
                error = TransferTimeoutError(f"injected: peer stopped answering ({timeout} s)")
                threading.Timer(timeout, on_error, args=(error,)).start()
            return
        if self._roll(self.faults.fail_write):
            self.injected["fail_write"] += 1
            if on_error is not None:
                error = FabricError("fi_writedata", 5, "injected write failure")
                threading.Timer(0.001, on_error, args=(error,)).start()
            return
        if self._roll(self.faults.delay):
            self.injected["delay"] += 1
            with self._rng_lock:
                wait = self._rng.uniform(0, self.faults.max_delay_s)
            threading.Timer(wait, self._post_late, args=(op, args, kwargs)).start()
            return
        op(*args, **kwargs)

    @staticmethod
    def _post_late(op: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        try:
            op(*args, **kwargs)
        except Exception as error:  # refused late (closed engine, bounds): report, never lose
            on_error = kwargs.get("on_error")
            if on_error is None:
                raise
            on_error(error)

    def submit_write(self, *args: Any, **kwargs: Any) -> None:
        """As `TransferEngine.submit_write`, through the fault plan if it carries an imm."""
        imm = args[3] if len(args) > 3 else kwargs.get("imm_data")
        if imm is None:  # a handshake's ownership proof: posted as it is (see the docstring)
            super().submit_write(*args, **kwargs)
            return
        self._sender_fault(super().submit_write, args, kwargs)

    def submit_paged_writes(self, *args: Any, **kwargs: Any) -> None:
        """As `TransferEngine.submit_paged_writes`, through the fault plan."""
        self._sender_fault(super().submit_paged_writes, args, kwargs)

    def submit_imm(self, *args: Any, **kwargs: Any) -> None:
        """As `TransferEngine.submit_imm`, through the fault plan."""
        self._sender_fault(super().submit_imm, args, kwargs)

    def _on_imms(self, imms: list[tuple[int, int]]) -> None:
        kept = []
        for imm, count in imms:
            for _ in range(count):
                if self._roll(self.faults.drop_imm):
                    self.injected["drop_imm"] += 1
                    continue
                copies = 2 if self._roll(self.faults.duplicate_imm) else 1
                self.injected["duplicate_imm"] += copies - 1
                kept.append((imm, copies))
        super()._on_imms(kept)
