"""`CounterPoller.report_from` (S3b, X9a): moves below the held value are not reported, the move
that reaches it is reported whole, the chain stays unbroken, and lowering the hold releases a
counter at once; polled and doorbell pollers alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from transfer_core import poller as poller_module
from transfer_core.doorbell import Doorbell
from transfer_core.poller import CounterPoller

Bump = Callable[[], None]
QUIET_S = 0.05  # long enough for a poller that ignores the hold to report a move


@pytest.fixture(params=["polled", "doorbell"])
def watched(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
            ) -> Iterator[tuple[CounterPoller, Bump, list[tuple[int, int]]]]:
    """A started poller over one counter, a bump (ringing when it has a bell), its reports."""
    monkeypatch.setattr(poller_module, "_WAIT_SLICE_S", 60.0)  # only moves and rings wake it
    counter, seen = torch.zeros(1, dtype=torch.int64), []
    bell = Doorbell() if request.param == "doorbell" else None

    def bump() -> None:
        counter.add_(1)
        if bell is not None:
            bell.ring()

    poller = CounterPoller([counter], lambda i, old, new: seen.append((old, new)),
                           doorbell=bell)
    poller.start()
    try:
        yield poller, bump, seen
    finally:
        poller.stop()


def test_moves_below_the_hold_arrive_as_one_jump(
        watched: tuple[CounterPoller, Bump, list[tuple[int, int]]]) -> None:
    poller, bump, seen = watched
    poller.report_from(0, 4)
    for _ in range(3):
        bump()
    time.sleep(QUIET_S)
    assert seen == []  # held: the thread stayed in its C wait
    bump()
    poller.wait_for(0, 4)
    assert seen == [(0, 4)]
    bump()  # past the hold, each move is reported again
    poller.wait_for(0, 5)
    assert seen == [(0, 4), (4, 5)]


def test_lowering_the_hold_releases_a_held_counter(
        watched: tuple[CounterPoller, Bump, list[tuple[int, int]]]) -> None:
    poller, bump, seen = watched
    poller.report_from(0, 100)
    bump()
    bump()
    time.sleep(QUIET_S)
    assert seen == []
    poller.report_from(0, 0)  # from another thread than the poller's, as a planner does
    poller.wait_for(0, 2)
    assert seen == [(0, 2)]


def test_a_hold_set_from_the_callback_applies_to_the_next_wait() -> None:
    """The streamer's use: the report at a group's end holds until the next group's end."""
    counter, seen = torch.zeros(1, dtype=torch.int64), []

    def on_change(index: int, old: int, new: int) -> None:
        seen.append((old, new))
        poller.report_from(0, new + 3)

    poller = CounterPoller([counter], on_change)
    poller.report_from(0, 3)
    with poller:
        for _ in range(9):
            counter.add_(1)
            time.sleep(0.002)  # a writer slower than the poller, as a forward's layers are
        poller.wait_for(0, 9)
    assert seen == [(0, 3), (3, 6), (6, 9)]


def test_report_from_names_a_counter_it_does_not_watch() -> None:
    poller = CounterPoller([torch.zeros(1, dtype=torch.int64)], lambda *_: None)
    with pytest.raises(IndexError, match="no counter 1"):
        poller.report_from(1, 5)
