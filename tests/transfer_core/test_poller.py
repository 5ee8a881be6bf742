"""Tests of `transfer_core.poller`: every step of a counter is reported, in order (S3b)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from transfer_core.counter_word import bump_release, counter_address, load_acquire
from transfer_core.errors import TransferTimeoutError
from transfer_core.poller import CounterPoller, PollerConfig


class _Recorder:
    """Collects (index, old, new) reports; optionally signals each one."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, int, int]] = []
        self.event = threading.Event()

    def __call__(self, index: int, old: int, new: int) -> None:
        self.reports.append((index, old, new))
        self.event.set()


def _assert_chain(reports: list[tuple[int, int]], start: int, end: int) -> None:
    """The (old, new] ranges tile (start, end] exactly, in order."""
    assert reports, "no report at all"
    assert reports[0][0] == start
    assert reports[-1][1] == end
    for (_, prev_new), (old, _) in zip(reports, reports[1:], strict=False):
        assert old == prev_new
    assert all(new > old for old, new in reports)


@pytest.fixture
def counter() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64)


def test_lockstep_bumps_are_reported_one_by_one(counter: torch.Tensor) -> None:
    """A writer that waits for each report sees exactly (k-1, k) for every k."""
    recorder = _Recorder()
    with CounterPoller([counter], recorder) as poller:
        for _ in range(50):
            recorder.event.clear()
            counter.add_(1)
            assert recorder.event.wait(5.0)
        poller.wait_for(0, 50)
    assert recorder.reports == [(0, k - 1, k) for k in range(1, 51)]


def test_fast_writer_thread_reports_every_step_in_order(counter: torch.Tensor) -> None:
    """Bumps from another thread that outrun the poller still tile 1..N without gaps."""
    recorder = _Recorder()
    num_bumps = 20_000

    def write() -> None:
        for _ in range(num_bumps):
            counter.add_(1)

    with CounterPoller([counter], recorder) as poller:
        writer = threading.Thread(target=write)
        writer.start()
        writer.join()
        poller.wait_for(0, num_bumps)
    _assert_chain([(old, new) for _, old, new in recorder.reports], 0, num_bumps)


def test_first_report_starts_from_value_at_start(counter: torch.Tensor) -> None:
    """The baseline is the value read at start(), not zero."""
    counter.fill_(7)
    recorder = _Recorder()
    with CounterPoller([counter], recorder) as poller:
        counter.add_(1)
        poller.wait_for(0, 8)
    assert recorder.reports == [(0, 7, 8)]


def test_several_numpy_counters_each_chain() -> None:
    """Counters in one numpy array, bumped by separate threads, are reported per index."""
    words = np.zeros(3, dtype=np.int64)
    totals = [300, 1, 1000]
    recorder = _Recorder()

    def write(index: int) -> None:
        for _ in range(totals[index]):
            bump_release(words[index : index + 1])

    with CounterPoller([words[i : i + 1] for i in range(3)], recorder) as poller:
        writers = [threading.Thread(target=write, args=(i,)) for i in range(3)]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join()
        for i, total in enumerate(totals):
            poller.wait_for(i, total)
    for i, total in enumerate(totals):
        _assert_chain([(old, new) for j, old, new in recorder.reports if j == i], 0, total)


def test_callback_exception_is_reraised_by_check(counter: torch.Tensor) -> None:
    """An exception in on_change stops the thread and surfaces on check(), once."""

    def explode(index: int, old: int, new: int) -> None:
        raise KeyError(f"bad layer {new}")

    poller = CounterPoller([counter], explode)
    poller.start()
    counter.add_(1)
    with pytest.raises(KeyError, match="bad layer 1"):
        poller.wait_for(0, 1)
    assert not poller.running
    poller.check()
    poller.stop()


def test_callback_exception_is_reraised_by_stop(counter: torch.Tensor) -> None:
    """stop() re-raises a stored callback exception that nobody checked."""
    failed = threading.Event()

    def explode(index: int, old: int, new: int) -> None:
        failed.set()
        raise RuntimeError("messenger broke")

    poller = CounterPoller([counter], explode)
    poller.start()
    counter.add_(1)
    assert failed.wait(5.0)
    with pytest.raises(RuntimeError, match="messenger broke"):
        poller.stop()


def test_stop_is_clean_quick_and_idempotent(counter: torch.Tensor) -> None:
    """An idle poller (deep in its sleep phase) joins within a second; stop twice is fine."""
    poller = CounterPoller([counter], _Recorder(), PollerConfig(spin_us=0, sleep_max_us=1000))
    poller.start()
    assert poller.running
    poller.stop(timeout=1.0)
    assert not poller.running
    poller.stop(timeout=1.0)


def test_cannot_restart_after_stop(counter: torch.Tensor) -> None:
    """A stopped poller stays stopped; make a new one instead."""
    poller = CounterPoller([counter], _Recorder())
    poller.start()
    poller.stop()
    with pytest.raises(RuntimeError, match="cannot restart"):
        poller.start()


def test_wait_for_times_out(counter: torch.Tensor) -> None:
    """Waiting for a value that never comes raises TransferTimeoutError."""
    with CounterPoller([counter], _Recorder()) as poller, pytest.raises(TransferTimeoutError):
        poller.wait_for(0, 1, timeout=0.05)


def test_cpu_affinity_pins_only_the_poller_thread(counter: torch.Tensor) -> None:
    """The poller thread runs on the configured CPU; the caller's affinity is untouched."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    seen: list[set[int]] = []
    config = PollerConfig(cpu_affinity=(cpu,))
    with CounterPoller([counter], lambda *_: seen.append(os.sched_getaffinity(0)), config) as p:
        counter.add_(1)
        p.wait_for(0, 1)
    assert seen == [{cpu}]
    assert os.sched_getaffinity(0) == before


def test_cpus_argument_pins_the_poller_thread(counter: torch.Tensor) -> None:
    """`cpus=` pins the thread before start() returns (S5b: the leader's NUMA node)."""
    cpu = max(os.sched_getaffinity(0))
    with CounterPoller([counter], _Recorder(), cpus=[cpu]) as poller:
        thread = poller._thread
        assert thread is not None
        assert thread.native_id is not None
        assert os.sched_getaffinity(thread.native_id) == {cpu}


def test_cpus_and_cpu_affinity_together_are_refused(counter: torch.Tensor) -> None:
    """Two ways of saying where the thread runs, both given, is a ValueError."""
    config = PollerConfig(cpu_affinity=(0,))
    with pytest.raises(ValueError, match="not both"):
        CounterPoller([counter], _Recorder(), config, cpus=[0])
    with pytest.raises(ValueError, match=r"CPUs \[4096\] are not among"):
        CounterPoller([counter], _Recorder(), cpus=[4096])


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(1, dtype=torch.float64),
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64, device="meta"),
        np.zeros(1, dtype=np.int32),
        "0x1000",
    ],
)
def test_rejects_values_that_are_not_one_int64_word(bad: object) -> None:
    """Wrong dtype, size, device or type is refused before any thread starts."""
    with pytest.raises((ValueError, TypeError)):
        counter_address(bad)


def test_rejects_misaligned_address(counter: torch.Tensor) -> None:
    """A word that is not 8-byte aligned could tear, so it is refused."""
    with pytest.raises(ValueError, match="aligned"):
        counter_address(counter.data_ptr() + 4)


def test_release_bump_and_acquire_load_round_trip(counter: torch.Tensor) -> None:
    """bump_release returns the new value and load_acquire reads it back."""
    assert bump_release(counter, 5) == 5
    assert load_acquire(counter) == 5
    assert int(counter.item()) == 5


def test_config_rejects_inverted_sleep_bounds() -> None:
    """sleep_min_us above sleep_max_us is a configuration error."""
    with pytest.raises(ValueError, match="sleep_min_us"):
        PollerConfig(sleep_min_us=10, sleep_max_us=1)
