"""`ImmCounterMap`: count immediate values per value and fire once an expected count is reached.

The decoder is not told "your KV has arrived" by a message (S4c): every write of a request
carries the request's immediate value, the receiver counts them, and when the known number
of writes has landed the request is ready. Writes may land before the decoder registers its
expectation, so arrivals without an expectation are kept and count towards it. A counter
fires exactly once and is then removed. Pure Python, thread-safe; callbacks run outside the
lock through `fire`, so the engine can route them to its own thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

Callback = Callable[[], None]


def _call(callback: Callback) -> None:
    callback()


class ImmCounterMap:
    """imm value -> (arrivals so far, expected count, on_reached)."""

    def __init__(self, fire: Callable[[Callback], None] = _call) -> None:
        self._fire = fire
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}
        self._expected: dict[int, tuple[int, Callback]] = {}

    def expect(self, imm: int, count: int, on_reached: Callback) -> tuple[int, int] | None:
        """Fire `on_reached` once `count` arrivals of `imm` have been seen (including any that
        came before this call), then forget the counter.

        Replacing an unfinished expectation discards it and its arrivals, and returns them as
        `(counted, expected)`; otherwise returns None.
        """
        if count < 1:
            raise ValueError(f"expected count must be >= 1, got {count} for imm {imm}")
        with self._lock:
            previous = self._expected.pop(imm, None)
            replaced = None
            if previous is not None:
                replaced = (self._counts.pop(imm, 0), previous[0])
            reached = self._counts.get(imm, 0) >= count
            if reached:
                self._take(imm, count)
            else:
                self._expected[imm] = (count, on_reached)
        if reached:
            self._fire(on_reached)
        return replaced

    def remove(self, imm: int) -> tuple[int, int] | None:
        """Forget `imm` (e.g. a cancelled transfer): its expectation and its arrivals.

        Returns `(counted, expected)` if an expectation was pending, else None."""
        with self._lock:
            counted = self._counts.pop(imm, 0)
            previous = self._expected.pop(imm, None)
        return None if previous is None else (counted, previous[0])

    def on_imm(self, imm: int, n: int = 1) -> None:
        """Record `n` arrivals of `imm` (the progress loop reports them batched per value)."""
        with self._lock:
            counted = self._counts.get(imm, 0) + n
            self._counts[imm] = counted
            target = self._expected.get(imm)
            if target is None or counted < target[0]:
                return
            del self._expected[imm]
            self._take(imm, target[0])
        self._fire(target[1])

    def counted(self, imm: int) -> int:
        """Arrivals of `imm` not yet consumed by a fired expectation."""
        with self._lock:
            return self._counts.get(imm, 0)

    def pending(self) -> dict[int, tuple[int, int]]:
        """Snapshot of unfinished expectations: imm -> (counted, expected)."""
        with self._lock:
            return {imm: (self._counts.get(imm, 0), c) for imm, (c, _) in self._expected.items()}

    def _take(self, imm: int, count: int) -> None:
        """Consume `count` arrivals (lock held). Surplus ones are kept for a later expectation:
        they mean an imm value was reused before its writes all landed, so say so."""
        leftover = self._counts.pop(imm) - count
        if leftover:
            logger.warning("imm %d: %d more arrivals than the %d expected", imm, leftover, count)
            self._counts[imm] = leftover
