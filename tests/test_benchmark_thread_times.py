"""`benchmarks/thread_times.py`: per-thread CPU and wait for a CPU between two reads of the
scheduler's accounting, per unit of work, by the threads' OS names."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from thread_times import ThreadTime, per_unit, snapshot  # noqa: E402

from transfer_core.thread_name import name_current_thread  # noqa: E402


def test_a_busy_named_thread_is_charged_its_cpu_per_unit() -> None:
    """A thread that spins ~40 ms shows about that much CPU over 2 units (20 ms each), under
    its OS name; the main thread goes by `main`."""
    ready, go, spun, leave = (threading.Event() for _ in range(4))

    def spin() -> None:
        name_current_thread("spinner")
        ready.set()
        go.wait(5)
        end = time.thread_time() + 0.04
        while time.thread_time() < end:
            pass
        spun.set()
        leave.wait(5)  # alive until read: an ended thread leaves /proc

    thread = threading.Thread(target=spin)
    thread.start()
    assert ready.wait(5)
    me = [("node", os.getpid())]
    before = snapshot(me)
    go.set()
    assert spun.wait(5)
    rows = {r.thread: r for r in per_unit(before, snapshot(me), units=2)}
    leave.set()
    thread.join()
    assert "node/main" in snapshot(me)
    assert 15 <= rows["node/spinner"].cpu_ms <= 60  # 40 ms over 2, with the host's slack


def test_per_unit_divides_and_leaves_out_idle_threads() -> None:
    before = {"p/main": (1_000_000, 0), "p/idle": (5, 5)}
    after = {"p/main": (9_000_000, 4_000_000), "p/idle": (6, 6), "p/new": (2_000_000, 0)}
    assert per_unit(before, after, units=4) == [ThreadTime("p/main", 2.0, 1.0),
                                                ThreadTime("p/new", 0.5, 0.0)]


def test_a_process_that_is_gone_is_skipped() -> None:
    assert snapshot([("gone", 2**22 + 12345)]) == {}
