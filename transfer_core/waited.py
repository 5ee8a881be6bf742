"""Writes whose caller waits for them, posted and reaped in the caller's own thread (S5).

`TransferEngine.prepare_write` checks one write once and returns a `PreparedWrite`; each
`run()` posts it and drives its domain's C loop from the calling thread, GIL released, until
the write is done, so the caller pays no hand-off from a progress thread (the NOTE on waited
ops in pyfabric/shim.c.in). `TransferEngine.write_and_wait` is one prepare and one run.
`run()` returns or raises exactly once per call, also when the engine closes or its progress
thread fails meanwhile. Not for writes a caller does not wait for: those are `submit_write`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from transfer_core.domain_worker import DomainWorker
from transfer_core.errors import FabricError, PeerError
from transfer_core.pyfabric import WriteOp, check_peer_alive
from transfer_core.pyfabric.objects import shm_file

# A shm peer's file is looked for at most this often (a stat per 4 KiB write was a quarter of
# its latency). A peer can die just after any check anyway; its last writes then "complete"
# without landing, and only the receiver's count (which never comes) tells.
_PEER_CHECK_NS = 1_000_000


class PreparedWrite:
    """One checked single write on one domain; `run()` posts it and waits for it.

    The C op is posted again by each run while the last one retired cleanly; after a failure
    with writes still out, the next run builds a fresh one (the provider may still hold the
    old). Not thread safe: one run at a time per PreparedWrite."""

    def __init__(
        self, worker: DomainWorker, make_op: Callable[[], WriteOp], peer: bytes, timeout_s: float
    ) -> None:
        self._worker = worker
        self._make_op = make_op
        self._peer = peer
        self.timeout_s = timeout_s
        self._op: WriteOp | None = None
        self._shm_file = shm_file(peer)
        self._checked_ns = -_PEER_CHECK_NS

    def _peer_gone(self) -> None:
        try:
            check_peer_alive(self._peer)
        except FabricError as exc:
            raise PeerError(f"peer unreachable: {exc}") from exc

    @property
    def domain(self) -> int:
        """The local domain the write leaves on."""
        return self._worker.index

    def run(self, timeout_s: float | None = None) -> None:
        """Post the write and return once it is done; raise its TransferError if it failed
        (TransferTimeoutError past the deadline, PeerError for a shm peer that is gone)."""
        now = time.monotonic_ns()
        if self._shm_file is not None and now - self._checked_ns > _PEER_CHECK_NS:
            if not os.path.exists(self._shm_file):
                self._peer_gone()  # a write to a gone shm peer would "complete" locally
            self._checked_ns = now
        op = self._op if self._op is not None else self._make_op()
        self._op = None
        timeout = self.timeout_s if timeout_s is None else timeout_s
        error, reusable = self._worker.run_waited(op, now + int(timeout * 1e9))
        if reusable:
            self._op = op
        if error is not None:
            raise error
