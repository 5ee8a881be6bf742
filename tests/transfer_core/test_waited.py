"""Waited writes (`write_and_wait`, `prepare_write(...).run()`): the caller posts and reaps in
its own thread (S5). Two real engines over tcp and shm on loopback, in this process."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from transfer_core.engine import TransferEngine
from transfer_core.errors import PeerError, TransferError, TransferTimeoutError

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


def test_gone_shm_peer_raises_peer_error() -> None:
    """A prepared write to a shm peer that closed raises PeerError instead of "completing"."""
    with TransferEngine("shm") as a:
        src_mr, _ = a.register_memory(np.ones(PAGE, np.uint8))
        b = TransferEngine("shm")
        _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
        prepared = a.prepare_write(src_mr, 0, PAGE, 3, desc, 0)
        prepared.run()
        b.close()
        threading.Event().wait(0.002)  # past the prepared write's peer-check interval
        with pytest.raises(PeerError, match="gone"):
            prepared.run()
        with pytest.raises(PeerError, match="gone"):
            a.write_and_wait(src_mr, 0, PAGE, 3, desc, 0)
