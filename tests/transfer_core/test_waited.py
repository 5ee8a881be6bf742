"""Waited writes (`write_and_wait`, `prepare_write(...).run()`): the caller posts and reaps in
its own thread (S5). Two real engines over tcp and shm on loopback, in this process."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from transfer_core.engine import TransferEngine
from transfer_core.errors import PeerError, TransferError, TransferTimeoutError
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor
from transfer_core.waited import REPEATED_WRITES, PreparedWrite


def shm_fds() -> int:
    """Descriptors of this process open on /dev/shm files (a kept shm peer holds one). Only
    those: other objects of the process (a test worker's) may close theirs meanwhile."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/")
        except OSError:
            continue  # closed since the listing (the listing's own fd, say)
    return count

PAGE = 4096
Engines = tuple[TransferEngine, TransferEngine]


@pytest.fixture(params=["tcp", "shm"])
def engines(request: pytest.FixtureRequest) -> Iterator[Engines]:
    with TransferEngine(request.param) as a, TransferEngine(request.param) as b:
        yield a, b


def _block(engine: TransferEngine) -> threading.Event:
    """Park the engine's progress thread in a callback until the returned event is set."""
    gate, parked = threading.Event(), threading.Event()

    def park() -> None:
        parked.set()
        gate.wait(30.0)

    engine._domains[0].call_soon(park)
    assert parked.wait(5.0)
    return gate


def _ran_once(
    a: TransferEngine, b: TransferEngine, timeout_s: float | None = None
) -> tuple[MemoryRegion, MemoryRegionDescriptor, PreparedWrite]:
    """A page of a's, a page of b's, and a prepared write between them that has run once."""
    src_mr, _ = a.register_memory(np.ones(PAGE, np.uint8))
    _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
    prepared = a.prepare_write(src_mr, 0, PAGE, 3, desc, 0, timeout_s=timeout_s)
    prepared.run()
    return src_mr, desc, prepared


def test_waited_writes_land_and_are_counted(engines: Engines) -> None:
    """write_and_wait and repeated prepared runs place the bytes; the receiver counts every
    immediate; the sender's stats count the bytes."""
    a, b = engines
    src = np.arange(PAGE, dtype=np.uint8)
    dst = np.zeros(4 * PAGE, np.uint8)
    src_mr, _ = a.register_memory(src)
    _, desc = b.register_memory(dst)
    reached = threading.Event()
    b.expect_imm_count(9, 5, reached.set)
    a.write_and_wait(src_mr, 0, PAGE, 9, desc, 0)
    prepared = a.prepare_write(src_mr, 0, PAGE, 9, desc, PAGE)
    for _ in range(4):
        prepared.run()
    assert reached.wait(10.0)
    assert np.array_equal(dst[:PAGE], src)
    assert np.array_equal(dst[PAGE : 2 * PAGE], src)
    assert a.stats()[0].bytes_written == 5 * PAGE


def test_waited_write_needs_no_progress_thread(engines: Engines) -> None:
    """With the sender's progress thread parked in a callback, a waited write still finishes:
    the caller reaps its own completion (a hand-off from that thread would never come)."""
    a, b = engines
    src_mr, _ = a.register_memory(np.ones(PAGE, np.uint8))
    _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
    a.write_and_wait(src_mr, 0, PAGE, 3, desc, 0)  # connected before the thread is parked
    gate = _block(a)
    try:
        a.write_and_wait(src_mr, 0, PAGE, 3, desc, 0, timeout_s=5.0)
    finally:
        gate.set()


def test_waited_write_past_its_deadline_raises_timeout() -> None:
    """A write the peer never takes (its progress thread parked, delivery-complete) raises
    TransferTimeoutError at its deadline."""
    with TransferEngine("tcp", delivery_complete=True) as a, TransferEngine("tcp") as b:
        src_mr, _ = a.register_memory(np.ones(PAGE, np.uint8))
        _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
        gate = _block(b)
        try:
            with pytest.raises(TransferTimeoutError):
                a.write_and_wait(src_mr, 0, PAGE, 3, desc, 0, timeout_s=0.2)
        finally:
            gate.set()


def test_close_while_waiting_raises_in_the_waiter() -> None:
    """close() from another thread ends a waiting write with a TransferError, once."""
    with TransferEngine("tcp", delivery_complete=True) as a, TransferEngine("tcp") as b:
        src_mr, _ = a.register_memory(np.ones(PAGE, np.uint8))
        _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
        gate = _block(b)
        raised: list[BaseException] = []

        def waiter() -> None:
            try:
                a.write_and_wait(src_mr, 0, PAGE, 3, desc, 0, timeout_s=30.0)
            except TransferError as exc:
                raised.append(exc)

        thread = threading.Thread(target=waiter)
        thread.start()
        try:
            threading.Event().wait(0.1)  # the waiter is inside its C loop by now
            a.close(drain_s=0.1)
            thread.join(10.0)
        finally:
            gate.set()
        assert not thread.is_alive()
        assert len(raised) == 1
        assert "closed" in str(raised[0])
        assert a._repeated._by_args == {}  # close() let go of the entry, fd and op


def test_gone_shm_peer_raises_peer_error() -> None:
    """A prepared write to a shm peer that closed raises PeerError instead of "completing",
    on the very next run: each run checks the peer (in C, on the fd held since prepare)."""
    with TransferEngine("shm") as a:
        b = TransferEngine("shm")
        src_mr, desc, prepared = _ran_once(a, b)
        b.close()
        with pytest.raises(PeerError, match="gone"):
            prepared.run()
        with pytest.raises(PeerError, match="gone"):
            a.write_and_wait(src_mr, 0, PAGE, 3, desc, 0)


def test_run_releases_the_gil() -> None:
    """While a run waits in C for a write the peer does not take, another Python thread runs."""
    with TransferEngine("tcp", delivery_complete=True) as a, TransferEngine("tcp") as b:
        _, _, prepared = _ran_once(a, b, timeout_s=0.3)
        ticks: list[int] = []
        stop = threading.Event()

        def ticker() -> None:
            while not stop.is_set():
                ticks.append(1)
                stop.wait(0.001)

        gate = _block(b)
        thread = threading.Thread(target=ticker)
        try:
            thread.start()
            threading.Event().wait(0.01)
            before = len(ticks)
            with pytest.raises(TransferTimeoutError):
                prepared.run()
            during = len(ticks) - before
        finally:
            stop.set()
            gate.set()
            thread.join()
        assert during > 50  # ~300 at 1 ms a tick; a held GIL would allow a handful


def test_run_after_a_timeout_uses_a_fresh_op_and_the_old_is_let_go() -> None:
    """A run that timed out with its write still out leaves that op tracked until it retires;
    the next run posts a new op and lands, and afterwards only the current op is tracked."""
    with TransferEngine("tcp", delivery_complete=True) as a, TransferEngine("tcp") as b:
        _, _, prepared = _ran_once(a, b, timeout_s=0.2)
        live = a._domains[0].c_worker.live_ops
        (first,) = live()
        gate = _block(b)
        try:
            with pytest.raises(TransferTimeoutError):
                prepared.run()
        finally:
            gate.set()
        prepared.run(timeout_s=5.0)
        for _ in range(200):  # the timed-out write retires through the progress thread
            if first not in live():
                break
            threading.Event().wait(0.01)
        assert first not in live()
        assert len(live()) == 1


def test_run_after_the_engine_closed_raises_closed() -> None:
    """A prepared write that outlives its engine raises TransferError, touching no freed
    memory or closed endpoint (the C worker lives as long as the prepared write)."""
    with TransferEngine("tcp") as b:
        a = TransferEngine("tcp")
        prepared = _ran_once(a, b)[2]
        a.close()
        for _ in range(2):  # each run raises; none reaches the closed endpoint
            with pytest.raises(TransferError, match="closed"):
                prepared.run()


def test_prepared_write_closes_its_peer_fd() -> None:
    """A prepared write to a shm peer holds one fd on the peer's file, closed by close()."""
    with TransferEngine("shm") as a, TransferEngine("shm") as b:
        src_mr, _ = a.register_memory(np.ones(PAGE, np.uint8))
        _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
        a.write_and_wait(src_mr, 0, PAGE, 3, desc, 0)
        fds = shm_fds()
        prepared = a.prepare_write(src_mr, 0, PAGE, 3, desc, 0)
        assert shm_fds() == fds + 1
        prepared.close()
        assert shm_fds() == fds


def test_repeated_write_and_wait_runs_one_prepared_write(engines: Engines) -> None:
    """write_and_wait with the same arguments again runs the op made the first time (one op
    tracked, the same one), and unregistering the source forgets it."""
    a, b = engines
    src_mr, _ = a.register_memory(np.ones(PAGE, np.uint8))
    _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
    live = a._domains[0].c_worker.live_ops
    a.write_and_wait(src_mr, 0, PAGE, 3, desc, 0)
    first = live()
    a.write_and_wait(src_mr, 0, PAGE, 3, desc, 0)
    assert live() == first
    assert len(first) == 1
    a.unregister_memory(src_mr)
    assert live() == []
    with pytest.raises(ValueError, match="not registered"):
        a.write_and_wait(src_mr, 0, PAGE, 3, desc, 0)


def test_concurrent_write_and_wait_with_the_same_arguments() -> None:
    """A second thread repeating a write_and_wait that is still waiting posts an op of its
    own (a running entry is out of the map: one op is never posted twice at once), and both
    writes land once."""
    with TransferEngine("tcp", delivery_complete=True) as a, TransferEngine("tcp") as b:
        src_mr, _ = a.register_memory(np.ones(PAGE, np.uint8))
        _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
        a.write_and_wait(src_mr, 0, PAGE, 5, desc, 0)
        reached = threading.Event()
        b.expect_imm_count(5, 3, reached.set)
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                a.write_and_wait(src_mr, 0, PAGE, 5, desc, 0)
            except BaseException as exc:
                errors.append(exc)

        gate = _block(b)  # both writes wait until the peer takes them
        threads = [threading.Thread(target=writer) for _ in range(2)]
        try:
            for t in threads:
                t.start()
                threading.Event().wait(0.05)
            in_flight = len(a._domains[0].c_worker.live_ops())
        finally:
            gate.set()
        for t in threads:
            t.join(10.0)
        assert in_flight == 2
        assert errors == []
        assert reached.wait(10.0)


def test_write_and_wait_keeps_a_bounded_number_of_prepared_writes() -> None:
    """Past REPEATED_WRITES distinct writes the least recently run one is let go of (its op
    and its shm peer's fd): memory and fds stay bounded."""
    with TransferEngine("shm") as a, TransferEngine("shm") as b:
        slots = REPEATED_WRITES + 8
        src_mr, _ = a.register_memory(np.ones(PAGE, np.uint8))
        _, desc = b.register_memory(np.zeros(slots * PAGE, np.uint8))
        a.write_and_wait(src_mr, 0, PAGE, 3, desc, 0)
        fds = shm_fds()
        for slot in range(1, slots):
            a.write_and_wait(src_mr, 0, PAGE, 3, desc, slot * PAGE)
        assert len(a._domains[0].c_worker.live_ops()) == REPEATED_WRITES
        assert shm_fds() == fds + REPEATED_WRITES - 1


def test_close_lets_go_of_kept_writes() -> None:
    """close() closes write_and_wait's kept prepared writes: no shm peer fd outlives it."""
    with TransferEngine("shm") as b:
        a = TransferEngine("shm")
        src_mr, _ = a.register_memory(np.ones(PAGE, np.uint8))
        _, desc = b.register_memory(np.zeros(2 * PAGE, np.uint8))
        fds = shm_fds()
        a.write_and_wait(src_mr, 0, PAGE, 3, desc, 0)
        a.write_and_wait(src_mr, 0, PAGE, 3, desc, PAGE)
        assert shm_fds() == fds + 2
        a.close()
        assert shm_fds() == fds
