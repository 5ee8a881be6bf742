"""Writes whose caller waits for them, posted and reaped in the caller's own thread (S5).

`TransferEngine.prepare_write` checks one write once and returns a `PreparedWrite`; each
`run()` is one C call (`fabp_run_prepared`, GIL released) that checks a shm peer, posts the
write, drives its domain's loop until the write is done and returns a status, so the caller
pays no hand-off from a progress thread (the NOTEs on waited ops and prepared runs in
pyfabric/shim_wait.c.in) and no Python beyond the call. `TransferEngine.write_and_wait` is one
prepare and one run, and a write repeated with the same arguments runs the prepared write of
its first call again (`RepeatedWrites`). `run()` returns or raises exactly once per call, also
when the engine closes or its progress thread fails meanwhile. Not for writes a caller does
not wait for: those are `post_write`.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Hashable

from transfer_core.domain_worker import DomainWorker
from transfer_core.errors import PeerError
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor
from transfer_core.pyfabric import WriteOp, lib
from transfer_core.pyfabric.datapath import Worker
from transfer_core.pyfabric.objects import shm_file

_run_prepared, _DONE = lib.fabp_run_prepared, lib.FABP_WAIT_DONE  # looked up once
_REUSABLE = (lib.FABP_WAIT_RETIRED, lib.FABP_WAIT_PEER_GONE)  # the op is not in flight
# Prepared writes `write_and_wait` keeps: each holds a shm peer's fd, so few.
REPEATED_WRITES = 32


def open_peer_file(peer: bytes) -> int:
    """An fd on a shm peer's /dev/shm file, for the C call's per-run liveness check (its
    links drop to 0 when the owner closes); -1 for other providers. PeerError if it is gone."""
    path = shm_file(peer)
    if path is None:
        return -1
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PeerError(f"peer unreachable: shm peer's {path} is gone") from None


def prepared_write(
    worker: DomainWorker, make_op: Callable[[], WriteOp], peer: bytes, timeout_s: float
) -> PreparedWrite:
    """A `PreparedWrite` of `make_op`'s write to `peer` (its address on that domain)."""
    peer_fd = open_peer_file(peer)
    try:
        return PreparedWrite(worker, make_op, peer_fd, timeout_s)
    except BaseException:
        if peer_fd >= 0:
            os.close(peer_fd)
        raise


def _closed() -> WriteOp:
    raise ValueError("this prepared write is closed")


def _release(worker: Worker, held: list[int], fd: int) -> None:
    """A prepared write's finaliser: its op (not in flight, see `run`) and its fd."""
    worker.untrack(held[0])
    if fd >= 0:
        os.close(fd)


class PreparedWrite:
    """One checked single write on one domain; `run()` posts it and waits for it.

    The op's fields are set once here; each run sets only its deadline (in C). The op is
    posted again by each run while the last one retired it; after a failure with writes
    still out, the next run makes a fresh one (the provider may still hold the old, which
    its retirement event lets go of). Not thread safe: one run at a time per PreparedWrite."""

    def __init__(
        self, worker: DomainWorker, make_op: Callable[[], WriteOp], peer_fd: int,
        timeout_s: float,
    ) -> None:
        self._worker = worker
        self._make_op = make_op
        self._op: WriteOp | None = None
        self._held = [0]  # the id of the op the finaliser may drop
        self._handle = worker.c_worker.handle
        self._fd = peer_fd
        self._finalizer = weakref.finalize(self, _release, worker.c_worker, self._held, peer_fd)
        self.timeout_s = timeout_s
        self._timeout_ns = int(timeout_s * 1e9)
        self._renew()

    def _renew(self) -> None:
        op = self._worker.waited_op(self._make_op)
        self._op, self._c, self._held[0] = op, op.c, op.op_id

    @property
    def domain(self) -> int:
        """The local domain the write leaves on."""
        return self._worker.index

    @property
    def closed(self) -> bool:
        return self._make_op is _closed

    def run(self, timeout_s: float | None = None) -> None:
        """Post the write and return once it is done; raise its TransferError if it failed
        (TransferTimeoutError past the deadline, PeerError for a shm peer that is gone)."""
        if self._op is None:
            self._renew()
        timeout_ns = self._timeout_ns if timeout_s is None else int(timeout_s * 1e9)
        rc = _run_prepared(self._handle, self._c, timeout_ns, self._fd)
        if rc != _DONE:
            self._failed(rc)

    def _failed(self, rc: int) -> None:
        if rc == lib.FABP_WAIT_PEER_GONE:
            raise PeerError("peer unreachable: shm peer is gone (its /dev/shm file was removed)")
        error = self._worker.waited_error(rc, int(self._c.err))
        if rc not in _REUSABLE:
            self._op = None  # still in flight: tracked until its retirement event
            self._held[0] = 0  # (ids start at 1)
        raise error

    def close(self) -> None:
        """Let go of the op and the peer's fd now rather than when collected; a later run
        raises ValueError."""
        self._finalizer()
        self._op, self._make_op = None, _closed


class RepeatedWrites:
    """`write_and_wait`'s prepared writes by their arguments: a write repeated with the same
    ones runs the prepared write of its first call, skipping the checks' second half and the
    op's construction (about 5 µs of Python a call). A key holds ids of the regions its entry
    keeps alive, so an id names the same object as long as its entry lives. An entry is out
    of the map while it runs (one run at a time each; a concurrent twin prepares its own).
    Bounded: at `cap` entries the one run least recently is closed (a run re-inserts)."""

    def __init__(self, cap: int = REPEATED_WRITES) -> None:
        self._cap = cap
        self._by_args: dict[Hashable, tuple[MemoryRegion, MemoryRegionDescriptor, PreparedWrite]]
        self._by_args = {}
        self._lock = threading.Lock()  # for whole-map changes; single pops and puts are atomic
        self._closed = False  # forget() of all: an entry coming back from its run is closed

    def run(
        self, key: Hashable, src_mr: MemoryRegion, dst_mr: MemoryRegionDescriptor,
        prepare: Callable[[], PreparedWrite],
    ) -> None:
        """Run the entry of `key`, made by `prepare()` if there is none."""
        entry = self._by_args.pop(key, None)
        if entry is None:
            entry = (src_mr, dst_mr, prepare())
        try:
            entry[2].run()
        except PeerError:
            entry[2].close()  # the peer is gone for good: nothing to run again
            raise
        finally:
            if not entry[2].closed:
                self._put(key, entry)

    def _put(
        self, key: Hashable, entry: tuple[MemoryRegion, MemoryRegionDescriptor, PreparedWrite]
    ) -> None:
        if len(self._by_args) >= self._cap:
            with self._lock:
                while len(self._by_args) >= self._cap:
                    try:  # the oldest; a run elsewhere may change the map meanwhile
                        oldest = self._by_args.pop(next(iter(self._by_args)), None)
                    except (RuntimeError, StopIteration, KeyError):
                        continue
                    if oldest is not None:
                        oldest[2].close()
        if self._by_args.setdefault(key, entry) is not entry:
            entry[2].close()  # a concurrent twin came back first
        elif self._closed:
            self.forget()  # the engine closed while this entry ran

    def forget(self, region: MemoryRegion | None = None) -> None:
        """Close the entries writing from `region` (None: all of them, for good)."""
        with self._lock:
            self._closed = self._closed or region is None
            for key, entry in list(self._by_args.items()):
                mine = region is None or entry[0] is region
                if mine and self._by_args.pop(key, None) is not None:
                    entry[2].close()
