"""`DomainWorker`: one domain (NIC) of a `TransferEngine`, with its own progress thread (S5).

It owns the fabric stack and the C worker of one endpoint. A submitting thread posts its
writes itself when it can (shim_post.c.in's NOTE on posting on submit); this domain's thread
calls the C progress loop (GIL released), which posts what is left, reaps completions and
counts immediates; the thread then runs finished ops' callbacks and hands immediate counts to
the engine. A caller
waiting for its own write (`write_and_wait`) runs that loop itself instead, in its own thread,
and its op's result reaches it without a hand-off (shim.c.in's NOTE on waited ops). The thread
must run even on a pure receiver: progress is manual (the target's polling moves the data).
Every submitted op reaches its `on_finish` exactly once, also on close or fatal error
(`completion.py` folds the ops of one transfer into one on_done/on_error).
One peer's writes never hold up another's (X5c): each peer endpoint gets its own share of the
slots, and `abandon_peer` fails what is queued for a peer given up (X4). Its registrations
take keys nobody can guess (`memory_keys.py`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from transfer_core.completion import OnFinish
from transfer_core.errors import PeerError, TransferError, TransferTimeoutError
from transfer_core.imm_counter import Due
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor
from transfer_core.memory_keys import register_unguessable
from transfer_core.peer_table import PeerTable
from transfer_core.phases import ImmRecord, OpRecord, PhaseLog
from transfer_core.pyfabric import (
    Event,
    FabricError,
    FabricStack,
    ImmArrival,
    Info,
    MemoryRegistration,
    Stats,
    Worker,
    WriteOp,
    lib,
)
from transfer_core.pyfabric.errors import fabric_error
from transfer_core.thread_name import name_current_thread
from transfer_core.topology import pin_current_thread

logger = logging.getLogger(__name__)

# Writes in flight to one peer endpoint. Stay well under the provider's TX queue: spinning on
# EAGAIN at the limit collapses throughput on a busy machine, and tcp;ofi_rxm ran at half
# speed with 256 x 64 KiB in flight to one peer on loopback; 64 writes keep a NIC or a socket
# busy.
DEFAULT_MAX_INFLIGHT = 64
# A domain holds this many peers' worth of slots (within half the TX queue): a frozen peer
# keeps its writes in flight until it thaws, and measured with one shared cap of 64, its
# writes took every slot and no other peer got a write out for as long (X5c).
PEER_SHARES = 4
# One C call's budget. The call returns early for completions, immediates, deadlines and
# close()'s interrupt (submissions are taken inside it), so the budget only bounds how often an
# idle thread comes back for the GIL, which it would take from the engine thread.
_BUDGET_NS = 1_000_000_000
_OP_WAITED = lib.FABP_OP_WAITED
_PEER_ERRNOS = {
    lib.FI_ENOTCONN,
    lib.FI_ECONNREFUSED,
    lib.FI_ECONNRESET,
    lib.FI_ECONNABORTED,
    lib.FI_EHOSTUNREACH,
    lib.FI_ECANCELED,
    lib.FI_EACCES,
}


def error_for(err: int, what: str) -> TransferError:
    """Map a negative fi errno from a write's completion to the exception `on_error` gets."""
    if -err == lib.FABP_EABANDONED:
        return PeerError(f"{what}: the peer was given up before the write completed")
    base = fabric_error(what, err)
    if -err == lib.FI_ETIMEDOUT:
        return TransferTimeoutError(f"{what}: no completion before the deadline")
    if -err in _PEER_ERRNOS:
        return PeerError(str(base))
    return base


class DomainWorker:
    """Endpoint + C worker + progress thread for one fi_info entry."""

    def __init__(
        self,
        index: int,
        info: Info,
        on_imms: Callable[[list[tuple[int, int]]], None],
        run_callback: Callable[..., None],
        cpus: tuple[int, ...] | None = None,
        max_inflight: int | None = None,
        phases: PhaseLog | None = None,
    ) -> None:
        self.index = index
        self._phases = phases
        self.info = info
        self._on_imms = on_imms
        self._run_callback = run_callback
        self._cpus = cpus
        self.stack = FabricStack(info)
        self.address = self.stack.endpoint.name
        cap = max_inflight or min(DEFAULT_MAX_INFLIGHT, max(1, info.tx_size // 2))
        slots = max(cap, min(PEER_SHARES * cap, info.tx_size // 2))
        self._worker = Worker(self.stack.endpoint, self.stack.cq, slots, dest_cap=cap,
                              timed=phases is not None)
        self._ids = itertools.count(1)
        self._ops: dict[int, OnFinish] = {}
        self._peers = PeerTable(self.stack.av)
        self._lock = threading.Lock()
        self._deferred: deque[Callable[[], None]] = deque()
        self._stopping = False
        self.failure: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"transfer-domain-{index}", daemon=True
        )
        self._pinned = threading.Event()
        self._thread.start()
        if cpus is not None:  # callers (and tests) may read the affinity right away
            self._pinned.wait(5.0)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def c_worker(self) -> Worker:
        """The C worker, whose handle prepared writes call `fabp_run_prepared` on."""
        return self._worker

    def register(
        self, ptr: int, length: int, access: int, cuda_device: int | None
    ) -> MemoryRegistration:
        """Register with this domain under a key nobody can guess (`memory_keys.py`)."""
        return register_unguessable(self.stack, self.info, ptr, length, access, cuda_device)

    def peer(self, address: bytes) -> int:
        """fi_addr of a remote endpoint (`PeerTable.fi_addr`). Raises FabricError for a shm
        peer that is gone."""
        return self._peers.fi_addr(address)

    def abandon_peer(self, address: bytes) -> bool:
        """Give up on every write submitted so far to the endpoint at `address`: each fails
        with a `PeerError` on this domain's thread now, not at its deadline, and is freed
        once the writes the provider already took have returned (G6). False if this domain
        never wrote there. The peer stays in the AV (`peer_table.py` says why)."""
        fi_addr = self._peers.known(address)
        if fi_addr is None:
            return False
        self._worker.fail_dest(fi_addr)
        return True

    def write_op(
        self, dst_mr: MemoryRegionDescriptor, timeout_s: float, src_mr: MemoryRegion | None,
        n: int, length: int, src_offset: int, src_stride: int, dst_offset: int,
        dst_stride: int, imm: int | None, src_idx: np.ndarray | None = None,
        dst_idx: np.ndarray | None = None, imms: np.ndarray | None = None,
    ) -> WriteOp:
        """n writes from this domain to the peer's domain `index` modulo the peer's count:
        with equal counts rank i's domain writes to the peer's domain i (S6a); a peer with
        fewer domains takes several of ours, one with more leaves its upper ones to others.
        Raises PeerError for a peer that cannot be reached."""
        address, key = dst_mr.domains[self.index % len(dst_mr.domains)]
        try:
            dest = self.peer(address)
        except FabricError as exc:
            raise PeerError(f"region {dst_mr.name!r}: peer unreachable: {exc}") from exc
        op = WriteOp(
            dest=dest, n=n, length=length,
            src_addr=src_mr.ptr + src_offset if src_mr else 0, src_stride=src_stride,
            desc=src_mr.registrations[self.index].desc if src_mr else None,
            dst_addr=dst_mr.remote_addr(dst_offset), dst_stride=dst_stride, key=key, imm=imm,
            src_idx=src_idx, dst_idx=dst_idx, imms=imms,
            deadline_ns=time.monotonic_ns() + int(timeout_s * 1e9),
        )
        op.keep(src_mr)  # the source memory outlives every in-flight write
        return op

    def submit(self, op: WriteOp, on_finish: OnFinish) -> None:
        """Queue `op`; `on_finish(error or None)` runs exactly once, on this domain's thread."""
        op.op_id = next(self._ids)
        with self._lock:  # against stop()/failure: an op is either failed by them or queued
            self._check_usable()
            self._ops[op.op_id] = on_finish
            self._worker.submit(op)

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise TransferError(f"domain {self.index} progress thread failed") from self.failure
        if self._stopping:
            raise TransferError(f"domain {self.index} is closed")

    def waited_op(self, make_op: Callable[[], WriteOp]) -> WriteOp:
        """An op from `make_op` for `fabp_run_prepared`: flagged as waited, given an id and
        tracked by the C worker's owner until it is retired (`Worker.track`)."""
        op = make_op()
        op.c.flags |= _OP_WAITED
        op.op_id = next(self._ids)
        self._worker.track(op)
        return op

    def waited_error(self, rc: int, err: int) -> TransferError:
        """The error a prepared run's status `rc` stands for (`err`: the op's fi errno)."""
        if rc in (lib.FABP_WAIT_RETIRED, lib.FABP_WAIT_REPORTED):
            return error_for(err, "rma write")
        if rc == lib.FABP_WAIT_CLOSED:
            if self.failure is not None:
                return TransferError(f"domain {self.index} progress failed: {self.failure}")
            return TransferError(
                f"engine closed before the operation finished (domain {self.index})"
            )
        return TransferError(
            f"domain {self.index} progress failed: {fabric_error('fi_cq_read', rc)}"
        )

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run `callback` on this domain's thread."""
        self._deferred.append(callback)
        self._worker.interrupt()

    def pending(self) -> int:
        return len(self._ops)

    def stats(self) -> Stats:
        return self._worker.stats()

    def set_eager(self, due: Due) -> None:
        """How soon writes are due (`TransferEngine.expect_soon`): short naps while SOON, CQ
        polling after activity while NOW; safe after `stop`: the C worker lives as long as
        this object."""
        self._worker.set_eager(int(due))

    def _run(self) -> None:
        # The OS keeps 15 bytes of a name: "transfer-domain-N" would lose its N.
        name_current_thread(f"tc-domain-{self.index}")
        try:
            if self._cpus is not None:
                try:
                    pin_current_thread(self._cpus)
                finally:
                    self._pinned.set()
            while not self._stopping:
                events, imms, rc = self._worker.progress(_BUDGET_NS)
                if rc < 0:
                    raise fabric_error("fi_cq_read", rc)
                if self._phases is not None:
                    self._hand_on_timed(events, imms)
                else:
                    self._hand_on(events, imms)
                while self._deferred:
                    self._run_callback(self._deferred.popleft())
        except BaseException as exc:
            logger.exception("domain %d progress thread failed", self.index)
            with self._lock:
                self.failure = exc
            self._worker.close_waits()  # waiters in C leave with the failure
            self._fail_all(TransferError(f"domain {self.index} progress failed: {exc}"))

    def _finish(self, event: Event) -> bool:
        """Run the callback of the op `event` reports; False if it had none left to run."""
        on_finish = self._ops.pop(event.op_id, None)
        if on_finish is None:
            return False
        self._run_callback(on_finish, error_for(event.err, "rma write") if event.err else None)
        return True

    def _hand_on(self, events: list[Event], imms: list[tuple[int, int]]) -> None:
        """Run the callbacks of the ops a progress call reported, then count its immediates."""
        for event in events:
            self._finish(event)
        if imms:
            self._run_callback(self._on_imms, imms)

    def _hand_on_timed(self, events: list[Event], arrivals: list[ImmArrival]) -> None:
        """`_hand_on`, stamping each step into the phase log."""
        assert self._phases is not None
        returned = time.monotonic_ns()
        for event in events:
            started = time.monotonic_ns()
            if self._finish(event) and event.times is not None:
                self._phases.add_op(OpRecord(self.index, event.op_id, event.err, event.times,
                                             returned, started, time.monotonic_ns()))
        if arrivals:
            self._run_callback(self._on_imms, [(a.imm, a.count) for a in arrivals])
            counted = time.monotonic_ns()
            for arrival in arrivals:
                self._phases.add_imms(ImmRecord(self.index, arrival, returned, counted))

    def _fail_all(self, error: TransferError) -> None:
        while self._ops:
            _, on_finish = self._ops.popitem()
            self._run_callback(on_finish, error)
        while self._deferred:
            self._run_callback(self._deferred.popleft())

    def stop(self, drain_s: float) -> None:
        """Wait up to `drain_s` for queued ops, stop the thread, fail what is left."""
        deadline = time.monotonic() + drain_s
        waiters = self._worker.waiters
        busy = lambda: (self._ops and self._thread.is_alive()) or waiters()  # noqa: E731
        while busy() and time.monotonic() < deadline:
            time.sleep(0.001)
        with self._lock:
            self._stopping = True
        self._worker.close_waits()
        self._worker.interrupt()
        self._thread.join()
        # Waiters see `closing` and leave within a loop step; the endpoint must outlive them
        # (a waiter that comes later sees `closing` before it touches the endpoint).
        left_by = time.monotonic() + drain_s + 1.0
        while waiters() and time.monotonic() < left_by:
            time.sleep(0.0002)
        self._fail_all(
            TransferError(f"engine closed before the operation finished (domain {self.index})")
        )

    def close(self) -> None:
        """After `stop()` and after every registration with this domain is closed."""
        try:
            self.stack.close()
        finally:
            if self.stack.endpoint.closed:
                self._worker.free()
            else:
                logger.error(
                    "domain %d: endpoint not closed, C worker leaked on purpose", self.index
                )
