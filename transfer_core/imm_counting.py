"""`ImmCounting`: the receiver's half of `Transport` (S4c), written once for every engine.

An engine holds its counters as an `imm_counter.ImmCounterMap` named `imm_counters`, feeds it
every batch of arriving immediates (`TransferEngine`: its domains' progress threads;
`LoopbackEngine`: its delivery queue) and routes the map's callbacks to its own thread. The
methods a messenger calls on those counters are inherited from here, so both engines count,
fire, forget and drop alike by construction; `FaultyTransport` forwards them to the engine it
wraps and taps that engine's arrivals. This is not the counting itself: that is the map.
"""

from __future__ import annotations

from transfer_core.completion import OnDone
from transfer_core.imm_counter import Due, ImmCounterMap, ImmTap


class ImmCounting:
    """The `Transport` counter methods of an engine that holds `imm_counters`.

    The engine provides `_check_open()` (raises once it is closed, or an error an engine
    thread kept for its owner), which arming a counter runs first."""

    imm_counters: ImmCounterMap

    def _check_open(self) -> None:
        raise NotImplementedError("an engine using ImmCounting defines _check_open")

    def expect_imm_count(self, imm: int, count: int, on_reached: OnDone) -> tuple[int, int] | None:
        """Call `on_reached` (on an engine thread) once `count` writes carrying `imm` have
        landed here, counting those that landed before this call; then forget `imm`.
        Replacing an unfinished counter of `imm` returns its (counted, expected)."""
        self._check_open()
        return self.imm_counters.expect(imm, count, on_reached)

    def expect_soon(self, imm: int, at_once: bool = False) -> bool:
        """The writes the counter of `imm` waits for are due within milliseconds (a request's
        last layer): until it fires or is removed, this engine's idle domain workers that
        nap (those with no completion fd to sleep on: shm) nap briefly, so they notice the
        writes sooner, for more wake-ups meanwhile. `at_once`: they follow without a pause (a
        bulk transfer, the next of back-to-back batches): the workers that sleep on a
        completion fd (tcp) poll their queues instead for up to 2 ms after their last
        activity, a core's time for the wake-up it saves. False when `imm` has no armed
        counter."""
        return self.imm_counters.soon(imm, Due.NOW if at_once else Due.SOON)

    def remove_imm_count(self, imm: int) -> tuple[int, int] | None:
        """Drop the counter of `imm` (e.g. a cancelled request): (counted, expected) or None."""
        return self.imm_counters.remove(imm)

    def pending_imm_counts(self) -> dict[int, tuple[int, int]]:
        """Armed counters not yet fired: imm -> (counted, expected). Empty when idle."""
        return self.imm_counters.pending()

    def imm_counted(self, imm: int) -> int:
        """Arrivals of `imm` counted here and not yet consumed by a fired expectation."""
        return self.imm_counters.counted(imm)

    @property
    def dropped_imms(self) -> int:
        """Arrivals of values nobody expected, thrown away: past `imm_counter`'s bound on such
        values or kept past its time (a flood, or late writes of a forgotten request)."""
        return self.imm_counters.dropped

    def tap_imms(self, tap: ImmTap) -> None:
        """Pass every batch of arriving immediates through `tap` before it is counted
        (fault injection, `faults.py`); taps run in the order they were added."""
        self.imm_counters.tap(tap)
