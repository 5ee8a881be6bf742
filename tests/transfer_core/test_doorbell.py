"""A `CounterPoller` with a `Doorbell` (S3b): it reports what a ringing writer bumped, loses
no ring, stops at once, and while nothing rings its thread sleeps instead of waking on a
timer (counted by the kernel's context switches of that thread)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from transfer_core import poller as poller_module
from transfer_core.counter_word import bump_release
from transfer_core.doorbell import Doorbell
from transfer_core.poller import CounterPoller, PollerConfig


def switches(thread: threading.Thread) -> int:
    """The voluntary context switches of `thread` so far (each sleep and wake is one)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


@pytest.fixture
def long_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wait slices of a minute: only a ring can wake the poller within a test's timeouts."""
    monkeypatch.setattr(poller_module, "_WAIT_SLICE_S", 60.0)


@pytest.mark.usefixtures("long_slices")
def test_a_rung_bump_is_reported() -> None:
    counter, bell, seen = torch.zeros(1, dtype=torch.int64), Doorbell(), []
    with CounterPoller([counter], lambda i, old, new: seen.append((old, new)),
                       doorbell=bell) as poller:
        counter.add_(1)
        bell.ring()
        poller.wait_for(0, 1, timeout=5.0)
    assert seen == [(0, 1)]


@pytest.mark.usefixtures("long_slices")
def test_no_ring_is_lost_among_many_bumps() -> None:
    """A writer thread bumps and rings 2,000 times as fast as it can: every step is reported,
    each once, in order."""
    counter, bell, steps = torch.zeros(1, dtype=torch.int64), Doorbell(), []
    with CounterPoller([counter], lambda i, old, new: steps.extend(range(old + 1, new + 1)),
                       doorbell=bell) as poller:
        for _ in range(2000):
            bump_release(counter)
            bell.ring()
        poller.wait_for(0, 2000, timeout=10.0)
    assert steps == list(range(1, 2001))


def test_an_idle_poller_sleeps_until_rung() -> None:
    """Half a second without a bump: a few wake-ups at most (its wait slices), where a poller
    napping 200 us wakes about 2,500 times."""
    counter = torch.zeros(1, dtype=torch.int64)
    with CounterPoller([counter], lambda *_: None, doorbell=Doorbell()) as poller:
        before = switches(poller._thread)
        time.sleep(0.5)
        assert switches(poller._thread) - before < 10
    napping = PollerConfig(spin_us=0.0, sleep_min_us=200.0, sleep_max_us=200.0)
    with CounterPoller([counter], lambda *_: None, napping) as poller:
        before = switches(poller._thread)
        time.sleep(0.5)
        assert switches(poller._thread) - before > 20  # the contrast (about 2,500 when idle)


@pytest.mark.usefixtures("long_slices")
def test_stop_wakes_a_sleeping_poller() -> None:
    """Asleep in a minute-long slice, the poller still stops within stop()'s 5 s join."""
    poller = CounterPoller([torch.zeros(1, dtype=torch.int64)], lambda *_: None,
                           doorbell=Doorbell())
    poller.start()
    time.sleep(0.05)  # asleep on the bell by now
    poller.stop(timeout=5.0)
    assert not poller.running
