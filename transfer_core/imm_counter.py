"""`ImmCounterMap`: count immediate values per value and fire once an expected count is reached.

The decoder is not told "your KV has arrived" by a message (S4c): every write of a request
carries the request's immediate value, the receiver counts them, and when the known number
of writes has landed the request is ready. Writes may land before the decoder registers its
expectation, so arrivals without an expectation are kept and count towards it. A counter
fires exactly once and is then removed. Pure Python, thread-safe; callbacks run outside the
lock through `fire`, so the engine can route them to its own thread (only the `on_soon` hook
runs under it, so that the workers see the levels in the order they changed; the engine's
hook is an atomic store per worker). Arrivals come in
batches (`on_imms`, as a progress loop reports them) and pass through the taps first: fault
injection loses or duplicates arrivals there (`faults.py`).

Anyone who can reach the endpoint can send immediates (S5), so what is kept for values nobody
expects is bounded: at most `max_unarmed` distinct values, each for `unarmed_ttl_s`; arrivals
beyond that are dropped and counted in `dropped`. `random_imm` draws the values a receiver
arms, so that a sender cannot guess them.
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

logger = logging.getLogger(__name__)

Callback = Callable[[], None]
ImmBatch = list[tuple[int, int]]  # (imm value, arrivals of it), as a progress loop reports them
ImmTap = Callable[[ImmBatch], ImmBatch]  # sees a batch before it is counted; returns what counts
MAX_IMM = 2**32 - 1
# Early arrivals are legitimate only for a moment (a counter re-armed by the quarantine, or a
# write racing its expectation): a few thousand distinct values for half a minute is plenty.
MAX_UNARMED_IMMS = 4096
UNARMED_IMM_TTL_S = 30.0


class Due(enum.IntEnum):
    """How soon the writes of the values marked `soon` will land: what the engine's workers do
    while they wait (the C worker's `fabp_set_eager` levels)."""

    IDLE = 0  # nothing marked: sleep on the completion fd, or nap longer the longer idle
    SOON = 1  # within milliseconds (a forward's last layer): napping workers nap their shortest
    NOW = 2  # back to back (a bulk transfer): also, workers with a CQ fd poll it after activity


def _call(callback: Callback) -> None:
    callback()


def random_imm(in_use: Callable[[int], bool], attempts: int = 64) -> int:
    """A random 32-bit immediate value, never 0, for which `in_use` is False."""
    for _ in range(attempts):
        imm = secrets.randbelow(MAX_IMM) + 1
        if not in_use(imm):
            return imm
    raise RuntimeError(f"no free immediate value in {attempts} random draws")


class ImmCounterMap:
    """imm value -> (arrivals so far, expected count, on_reached)."""

    def __init__(
        self,
        fire: Callable[[Callback], None] = _call,
        max_unarmed: int = MAX_UNARMED_IMMS,
        unarmed_ttl_s: float = UNARMED_IMM_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        on_soon: Callable[[Due], None] = lambda _: None,
    ) -> None:
        if max_unarmed < 0 or unarmed_ttl_s < 0:
            raise ValueError(f"max_unarmed and unarmed_ttl_s must be >= 0, got "
                             f"{max_unarmed}, {unarmed_ttl_s}")
        self._fire = fire
        self._max_unarmed = max_unarmed
        self._ttl_s = unarmed_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}
        self._expected: dict[int, tuple[int, Callback]] = {}
        # Values counted with no expectation, oldest first: imm -> when it was first seen.
        self._unarmed: OrderedDict[int, float] = OrderedDict()
        self.dropped = 0  # arrivals thrown away: over the bound, or kept past their time
        self._taps: list[ImmTap] = []
        # Armed values whose arrivals are due (`soon`), and how soon; `on_soon(level)` whenever
        # the most urgent level among them changes (Due.IDLE as the last one goes: fired,
        # removed or replaced).
        self._soon: dict[int, Due] = {}
        self._due = Due.IDLE
        self._on_soon = on_soon

    def expect(self, imm: int, count: int, on_reached: Callback) -> tuple[int, int] | None:
        """Fire `on_reached` once `count` arrivals of `imm` have been seen (including any that
        came before this call, unless they were kept past their time), then forget the counter.

        Replacing an unfinished expectation discards it and its arrivals, and returns them as
        `(counted, expected)`; otherwise returns None.
        """
        if count < 1:
            raise ValueError(f"expected count must be >= 1, got {count} for imm {imm}")
        with self._lock:
            self._expire()
            self._unarmed.pop(imm, None)
            previous = self._expected.pop(imm, None)
            replaced = None
            if previous is not None:
                replaced = (self._counts.pop(imm, 0), previous[0])
                self._not_soon(imm)
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
            self._unarmed.pop(imm, None)
            previous = self._expected.pop(imm, None)
            self._not_soon(imm)
        return None if previous is None else (counted, previous[0])

    def soon(self, imm: int, level: Due = Due.SOON) -> bool:
        """The arrivals the expectation of `imm` waits for are due (`level`: how soon): it
        counts among the `on_soon` values until it fires or is removed. False (and nothing
        changes) when `imm` has no expectation (it fired already, or never was armed)."""
        if level == Due.IDLE:
            raise ValueError("soon() marks a value due: SOON or NOW, not IDLE")
        with self._lock:
            if imm not in self._expected:
                return False
            self._soon[imm] = max(level, self._soon.get(imm, Due.IDLE))
            self._update_due()
            return True

    def soon_count(self) -> int:
        """Expectations marked `soon` and not yet fired or removed."""
        with self._lock:
            return len(self._soon)

    def tap(self, tap: ImmTap) -> None:
        """Pass every batch `on_imms` gets through `tap` (after the taps added before)."""
        self._taps.append(tap)

    def on_imms(self, imms: ImmBatch) -> None:
        """Record a batch of arrivals, after the taps have seen it."""
        for tap in self._taps:
            imms = tap(imms)
        for imm, n in imms:
            self.on_imm(imm, n)

    def on_imm(self, imm: int, n: int = 1) -> None:
        """Record `n` arrivals of `imm` (the progress loop reports them batched per value)."""
        with self._lock:
            target = self._expected.get(imm)
            if target is None and not self._keep_unarmed(imm, n):
                return
            counted = self._counts.get(imm, 0) + n
            self._counts[imm] = counted
            if target is None or counted < target[0]:
                return
            del self._expected[imm]
            self._take(imm, target[0])
            self._not_soon(imm)
        self._fire(target[1])

    def counted(self, imm: int) -> int:
        """Arrivals of `imm` not yet consumed by a fired expectation."""
        with self._lock:
            return self._counts.get(imm, 0)

    def pending(self) -> dict[int, tuple[int, int]]:
        """Snapshot of unfinished expectations: imm -> (counted, expected)."""
        with self._lock:
            return {imm: (self._counts.get(imm, 0), c) for imm, (c, _) in self._expected.items()}

    def unarmed(self) -> int:
        """Distinct values counted with no expectation (at most `max_unarmed`)."""
        with self._lock:
            return len(self._unarmed)

    def _keep_unarmed(self, imm: int, n: int) -> bool:
        """Lock held: whether arrivals of an unexpected `imm` may be kept; else drop them."""
        self._expire()
        if imm not in self._unarmed:
            if len(self._unarmed) >= self._max_unarmed:
                self.dropped += n
                if self.dropped == n or self.dropped % 4096 < n:  # once, then every 4096
                    logger.warning("immediates of unexpected values dropped: %d so far "
                                   "(%d values kept)", self.dropped, len(self._unarmed))
                return False
            self._unarmed[imm] = self._clock()
        return True

    def _not_soon(self, imm: int) -> None:
        """Lock held: `imm` no longer waits."""
        if self._soon.pop(imm, None) is not None:
            self._update_due()

    def _update_due(self) -> None:
        """Lock held: tell `on_soon` when the most urgent level among the marked values moved."""
        due = max(self._soon.values(), default=Due.IDLE)
        if due != self._due:
            self._due = due
            self._on_soon(due)

    def _expire(self) -> None:
        """Lock held: drop the arrivals of unexpected values kept longer than the TTL."""
        now = self._clock()
        while self._unarmed:
            imm, since = next(iter(self._unarmed.items()))
            if now - since < self._ttl_s:
                return
            del self._unarmed[imm]
            self.dropped += self._counts.pop(imm, 0)

    def _take(self, imm: int, count: int) -> None:
        """Consume `count` arrivals (lock held). Surplus ones are kept for a later expectation:
        they mean an imm value was reused before its writes all landed, so say so."""
        leftover = self._counts.pop(imm) - count
        if leftover:
            logger.warning("imm %d: %d more arrivals than the %d expected", imm, leftover, count)
            if self._keep_unarmed(imm, leftover):
                self._counts[imm] = leftover
