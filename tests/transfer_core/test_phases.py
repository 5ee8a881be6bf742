"""The phase log of a timed engine (S5, S4c): two engines in this process over tcp and shm,
real libfabric. The C loop's stamps of each op and each batch of immediates come back in
order, counted right, and the progress thread's hand-back is stamped after them."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from transfer_core.engine import TransferEngine
from transfer_core.phases import PhaseLog
from transfer_core.transport import PagedWrite

PAGE = 4096
PAGES = 32


@pytest.fixture(params=["tcp", "shm"])
def timed(request: pytest.FixtureRequest) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    a = TransferEngine(request.param, phases=PhaseLog())
    b = TransferEngine(request.param, phases=PhaseLog())
    yield a, b
    a.close()
    b.close()


def write_batch(a: TransferEngine, b: TransferEngine, imm: int) -> None:
    """PAGES pages from `a` to `b` with immediate `imm`; returns once both sides are done."""
    src = np.arange(PAGES * PAGE, dtype=np.uint8).reshape(PAGES, PAGE)
    dst = np.zeros_like(src)
    src_mr, _ = a.register_memory(src, remote_write=False)
    _, dst_desc = b.register_memory(dst)
    reached, done = threading.Event(), threading.Event()
    b.expect_imm_count(imm, PAGES, reached.set)
    ids = np.arange(PAGES)
    a.post_paged_writes(PagedWrite(src_mr, ids, PAGE, 0, dst_desc, ids, PAGE, 0, PAGE, imm),
                        done.set)
    assert reached.wait(10) and done.wait(10)
    assert np.array_equal(dst, src)


def test_an_op_s_stamps_run_in_order(timed: tuple[TransferEngine, TransferEngine]) -> None:
    """Submitted, first and last write posted, reported, handed back, called back: each
    stamp set and none before the one it follows."""
    a, b = timed
    write_batch(a, b, 5)
    (op,) = a_log(a).wait_ops(1)
    t = op.times
    assert op.err == 0
    assert 0 < t.submit_ns <= t.first_post_ns <= t.last_post_ns <= t.done_ns
    assert t.done_ns <= op.returned_ns <= op.callback_ns <= op.callback_end_ns


def test_the_receiver_s_batches_count_every_arrival(
        timed: tuple[TransferEngine, TransferEngine]) -> None:
    """The receiver's records of one immediate add up to the pages written, each batch
    reaped before it was handed back and counted."""
    a, b = timed
    write_batch(a, b, 9)
    records = a_log(b).wait_arrivals(9, PAGES)
    assert sum(r.arrival.count for r in records) == PAGES
    for r in records:
        assert 0 < r.arrival.first_ns <= r.arrival.last_ns <= r.returned_ns <= r.counted_ns
    assert min(r.arrival.first_ns for r in records) >= a_log(a).wait_ops(1)[0].times.first_post_ns


def a_log(engine: TransferEngine) -> PhaseLog:
    assert engine.phases is not None
    return engine.phases
