"""Two-process `TransferEngine` tests over real libfabric providers on loopback (S5, S4c).

The test process sends; a `spawn`ed receiver (`Peer`, driven over a Pipe, one request and
response per command) owns the destination region, sets imm expectations on command, counts
how often each counter fired and reports page digests. Parametrized over tcp (the CI path)
and shm.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing as mp
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from transfer_core.engine import TransferEngine
from transfer_core.errors import TransferError
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor
from transfer_core.transport import PagedWrite

# Real processes: a spawned receiver per provider, and more for the dead peer and the
# benchmark; about 5 s in all, so outside the inner loop.
pytestmark = [pytest.mark.fabric, pytest.mark.slow]

NUM_PAGES = 256
PAGE = 16 * 1024
Sender = tuple[TransferEngine, MemoryRegion, np.ndarray]


def digest(pages: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(pages).data, digest_size=16).hexdigest()


def _pages(
    region: MemoryRegion, src: Any, dst_mr: MemoryRegionDescriptor, dst: Any, imm: int
) -> PagedWrite:
    """Pages `src` of `region` to pages `dst` of `dst_mr`, PAGE bytes each, carrying `imm`."""
    return PagedWrite(region, src, PAGE, 0, dst_mr, dst, PAGE, 0, PAGE, imm)


def _serve(provider: str, conn: Any) -> None:
    engine = TransferEngine(provider)
    region = np.zeros((NUM_PAGES, PAGE), dtype=np.uint8)
    _, desc = engine.register_memory(region, name="peer-dst")
    fired: dict[int, int] = {}
    reached: dict[int, threading.Event] = {}
    lock = threading.Lock()

    def on_reached(imm: int) -> None:
        with lock:
            fired[imm] = fired.get(imm, 0) + 1
        reached[imm].set()

    conn.send(desc.to_bytes())
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            if cmd == "expect":
                imm, count = args
                reached[imm] = threading.Event()
                engine.expect_imm_count(imm, count, lambda imm=imm: on_reached(imm))
                conn.send(None)
            elif cmd == "wait":
                imm, timeout = args
                reached[imm].wait(timeout)
                with lock:
                    conn.send(fired.get(imm, 0))
            elif cmd == "counted":
                conn.send(engine.imm_counted(args[0]))
            elif cmd == "digest":
                conn.send(digest(region[np.asarray(args[0])]))
            elif cmd == "zero":
                region[:] = 0
                conn.send(None)
    finally:
        engine.close()
        conn.send("closed")


class Peer:
    """Handle of the receiver process: its region descriptor and a command channel."""

    def __init__(self, provider: str, timeout_s: float = 30.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._timeout = timeout_s
        self.process = ctx.Process(target=_serve, args=(provider, child), daemon=True)
        self.process.start()
        self.descriptor = MemoryRegionDescriptor.from_bytes(self._recv())

    def _recv(self) -> Any:
        if not self._conn.poll(self._timeout):
            raise TimeoutError("receiver process did not answer")
        return self._conn.recv()

    def call(self, *command: Any) -> Any:
        self._conn.send(command)
        return self._recv()

    def stop(self) -> None:
        """Close the receiver's engine cleanly and wait for the process to exit."""
        if self.process.is_alive():
            assert self.call("stop") == "closed"
            self.process.join(self._timeout)
        assert self.process.exitcode == 0


WAIT_S = 20.0
_imms = itertools.count(100)


class _Callbacks:
    """on_done / on_error of one request: counts every call, thread-safe."""

    def __init__(self) -> None:
        self.done = 0
        self.errors: list[TransferError] = []
        self.finished = threading.Event()
        self._lock = threading.Lock()

    def on_done(self) -> None:
        with self._lock:
            self.done += 1
        self.finished.set()

    def on_error(self, error: TransferError) -> None:
        with self._lock:
            self.errors.append(error)
        self.finished.set()

    @property
    def calls(self) -> int:
        return self.done + len(self.errors)


@pytest.fixture(scope="module", params=["tcp", "shm"])
def provider(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def peer(provider: str) -> Iterator[Peer]:
    p = Peer(provider)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def sender(provider: str) -> Iterator[Sender]:
    """The local engine and a region of seeded random pages."""
    data = np.random.default_rng(0).integers(0, 256, (NUM_PAGES, PAGE), dtype=np.uint8)
    with TransferEngine(provider) as engine:
        region, _ = engine.register_memory(data, name="src")
        yield engine, region, data


@pytest.fixture
def fresh(peer: Peer) -> Peer:
    peer.call("zero")
    return peer


def test_paged_writes_land_at_scattered_pages(sender: Sender, fresh: Peer) -> None:
    """64 seeded pages to shuffled slots arrive byte-exact; the counter fires exactly once."""
    engine, region, data = sender
    imm, cb = next(_imms), _Callbacks()
    src = np.arange(64)
    dst = np.random.default_rng(1).permutation(NUM_PAGES)[:64]
    fresh.call("expect", imm, 64)
    engine.post_paged_writes(
        _pages(region, src, fresh.descriptor, dst, imm), cb.on_done, cb.on_error
    )
    assert fresh.call("wait", imm, WAIT_S) == 1
    assert cb.finished.wait(WAIT_S)
    assert (cb.done, cb.errors) == (1, [])
    assert fresh.call("digest", dst) == digest(data[src])


def test_counter_fires_for_writes_landed_before_expectation(sender: Sender, fresh: Peer) -> None:
    """All 16 writes counted at the receiver before `expect`: it fires at once, once."""
    engine, region, _ = sender
    imm, cb = next(_imms), _Callbacks()
    engine.post_paged_writes(
        _pages(region, np.arange(16), fresh.descriptor, np.arange(16), imm),
        cb.on_done,
        cb.on_error,
    )
    assert cb.finished.wait(WAIT_S)
    assert cb.done == 1
    for _ in range(int(WAIT_S / 0.01)):
        if fresh.call("counted", imm) == 16:
            break
        threading.Event().wait(0.01)
    assert fresh.call("counted", imm) == 16
    fresh.call("expect", imm, 16)
    assert fresh.call("wait", imm, WAIT_S) == 1


def test_counter_waits_for_exact_count(sender: Sender, fresh: Peer) -> None:
    """15 of 16 writes do not fire the counter; the 16th does."""
    engine, region, _ = sender
    imm, first, last = next(_imms), _Callbacks(), _Callbacks()
    fresh.call("expect", imm, 16)
    engine.post_paged_writes(
        _pages(region, np.arange(15), fresh.descriptor, np.arange(15), imm),
        first.on_done,
        first.on_error,
    )
    assert first.finished.wait(WAIT_S)
    assert first.done == 1
    assert fresh.call("wait", imm, 0.3) == 0
    engine.post_write(
        region, 0, PAGE, imm, fresh.descriptor, 100 * PAGE, last.on_done, last.on_error
    )
    assert fresh.call("wait", imm, WAIT_S) == 1


def test_single_write_and_pure_immediate(sender: Sender, fresh: Peer) -> None:
    """A contiguous 3-page write and a zero-byte immediate both count; the data lands."""
    engine, region, data = sender
    imm, write, signal = next(_imms), _Callbacks(), _Callbacks()
    fresh.call("expect", imm, 2)
    engine.post_write(
        region, 5 * PAGE, 3 * PAGE, imm, fresh.descriptor, 40 * PAGE, write.on_done, write.on_error
    )
    engine.post_imm(imm, fresh.descriptor, signal.on_done, signal.on_error)
    assert fresh.call("wait", imm, WAIT_S) == 1
    assert write.finished.wait(WAIT_S)
    assert signal.finished.wait(WAIT_S)
    assert (write.done, signal.done) == (1, 1)
    assert fresh.call("digest", [40, 41, 42]) == digest(data[5:8])


def test_many_requests_in_flight(sender: Sender, fresh: Peer) -> None:
    """32 requests of 8 pages, all submitted before any completes: each fires exactly once."""
    engine, region, data = sender
    imms = [next(_imms) for _ in range(32)]
    for imm in imms:
        fresh.call("expect", imm, 8)
    callbacks = [_Callbacks() for _ in imms]
    for r, (imm, cb) in enumerate(zip(imms, callbacks, strict=True)):
        pages = np.arange(8 * r, 8 * r + 8)
        engine.post_paged_writes(
            _pages(region, pages, fresh.descriptor, pages[::-1], imm),
            cb.on_done,
            cb.on_error,
        )
    assert [fresh.call("wait", imm, WAIT_S) for imm in imms] == [1] * 32
    assert all(cb.finished.wait(WAIT_S) for cb in callbacks)
    assert [(cb.done, cb.errors) for cb in callbacks] == [(1, [])] * 32
    order = np.concatenate([np.arange(8 * r, 8 * r + 8)[::-1] for r in range(32)])
    assert fresh.call("digest", order) == digest(data[:256])


def test_dead_peer_reports_every_op_once(provider: str) -> None:
    """After the receiver exits, every kind of op reaches on_error exactly once, also
    counting what close() might still fire."""
    gone = Peer(provider)
    engine = TransferEngine(provider)
    region, _ = engine.register_memory(np.zeros(8 * PAGE, np.uint8))
    warm = _Callbacks()
    engine.post_write(region, 0, PAGE, None, gone.descriptor, 0, warm.on_done, warm.on_error)
    assert warm.finished.wait(WAIT_S)
    assert warm.done == 1  # connected, then the peer dies
    gone.stop()
    callbacks = [_Callbacks() for _ in range(3)]
    engine.post_paged_writes(
        _pages(region, np.arange(8), gone.descriptor, np.arange(8), 1),
        callbacks[0].on_done,
        callbacks[0].on_error,
        timeout_s=0.5,
    )
    engine.post_write(
        region,
        0,
        PAGE,
        2,
        gone.descriptor,
        0,
        callbacks[1].on_done,
        callbacks[1].on_error,
        timeout_s=0.5,
    )
    engine.post_imm(
        3, gone.descriptor, callbacks[2].on_done, callbacks[2].on_error, timeout_s=0.5
    )
    assert all(cb.finished.wait(WAIT_S) for cb in callbacks)
    engine.close()
    assert [(cb.done, len(cb.errors)) for cb in callbacks] == [(0, 1)] * 3
    assert all(isinstance(cb.errors[0], TransferError) for cb in callbacks)


@pytest.mark.parametrize("verify_each_rep", [False, True], ids=["back-to-back", "each-rep"])
def test_benchmark_runs_and_verifies(provider: str, verify_each_rep: bool) -> None:
    """run_transfer_benchmark (what `disagg bench transfer` calls) on a tiny workload, its
    reps back to back (every counter armed at once) or each verified: the checksum verifies,
    every timed rep is reported, and the reported keys are there."""
    from transfer_core.bench import run_transfer_benchmark

    result = run_transfer_benchmark(
        provider,
        num_pages=16,
        page_bytes=4096,
        reps=2,
        latency_iters=5,
        wait_idle=False,
        verify_each_rep=verify_each_rep,
    )
    assert result["verified"] is True
    assert len(result["gbps_reps"]) == 2
    assert result["verify_each_rep"] is verify_each_rep
    assert result["gbps"] > 0
    assert result["gbps_initiator"] > 0  # the sender's own completions, the peers' clock
    assert result["latency_us_p99"] >= result["latency_us_p50"] > 0
    assert result["provider"].startswith(provider)
