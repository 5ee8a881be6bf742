"""`ImmCounting` (S4c): the counter methods both engines inherit behave the same on both.

One scenario runs on a pair of real engines (tcp on loopback) and a pair of loopback engines:
arrivals before the counter is armed count towards it, it fires exactly once at the expected
count and on an engine thread, `pending_imm_counts` / `imm_counted` show the tally on the way,
re-arming returns the replaced (counted, expected), `remove_imm_count` forgets, a closed
engine refuses to arm, and a tap sees each arrival before it counts. The records must be
equal, and equal to what S4c says.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from transfer_core.engine import TransferEngine
from transfer_core.errors import TransferError
from transfer_core.imm_counter import ImmBatch
from transfer_core.testing.loopback import LoopbackEngine, LoopbackFabric
from transfer_core.transport import PagedWrite

PAGE = 256
WAIT_S = 10.0


def _until(predicate: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class _Fired:
    """How often a counter fired, and whether on the test's own thread."""

    def __init__(self) -> None:
        self.calls, self.on_main, self.event = 0, False, threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        self.on_main = threading.current_thread() is threading.main_thread()
        self.event.set()


def scenario(a: Any, b: Any) -> dict[str, Any]:
    """Sender `a`, receiver `b`; returns what `b`'s counters showed along the way."""
    rec: dict[str, Any] = {}
    tapped: list[int] = []

    def tap(batch: ImmBatch) -> ImmBatch:
        tapped.extend(n for _, n in batch)
        return batch

    b.tap_imms(tap)
    src, _ = a.register_memory(np.ones(16 * PAGE, np.uint8))
    _, dst = b.register_memory(np.zeros(16 * PAGE, np.uint8))

    def send(pages: int, imm: int) -> None:
        ids = np.arange(pages)
        a.post_paged_writes(PagedWrite(src, ids, PAGE, 0, dst, ids, PAGE, 0, PAGE, imm))

    send(3, 21)  # lands before anyone expects it
    assert _until(lambda: b.imm_counted(21) == 3)
    fired = _Fired()
    rec["armed_early"] = (b.expect_imm_count(21, 5, fired), b.pending_imm_counts())
    send(1, 21)
    assert _until(lambda: b.imm_counted(21) == 4)
    rec["one_short"] = (fired.calls, b.pending_imm_counts())
    send(1, 21)
    assert fired.event.wait(WAIT_S)
    time.sleep(0.02)  # a second firing would show now
    rec["fired"] = (fired.calls, fired.on_main, b.pending_imm_counts(), b.imm_counted(21))

    send(2, 22)
    b.expect_imm_count(22, 9, _Fired())
    assert _until(lambda: b.imm_counted(22) == 2)
    rec["rearmed"] = b.expect_imm_count(22, 4, _Fired())  # replaces: its arrivals go too
    rec["removed"] = (b.remove_imm_count(22), b.remove_imm_count(22), b.pending_imm_counts())
    rec["tapped"] = sum(tapped)
    rec["dropped"] = b.dropped_imms
    b.close()
    try:
        b.expect_imm_count(23, 1, _Fired())
        rec["closed"] = "armed"
    except TransferError as error:
        rec["closed"] = str(error)
    return rec


EXPECTED = {
    "armed_early": (None, {21: (3, 5)}),
    "one_short": (0, {21: (4, 5)}),
    "fired": (1, False, {}, 0),
    "rearmed": (2, 9),
    "removed": ((0, 4), None, {}),
    "tapped": 7,
    "dropped": 0,
    "closed": "engine is closed",
}


def _run(make: Callable[[], Any]) -> dict[str, Any]:
    a, b = make(), make()
    try:
        return scenario(a, b)
    finally:
        a.close()
        b.close()


def _loopback() -> Callable[[], LoopbackEngine]:
    fabric = LoopbackFabric()
    return lambda: LoopbackEngine(fabric=fabric)


@pytest.mark.parametrize("kind", [pytest.param("tcp", marks=pytest.mark.fabric), "loopback"])
def test_counters_follow_s4c(kind: str) -> None:
    """Early arrivals count, one firing at the count on an engine thread, re-arm and remove
    return the tallies, a tap sees all 7 arrivals, a closed engine arms nothing."""
    make = (lambda: TransferEngine("tcp")) if kind == "tcp" else _loopback()
    assert _run(make) == EXPECTED


@pytest.mark.fabric
def test_both_engines_count_alike() -> None:
    """The whole record, side by side."""
    assert _run(lambda: TransferEngine("tcp")) == _run(_loopback())
