"""Tests of the `pyfabric` binding in one process: discovery, errors, MRs, the C data path (S5)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from transfer_core import pyfabric as pf
from transfer_core.errors import FabricError, ProviderNotFoundError
from transfer_core.pyfabric import lib

ACCESS = lib.FI_WRITE | lib.FI_REMOTE_WRITE
PAGE = 4096
Pair = tuple[pf.FabricStack, pf.FabricStack]


@pytest.fixture(params=["tcp", "shm"])
def provider(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def pair(provider: str) -> Iterator[tuple[pf.FabricStack, pf.FabricStack]]:
    """Two endpoints of one provider in this process."""
    info = pf.find_infos(provider)[0]
    a, b = pf.FabricStack(info), pf.FabricStack(info)
    yield a, b
    a.close()
    b.close()


def test_alias_resolves_to_preference_list() -> None:
    """ "tcp" means the tcp class in every libfabric version's spelling."""
    assert pf.resolve_providers("tcp") == ("tcp;ofi_rxm", "tcp", "net")
    assert pf.resolve_providers(["shm"]) == ("shm",)


@pytest.mark.parametrize(
    ("provider", "node", "expected"),
    [
        ("tcp;ofi_rxm", "auto", "127.0.0.1"),
        ("net", "auto", "127.0.0.1"),
        ("efa", "auto", None),
        ("verbs;ofi_rxm", "auto", None),
        ("tcp", "10.0.0.7", "10.0.0.7"),
        ("shm", "127.0.0.1", None),
    ],
)
def test_source_node_per_provider(provider: str, node: str, expected: str | None) -> None:
    """Socket providers default to loopback, NIC providers to all devices, shm to none."""
    assert pf.info.source_node(provider, node) == expected


def test_find_infos_tcp_pins_loopback() -> None:
    """The default node keeps tcp on lo and reports what the data path needs."""
    info = pf.find_infos("tcp")[0]
    assert info.domain_name == "lo"
    assert info.cq_data_size >= 4
    assert info.tx_size > 0


def test_unknown_provider_raises() -> None:
    """A preference list with nothing available names what was tried."""
    with pytest.raises(ProviderNotFoundError, match="no-such-provider"):
        pf.find_infos(["no-such-provider"])


def test_fabric_error_carries_strerror() -> None:
    """check() turns a negative return into FabricError(call, errno, fi_strerror)."""
    with pytest.raises(FabricError, match="fi_demo failed: .*fi errno 11") as info:
        pf.check("fi_demo", -lib.FI_EAGAIN)
    assert info.value.errno == lib.FI_EAGAIN
    assert info.value.text


def test_duplicate_requested_key_is_rejected(pair: Pair) -> None:
    """Requested keys must be unique per domain: libfabric says FI_ENOKEY (G8)."""
    a, _ = pair
    if a.info.mr_mode & lib.FI_MR_PROV_KEY:
        pytest.skip("provider chooses keys")
    buf = np.zeros(PAGE, np.uint8)
    mr = pf.MemoryRegistration(a.domain, buf.ctypes.data, buf.nbytes, ACCESS, 42, a.endpoint)
    try:
        with pytest.raises(FabricError, match="fi_mr_reg") as info:
            pf.MemoryRegistration(a.domain, buf.ctypes.data, buf.nbytes, ACCESS, 42, a.endpoint)
        assert info.value.errno == lib.FI_ENOKEY
    finally:
        mr.close()


def test_dead_shm_address_is_refused() -> None:
    """Inserting a closed shm peer would crash libfabric 1.17; it raises instead."""
    info = pf.find_infos("shm")[0]
    a, b = pf.FabricStack(info), pf.FabricStack(info)
    gone = b.endpoint.name
    b.close()
    try:
        with pytest.raises(FabricError, match="is gone"):
            a.av.insert(gone)
    finally:
        a.close()


def _release(*objects: pf.MemoryRegistration | pf.FabricStack | pf.Worker) -> None:
    """Close registrations and stacks in order, then free the workers (a C worker may go
    only once its endpoint is closed)."""
    for obj in objects:
        if not isinstance(obj, pf.Worker):
            obj.close()
    for obj in objects:
        if isinstance(obj, pf.Worker):
            obj.free()


def _drive(workers: list[pf.Worker], until: float = 5.0) -> tuple[list[pf.Event], dict[int, int]]:
    """Poll every worker (one thread, so the target progresses too, G17) until an event."""
    events: list[pf.Event] = []
    imms: dict[int, int] = {}
    deadline = time.monotonic() + until
    while not events and time.monotonic() < deadline:
        for w in workers:
            ev, got, rc = w.progress(200_000)
            assert rc == 0
            events += ev
            for imm, n in got:
                imms[imm] = imms.get(imm, 0) + n
    return events, imms


@dataclass
class _OnePage:
    """Two endpoints of one provider, a C worker each, one registered page on each side."""

    a: pf.FabricStack
    b: pf.FabricStack
    wa: pf.Worker
    wb: pf.Worker
    src: np.ndarray
    dst: np.ndarray
    mr_a: pf.MemoryRegistration
    mr_b: pf.MemoryRegistration

    @classmethod
    def open(cls, provider: str) -> _OnePage:
        info = pf.find_infos(provider)[0]
        a, b = pf.FabricStack(info), pf.FabricStack(info)
        src, dst = np.arange(PAGE, dtype=np.uint8), np.zeros(PAGE, dtype=np.uint8)
        return cls(a, b, pf.Worker(a.endpoint, a.cq, 8), pf.Worker(b.endpoint, b.cq, 8), src,
                   dst, pf.MemoryRegistration(a.domain, src.ctypes.data, PAGE, ACCESS, 1,
                                              a.endpoint),
                   pf.MemoryRegistration(b.domain, dst.ctypes.data, PAGE, ACCESS, 1, b.endpoint))

    def op(self, imm: int) -> pf.WriteOp:
        """a's page onto b's, carrying `imm` (op id 1)."""
        op = pf.WriteOp(
            dest=self.a.av.insert(self.b.endpoint.name), n=1, length=PAGE,
            src_addr=self.src.ctypes.data, src_stride=0, desc=self.mr_a.desc,
            dst_addr=self.dst.ctypes.data if self.b.info.mr_mode & lib.FI_MR_VIRT_ADDR else 0,
            dst_stride=0, key=self.mr_b.key, imm=imm,
        )  # fmt: skip
        op.op_id = 1
        return op

    def close(self) -> None:
        _release(self.mr_a, self.mr_b, self.a, self.b, self.wa, self.wb)


def test_worker_paged_write_lands_scattered(pair: Pair) -> None:
    """One WriteOp of 32 pages lands byte-exact at permuted slots, with 32 immediates."""
    a, b = pair
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (32, PAGE), dtype=np.uint8)
    dst = np.zeros_like(src)
    mr_a = pf.MemoryRegistration(a.domain, src.ctypes.data, src.nbytes, ACCESS, 1, a.endpoint)
    mr_b = pf.MemoryRegistration(b.domain, dst.ctypes.data, dst.nbytes, ACCESS, 1, b.endpoint)
    wa, wb = pf.Worker(a.endpoint, a.cq, 8), pf.Worker(b.endpoint, b.cq, 8)
    virt = bool(b.info.mr_mode & lib.FI_MR_VIRT_ADDR)
    perm = rng.permutation(32).astype(np.int64)
    try:
        op = pf.WriteOp(
            dest=a.av.insert(b.endpoint.name), n=32, length=PAGE,
            src_addr=src.ctypes.data, src_stride=PAGE, desc=mr_a.desc,
            dst_addr=dst.ctypes.data if virt else 0, dst_stride=PAGE, key=mr_b.key, imm=99,
            src_idx=np.arange(32, dtype=np.int64), dst_idx=perm,
        )  # fmt: skip
        op.op_id = 1
        wa.submit(op)
        events, imms = _drive([wa, wb])
        _, more = _drive([wb], until=0.2)  # the last immediates may trail the sender's events
        imms[99] = imms.get(99, 0) + more.get(99, 0)
        assert events == [pf.Event(1, 0, True)]
        assert imms == {99: 32}
        np.testing.assert_array_equal(dst[perm], src)
        assert wa.stats().writes_completed == 32
        assert wa.stats().inflight == 0
    finally:
        _release(mr_a, mr_b, a, b, wa, wb)


def test_submitting_thread_posts_at_once(pair: Pair) -> None:
    """With nobody stepping the worker (no progress call running), the writes of a submitted
    op are with the provider when `submit` returns, posted by the caller (posting on submit,
    within its time bound: a tcp write is a syscall, so it may stop short of all four); the
    worker's steps post the rest and reap, and the pages land as always. (The first op to a
    peer connects it: the provider refuses writes until the worker's progress did.)"""
    a, b = pair
    src = np.arange(4 * PAGE, dtype=np.uint32).view(np.uint8)[: 4 * PAGE].reshape(4, PAGE)
    dst = np.zeros_like(src)
    mr_a = pf.MemoryRegistration(a.domain, src.ctypes.data, src.nbytes, ACCESS, 1, a.endpoint)
    mr_b = pf.MemoryRegistration(b.domain, dst.ctypes.data, dst.nbytes, ACCESS, 1, b.endpoint)
    wa, wb = pf.Worker(a.endpoint, a.cq, 8), pf.Worker(b.endpoint, b.cq, 8)
    virt = bool(b.info.mr_mode & lib.FI_MR_VIRT_ADDR)
    dest = a.av.insert(b.endpoint.name)

    def write(op_id: int, imm: int) -> pf.WriteOp:
        op = pf.WriteOp(
            dest=dest, n=4, length=PAGE, src_addr=src.ctypes.data, src_stride=PAGE,
            desc=mr_a.desc, dst_addr=dst.ctypes.data if virt else 0, dst_stride=PAGE,
            key=mr_b.key, imm=imm,
        )  # fmt: skip
        op.op_id = op_id
        return op

    try:
        wa.submit(write(1, 4))  # connects
        assert _drive([wa, wb])[0] == [pf.Event(1, 0, True)]
        _drive([wb], until=0.2)
        dst[:] = 0
        before = wa.stats()
        wa.submit(write(2, 5))
        after = wa.stats()
        by_caller = after.posted_on_submit - before.posted_on_submit
        assert by_caller >= 1  # all 4 unless the post's time bound cut it short
        assert after.writes_posted - before.writes_posted == by_caller
        events, imms = _drive([wa, wb])
        _, more = _drive([wb], until=0.2)
        assert events == [pf.Event(2, 0, True)]
        assert imms.get(5, 0) + more.get(5, 0) == 4
        np.testing.assert_array_equal(dst, src)
    finally:
        _release(mr_a, mr_b, a, b, wa, wb)


def test_expired_op_is_never_posted(pair: Pair) -> None:
    """An op whose deadline has passed fails with -FI_ETIMEDOUT and posts no write."""
    a, b = pair
    w = pf.Worker(a.endpoint, a.cq, 8)
    try:
        op = pf.WriteOp(
            dest=a.av.insert(b.endpoint.name), n=1, length=0, src_addr=0, src_stride=0,
            desc=None, dst_addr=0, dst_stride=0, key=1, imm=1,
            deadline_ns=time.monotonic_ns() - 1,
        )  # fmt: skip
        op.op_id = 7
        w.submit(op)
        events, _ = _drive([w])
        assert events == [pf.Event(7, -lib.FI_ETIMEDOUT, True)]
        assert w.stats().writes_posted == 0
    finally:
        a.close()
        w.free()


def test_idle_tcp_worker_sleeps_on_its_fd() -> None:
    """An idle tcp worker sleeps until its CQ's fd or a submit wakes it: a few sleeps in a
    third of a second (the fd sleep's cap, 100 ms), where a napping worker would count
    hundreds (naps of at most 1 ms)."""
    stack = pf.FabricStack(pf.find_infos("tcp")[0])
    worker = pf.Worker(stack.endpoint, stack.cq, 8)
    try:
        assert stack.cq.waitable and worker.sleeps_on_fd
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            assert worker.progress(50_000_000)[2] == 0
        assert 1 <= worker.stats().sleeps <= 10
    finally:
        stack.close()
        worker.free()


def test_shm_worker_naps() -> None:
    """shm's CQ has no fd to sleep on (libfabric 1.17): its worker naps as before."""
    stack = pf.FabricStack(pf.find_infos("shm")[0])
    worker = pf.Worker(stack.endpoint, stack.cq, 8)
    try:
        assert not stack.cq.waitable and not worker.sleeps_on_fd
    finally:
        stack.close()
        worker.free()


def test_an_eager_worker_naps_its_shortest() -> None:
    """A worker that naps (shm's, no CQ fd) naps longer the longer it is idle, up to 1 ms;
    eager (writes are due), it naps 100 us however long it was idle, and grows again after."""
    stack = pf.FabricStack(pf.find_infos("shm")[0])
    worker = pf.Worker(stack.endpoint, stack.cq, 8)
    try:
        long_idle = 50_000_000
        assert worker.idle_nap_ns(long_idle) == 1_000_000
        worker.set_eager(True)
        assert worker.idle_nap_ns(long_idle) == worker.idle_nap_ns(0) == 100_000
        worker.set_eager(False)
        assert worker.idle_nap_ns(long_idle) == 1_000_000
    finally:
        stack.close()
        worker.free()


def test_a_tcp_worker_polls_while_writes_are_due_at_once() -> None:
    """A worker that sleeps on its CQ's fd (tcp) sleeps when idle, also when writes are due
    soon; due at once (back-to-back batches) it polls its CQ instead for 2 ms after its last
    activity, then sleeps on the fd again: a due write that has not come is not worth a core.
    A worker with no fd (shm) never polls: it naps its shortest."""
    stack = pf.FabricStack(pf.find_infos("tcp")[0])
    worker = pf.Worker(stack.endpoint, stack.cq, 8)
    shm = pf.FabricStack(pf.find_infos("shm")[0])
    napper = pf.Worker(shm.endpoint, shm.cq, 8)
    try:
        assert worker.sleeps_on_fd
        worker.set_eager(lib.FABP_DUE_SOON)
        assert not worker.idle_polls(100_000)
        worker.set_eager(lib.FABP_DUE_NOW)
        assert worker.idle_polls(100_000) and worker.idle_polls(1_900_000)
        assert not worker.idle_polls(2_100_000)
        worker.set_eager(0)
        assert not worker.idle_polls(100_000)
        napper.set_eager(lib.FABP_DUE_NOW)
        assert not napper.idle_polls(100_000) and napper.idle_nap_ns(50_000_000) == 100_000
    finally:
        stack.close()
        worker.free()
        shm.close()
        napper.free()


def test_a_tcp_worker_due_at_once_polls_in_its_loop_instead_of_sleeping() -> None:
    """The progress loop itself: a tcp worker idle for 1 ms after its write completed goes to
    sleep on its fd once its 50 us spin ends; with writes due at once it polls its CQ through
    that millisecond and never sleeps (best of three tries: a loaded machine may hold the test
    thread past the 2 ms window between the write and the call)."""
    page = _OnePage.open("tcp")
    wa, wb = page.wa, page.wb

    def sleeps_after_activity(level: int) -> int:
        wa.set_eager(level)
        wa.submit(page.op(9))
        _drive([wa, wb])  # wa's completion is its last activity
        before = wa.stats().sleeps
        wa.progress(1_000_000)
        return wa.stats().sleeps - before

    try:
        assert sleeps_after_activity(0) >= 1
        assert min(sleeps_after_activity(lib.FABP_DUE_NOW) for _ in range(3)) == 0
    finally:
        page.close()


def test_a_sender_with_nothing_due_takes_its_longest_nap_at_once() -> None:
    """On shm (no CQ fd) a worker spins for 1 ms after activity and then naps from 100 us up,
    so that what comes next is seen soon. Once a sender's writes have all completed and
    nothing arrives, nothing is due to it: it naps its longest (1 ms) at once, a few naps in
    3 ms where spinning and then short naps would count none for a millisecond and then a
    dozen. The receiver of those writes keeps spinning (more of a burst may follow): within
    its spin, the nap it would take is its shortest, which only a worker with something due
    takes (asked of the rule itself: whether 200 us of the test's own time pass before it
    looks depends on a loaded machine's scheduler)."""
    page = _OnePage.open("shm")
    wa, wb = page.wa, page.wb
    try:
        wa.submit(page.op(9))
        events, imms = _drive([wa, wb])
        assert events == [pf.Event(1, 0, True)] and imms.get(9) == 1
        half_a_spin = 500_000
        assert wb.idle_nap_ns(half_a_spin) == 100_000  # the receiver: a burst may go on
        assert wa.idle_nap_ns(half_a_spin) == 1_000_000  # the sender: nothing is due
        sender = wa.stats().sleeps
        assert wa.progress(3_000_000)[2] == 0
        assert 1 <= wa.stats().sleeps - sender <= 4
    finally:
        page.close()


def test_sleeping_tcp_receiver_wakes_for_a_write() -> None:
    """A receiver asleep on its fd (allowed to sleep a minute) is woken by a write landing:
    its progress call returns the immediate long before the sleep could have ended."""
    page = _OnePage.open("tcp")
    wa, wb = page.wa, page.wb
    wb.set_fd_sleep(60_000_000_000)
    got: list[list[tuple[int, int]]] = []
    receiver = threading.Thread(target=lambda: got.append(wb.progress(60_000_000_000)[1]))
    try:
        receiver.start()
        while wb.stats().sleeps == 0:  # asleep on the fd before anything is sent
            time.sleep(0.01)
        wa.submit(page.op(77))
        events, _ = _drive([wa])
        receiver.join(10.0)  # woken by the fd: at once; by its timer: after a minute
        assert events == [pf.Event(1, 0, True)]
        assert not receiver.is_alive() and got == [[(77, 1)]]
        np.testing.assert_array_equal(page.dst, page.src)
    finally:
        if receiver.is_alive():
            wb.interrupt()
            receiver.join()
        page.close()
