"""`WriteRouter`: which local domain each checked write of a `TransferEngine` leaves on, and the
op queued there (S5, S6a).

A single write or an immediate leaves on the domain its caller names, or the next one round
robin. A paged write is cut into contiguous page ranges, one per domain it lists (or every
domain), and one `Completion` folds their ops into a single on_done/on_error: S6a sends rank
i's pages through rank i's NIC this way. Local domain d writes to the peer's domain d modulo
the peer's count (`DomainWorker.write_op`). A peer that cannot be reached is reported like a
failed write, through the callbacks, never raised. Nothing is checked here: the engine checks
every write before it routes it (`write_checks.py`). Waited writes are built here too
(`prepare`) and run by `waited.py`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

from transfer_core.completion import Completion, OnDone, OnError
from transfer_core.domain_worker import DomainWorker
from transfer_core.errors import PeerError, TransferError
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor
from transfer_core.pyfabric import WriteOp
from transfer_core.transport import PagedWrite
from transfer_core.waited import PreparedWrite, prepared_write
from transfer_core.write_checks import check_domain, check_domains, stripe


class WriteRouter:
    """Routes checked writes onto `domains`; see the module docstring."""

    def __init__(
        self, domains: Sequence[DomainWorker], report: Callable[[BaseException], None]
    ) -> None:
        self._domains = domains
        self._report = report  # where a failure nobody listens for goes (the engine's owner)
        self._round_robin = itertools.count()

    def pick(self, domain: int | None) -> int:
        """The domain a single write leaves on: `domain` (checked), or the next in turn."""
        if domain is None:
            return next(self._round_robin) % len(self._domains)
        return check_domain(domain, len(self._domains))

    def single(
        self,
        d: int,
        src_mr: MemoryRegion | None,
        offset: int,
        length: int,
        imm: int | None,
        dst_mr: MemoryRegionDescriptor,
        dst_offset: int,
        on_done: OnDone | None,
        on_error: OnError | None,
        timeout_s: float,
    ) -> None:
        """One write (length 0 and no source: a pure immediate) on domain `d`."""
        worker = self._domains[d]
        done = Completion(1, on_done, on_error, self._report)
        make_op = functools.partial(
            worker.write_op, dst_mr, timeout_s, src_mr, 1, length, offset, 0, dst_offset, 0, imm
        )
        self._queue(worker, done, make_op)

    def paged(
        self, write: PagedWrite, on_done: OnDone | None, on_error: OnError | None, timeout_s: float
    ) -> None:
        """`write`'s pages striped over its domains, one op each; one callback for all. A
        domain that refuses its stripe (closed, failed) raises if nothing was queued yet;
        after that the stripes in flight carry on, and the refusal reaches `on_error` once
        they end, on the first stripe's thread (not a raise: the caller would take the write
        for never posted while part of it still reads the source)."""
        parts = stripe(write.num_pages, check_domains(write.domains, len(self._domains)))
        done = Completion(len(parts), on_done, on_error, self._report)
        for i, (d, lo, hi) in enumerate(parts):
            worker = self._domains[d]
            make_op = functools.partial(
                worker.write_op,
                write.dst_mr,
                timeout_s,
                write.src_mr,
                hi - lo,
                write.nbytes,
                write.src_offset,
                write.src_page_stride,
                write.dst_offset,
                write.dst_page_stride,
                write.imm,
                write.src_page_ids[lo:hi],
                write.dst_page_ids[lo:hi],
                None if write.imms is None else write.imms[lo:hi],
            )
            try:
                self._queue(worker, done, make_op)
            except TransferError as exc:
                if i == 0:
                    raise
                refused = len(parts) - i
                self._domains[parts[0][0]].call_soon(
                    lambda exc=exc: [done.part_finished(exc) for _ in range(refused)])
                return

    def prepare(
        self,
        d: int,
        timeout_s: float,
        src_mr: MemoryRegion,
        offset: int,
        length: int,
        imm: int | None,
        dst_mr: MemoryRegionDescriptor,
        dst_offset: int,
    ) -> PreparedWrite:
        """A waited write on domain `d`, for `PreparedWrite.run()` in the caller's thread."""
        worker = self._domains[d]
        make_op = functools.partial(
            worker.write_op, dst_mr, timeout_s, src_mr, 1, length, offset, 0, dst_offset, 0, imm
        )
        peer = dst_mr.domains[worker.index % len(dst_mr.domains)][0]
        return prepared_write(worker, make_op, peer, timeout_s)

    @staticmethod
    def _queue(worker: DomainWorker, done: Completion, make_op: Callable[[], WriteOp]) -> None:
        try:
            op = make_op()
        except PeerError as exc:  # an unreachable peer is reported like a failed write
            error = exc
            worker.call_soon(lambda: done.part_finished(error))
            return
        worker.submit(op, done.part_finished)
