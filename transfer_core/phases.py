"""Where a transfer's time goes, phase by phase (S5, S4c): the record of a timed engine.

A `TransferEngine(phases=PhaseLog())` times every op and every batch of immediates on its
progress threads: the C loop stamps an op when it is submitted, when its first and last write
are posted and when it is reported (`OpTimes`), and a batch of arrivals when its first and
last immediate were reaped (`ImmArrival`); the thread adds when the C call handed them back
and when their callbacks ran. All stamps are CLOCK_MONOTONIC ns (`time.monotonic_ns`), so two
processes on one host compare. `benchmarks/transfer_phases.py` turns them into the table.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from transfer_core.pyfabric import ImmArrival, OpTimes

# A log keeps the newest records only: a timed engine left on must not grow without bound.
DEFAULT_CAPACITY = 65536


@dataclass(frozen=True)
class OpRecord:
    """One op on a sender: its C stamps, then `returned_ns` (the progress call that reported
    it returned to Python) and its callback's start and end."""

    domain: int
    op_id: int
    err: int
    times: OpTimes
    returned_ns: int
    callback_ns: int
    callback_end_ns: int


@dataclass(frozen=True)
class ImmRecord:
    """One batch of arrivals on a receiver: its C stamps, then when the progress call
    returned and when the counters had taken the batch (expectations fired included, for
    those run on the progress thread)."""

    domain: int
    arrival: ImmArrival
    returned_ns: int
    counted_ns: int


class PhaseLog:
    """The records of a timed engine, newest `capacity` of each kind; any thread may read.
    A record is added after the callbacks it times ran: one who learnt from a callback that a
    transfer ended waits for its record (`wait_ops`, `wait_arrivals`)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._lock = threading.Condition()
        self._ops: deque[OpRecord] = deque(maxlen=capacity)
        self._imms: deque[ImmRecord] = deque(maxlen=capacity)

    def add_op(self, record: OpRecord) -> None:
        with self._lock:
            self._ops.append(record)
            self._lock.notify_all()

    def add_imms(self, record: ImmRecord) -> None:
        with self._lock:
            self._imms.append(record)
            self._lock.notify_all()

    def wait_ops(self, count: int, timeout_s: float = 5.0) -> list[OpRecord]:
        """The op records once there are `count` of them; `TimeoutError` after `timeout_s`."""
        with self._lock:
            if not self._lock.wait_for(lambda: len(self._ops) >= count, timeout_s):
                raise TimeoutError(f"{len(self._ops)} op records, not {count}")
            return list(self._ops)

    def wait_arrivals(self, imm: int, count: int, timeout_s: float = 5.0) -> list[ImmRecord]:
        """The records of `imm` once they add up to `count` arrivals; `TimeoutError` after
        `timeout_s`."""

        def records() -> list[ImmRecord]:
            return [r for r in self._imms if r.arrival.imm == imm]

        def arrived() -> int:
            return sum(r.arrival.count for r in records())

        with self._lock:
            if not self._lock.wait_for(lambda: arrived() >= count, timeout_s):
                raise TimeoutError(f"{arrived()} arrivals of {imm} recorded, not {count}")
            return records()

    def clear(self) -> None:
        with self._lock:
            self._ops.clear()
            self._imms.clear()
