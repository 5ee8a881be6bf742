"""One peer that takes no writes never holds up an engine's writes to the others, and
`abandon_peer` ends what is queued for a peer at once (X4, S5), over tcp;ofi_rxm on loopback.

Measured on libfabric 1.17 (the reproduction this started from: a prefiller SIGSTOPped 11 s
while a decoder it was writing to was SIGKILLed): tcp;ofi_rxm answers -FI_EAGAIN to every
write to a peer whose process is gone, as it keeps reconnecting to a closed port, until the
op's deadline (no error ever comes); and a frozen peer keeps the writes it was sent in flight
until it thaws. The C worker used to stop posting at the first -FI_EAGAIN and to share one
in-flight cap among all peers, so either case stopped every write of the engine, to every
peer: the thawed prefiller could not write a handshake proof to any live decoder, and the
decoders never took it back. A dead peer stands in here as a closed engine of this process
(its port refuses connections, as a killed process's does), a frozen one as a SIGSTOPped
child process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from transfer_core.engine import TransferEngine
from transfer_core.errors import PeerError, TransferError, TransferTimeoutError
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor
from transfer_core.transport import PagedWrite

pytestmark = pytest.mark.fabric

PAGE = 16 * 1024
PAGES = 16
BIG_PAGE = 256 * 1024  # a frozen peer's socket buffers fill after a few MiB of these
# A write to a live peer takes milliseconds; the stuck peer's writes wait this long, so a
# write that waited behind them cannot pass for a prompt one.
STUCK_S = 3.0
PROMPT_S = 1.5


class Outcome:
    """What became of one posted write: its error (None: done) and when, once it ended."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.error: TransferError | None = None
        self.after_s = 0.0
        self._start = time.monotonic()

    def done(self) -> None:
        self._end(None)

    def failed(self, error: TransferError) -> None:
        self._end(error)

    def _end(self, error: TransferError | None) -> None:
        self.error, self.after_s = error, time.monotonic() - self._start
        self.ended.set()

    def wait(self, timeout_s: float) -> bool:
        return self.ended.wait(timeout_s)


def post(engine: TransferEngine, src: MemoryRegion, dst: MemoryRegionDescriptor,
         timeout_s: float, page: int = PAGE) -> Outcome:
    """All of `src`'s pages to `dst`'s first pages, one immediate each; what became of it."""
    outcome = Outcome()
    ids = np.arange(src.length // page)
    engine.post_paged_writes(PagedWrite(src, ids, page, 0, dst, ids, page, 0, page, 7),
                             outcome.done, outcome.failed, timeout_s=timeout_s)
    return outcome


def region(engine: TransferEngine, page: int = PAGE) -> tuple[MemoryRegion, MemoryRegionDescriptor]:
    return engine.register_memory(np.zeros((PAGES, page), np.uint8))


@pytest.fixture
def engines() -> Iterator[Callable[..., TransferEngine]]:
    """Engines made by the test, closed after it (a closed one again is a no-op)."""
    made: list[TransferEngine] = []

    def make(**kwargs: Any) -> TransferEngine:
        made.append(TransferEngine("tcp", **kwargs))
        return made[-1]

    yield make
    for engine in reversed(made):
        engine.close(drain_s=0.5)


def dead_peer(writer: TransferEngine, src: MemoryRegion,
              make: Callable[..., TransferEngine]) -> tuple[TransferEngine, MemoryRegionDescriptor]:
    """An engine the writer has written to (connection up), then closed, and probed until
    rxm has let the broken connection go (writes on it fail at once with ENOTCONN until its
    progress handles the shutdown event, which an idle moment lets it do): from then on it
    reconnects to a closed port and answers -FI_EAGAIN, so the last probe timed out."""
    gone = make()
    _, dst = region(gone)
    first = post(writer, src, dst, 10.0)
    assert first.wait(10.0) and first.error is None
    gone.close(drain_s=0.5)
    for _ in range(10):
        time.sleep(0.3)
        probe = post(writer, src, dst, 0.5)
        assert probe.wait(10.0)
        if isinstance(probe.error, TransferTimeoutError):
            return gone, dst
        assert isinstance(probe.error, PeerError), probe.error  # the old connection's end
    raise AssertionError("writes to the closed engine never started to wait")


def test_a_dead_peer_does_not_hold_up_writes_to_a_live_one(
        engines: Callable[..., TransferEngine]) -> None:
    """A write to a dead peer sits on -FI_EAGAIN until its deadline; one to a live peer
    posted after it completes at once (it used to wait for that deadline), and the dead
    peer's write still fails at its deadline, not before."""
    writer, live = engines(), engines()
    src, _ = writer.register_memory(np.ones((PAGES, PAGE), np.uint8), remote_write=False)
    _, live_dst = region(live)
    writer.connect(live.address)
    _, gone_dst = dead_peer(writer, src, engines)
    stuck = post(writer, src, gone_dst, STUCK_S)
    prompt = post(writer, src, live_dst, 30.0)
    assert prompt.wait(PROMPT_S), "the live peer's write waited behind the dead peer's"
    assert prompt.error is None
    assert stuck.wait(STUCK_S + 10.0)
    assert isinstance(stuck.error, TransferTimeoutError), stuck.error
    assert stuck.after_s >= STUCK_S - 0.1


def test_abandon_peer_fails_what_is_queued_for_it_now_and_only_that(
        engines: Callable[..., TransferEngine]) -> None:
    """Two writes queued for a dead peer with a 30 s deadline: `abandon_peer` fails both
    with `PeerError` at once and nothing of them stays in the worker; a write to that peer
    posted afterwards is posted as usual (and times out), one to a live peer completes."""
    writer, live = engines(), engines()
    src, _ = writer.register_memory(np.ones((PAGES, PAGE), np.uint8), remote_write=False)
    _, live_dst = region(live)
    gone, gone_dst = dead_peer(writer, src, engines)
    queued = [post(writer, src, gone_dst, 30.0) for _ in range(2)]
    time.sleep(0.2)  # posted, answered -FI_EAGAIN: they would wait 30 s
    assert not any(outcome.ended.is_set() for outcome in queued)
    writer.abandon_peer(gone.address)
    for outcome in queued:
        assert outcome.wait(PROMPT_S), "abandon_peer left a write waiting for its deadline"
        assert isinstance(outcome.error, PeerError), outcome.error
        assert "given up" in str(outcome.error)
    later = post(writer, src, gone_dst, 1.0)
    assert post(writer, src, live_dst, 30.0).wait(PROMPT_S)
    assert later.wait(10.0) and isinstance(later.error, TransferTimeoutError), later.error
    worker = writer._domains[0]
    assert worker.pending() == 0 and worker.c_worker.live_ops() == []
    writer.abandon_peer(live.address)  # nothing queued there: nothing happens
    assert post(writer, src, live_dst, 30.0).wait(PROMPT_S)


def _frozen_target(conn: Any) -> None:
    """Child: a target region of PAGES big pages; sends its descriptor, waits for "stop"."""
    engine = TransferEngine("tcp")
    _, dst = engine.register_memory(np.zeros((PAGES, BIG_PAGE), np.uint8))
    conn.send((os.getpid(), dst.to_bytes()))
    conn.recv()
    engine.close(drain_s=0.5)


def test_a_frozen_peer_leaves_slots_to_the_others(
        engines: Callable[..., TransferEngine]) -> None:
    """A SIGSTOPped peer holds its writes in flight: at most its own cap of them (8 here);
    a live peer's write completes meanwhile (it used to find every slot taken until the
    thaw), and the frozen peer's writes all complete once it is SIGCONTed."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_frozen_target, args=(child,), daemon=True)
    process.start()
    pid = 0
    try:
        assert parent.poll(30.0), "the target process did not start"
        pid, wire = parent.recv()
        frozen_dst = MemoryRegionDescriptor.from_bytes(wire)
        writer, live = engines(max_inflight=8), engines()
        big, _ = writer.register_memory(np.ones((PAGES, BIG_PAGE), np.uint8), remote_write=False)
        small, _ = writer.register_memory(np.ones((PAGES, PAGE), np.uint8), remote_write=False)
        _, live_dst = region(live)
        writer.connect(live.address)
        first = post(writer, big, frozen_dst, 30.0, BIG_PAGE)
        assert first.wait(10.0) and first.error is None
        os.kill(pid, signal.SIGSTOP)
        backlog = [post(writer, big, frozen_dst, 60.0, BIG_PAGE) for _ in range(8)]  # 32 MiB
        deadline, last = time.monotonic() + 10.0, None
        while time.monotonic() < deadline:  # until its writes stop completing: stuck
            stats = writer.stats()[0]
            if stats.inflight == 8 and stats.writes_completed == last:
                break
            last = stats.writes_completed
            time.sleep(0.3)
        assert writer.stats()[0].inflight == 8, writer.stats()
        prompt = post(writer, small, live_dst, 30.0)
        assert prompt.wait(PROMPT_S), "the live peer's write found no slot"
        assert prompt.error is None
        assert not backlog[-1].ended.is_set()  # (the first may have fit in socket buffers)
        os.kill(pid, signal.SIGCONT)
        for outcome in backlog:
            assert outcome.wait(30.0) and outcome.error is None, outcome.error
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        parent.send("stop")
        process.join(10.0)
        if process.is_alive():
            process.kill()
