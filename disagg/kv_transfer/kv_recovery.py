"""What a decoder does when a request's KV does not come (X4a-c; S2, S4c).

NOTE (one exit per request). A request waiting for KV leaves the `PendingTable` exactly once:
released to the engine (the messenger, when its counter fired and its checksum matched), or
handed to the `PageQuarantine` with a `Verdict`: retried (`WAITING_FOR_KV` again), failed or
aborted. Its pages wait there until no write of it can still land (the counted fence of
`quarantine.py`), and only then is the verdict carried out (`released`). Paths here:
- a deadline passes: cancel at the prefiller, retry once (`check_deadlines`);
- the prefiller gives up or confirms a cancel (`on_kv_failed`): the writes it posted under each
  of the request's immediates are the fence;
- a cancel is never confirmed: quarantine with a grace period;
- the prefiller dies (`prefiller_gone`): every request it held, with a grace period, then
  retried on another prefiller while one is alive, or failed;
- a client abort (`abort`), a checksum mismatch (`reject`).
"""

from __future__ import annotations

import logging
import time

from disagg.config import ReliabilityConfig
from disagg.engine.page_allocator import PageAllocator
from disagg.engine.request import FailureCause, Request, RequestState
from disagg.kv_transfer.messages import Cancel, KVFailed
from disagg.kv_transfer.pending_kv import Outcome, PendingKV, PendingTable
from disagg.kv_transfer.prefiller_pool import PrefillerPool
from disagg.kv_transfer.quarantine import PageQuarantine, Verdict
from transfer_core.transport import Transport

logger = logging.getLogger(__name__)
ABORTED = Verdict(RequestState.FINISHED_ABORTED, FailureCause.ABORTED, "aborted by the client")


def dropped(request: Request, verdict: Verdict) -> Outcome:
    """`request` ends (or is retried) as `verdict` says."""
    request.state = verdict.then
    if verdict.then is RequestState.FINISHED_FAILED:
        logger.warning("request %s failed: %s", request.request_id, verdict.detail)
    return Outcome(request, verdict.then, verdict.cause, verdict.detail)


class KVRecovery:
    """Deadlines, cancel fences, quarantine and retries of the requests waiting for KV."""

    def __init__(self, transport: Transport, allocator: PageAllocator,
                 pending: PendingTable, pool: PrefillerPool,
                 reliability: ReliabilityConfig) -> None:
        self.reliability = reliability
        self.quarantine = PageQuarantine(transport, allocator, reliability.quarantine_timeout_s)
        self._pending = pending
        self._pool = pool

    def verdict(self, request: Request, cause: FailureCause, detail: str,
                retry: bool = True) -> Verdict:
        """Retry while attempts remain (and `retry` allows it), else fail."""
        if retry and request.kv_attempts < self.reliability.max_attempts:
            return Verdict(RequestState.WAITING_FOR_KV, cause, detail)
        return Verdict(RequestState.FINISHED_FAILED, cause, detail)

    def check_deadlines(self) -> None:
        """Cancel requests whose KV is late; quarantine those whose cancel went unanswered."""
        now = time.monotonic()
        for pending in self._pending.values():
            if self._pending.get(pending.request.request_id) is not pending:
                continue  # settled meanwhile: its prefiller was found gone by a cancel
            if pending.overdue(now):
                self._cancel(pending, self.verdict(
                    pending.request, FailureCause.DEADLINE,
                    f"KV did not arrive within {self.reliability.kv_timeout_s:g} s"))
            elif pending.cancel_overdue(now):
                assert pending.cancel is not None
                self._hold(pending, None, pending.cancel, self.reliability.quarantine_timeout_s)

    def reject(self, pending: PendingKV, cause: FailureCause, detail: str) -> None:
        """Its counter fired but the KV is wrong (a duplicated immediate, corrupted pages):
        writes may still be landing, so hold the pages and ask again."""
        self._hold(pending, None, self.verdict(pending.request, cause, detail),
                   self.reliability.quarantine_timeout_s)

    def abort(self, pending: PendingKV) -> None:
        """The client gave up: cancel at the prefiller (or turn a cancel under way into an
        abort); the request ends once its pages are safe."""
        if pending.cancel is None:
            self._cancel(pending, ABORTED)
        else:
            pending.cancel = ABORTED

    def on_kv_failed(self, message: KVFailed) -> None:
        """The prefiller gave up on (or was told to drop) a request; nothing of it is in flight
        there, and the writes it posted under each immediate are the fence."""
        pending = self._pending.get(message.request_id)
        if pending is None:
            return  # already handled (e.g. the counter fired first)
        # A write that failed at the fabric (e.g. a connection a forged Hello got dropped) is
        # worth another try; a prefiller's refusal or lease is not.
        verdict = pending.cancel or self.verdict(
            pending.request, message.cause, f"prefiller: {message.reason}",
            retry=message.cause is FailureCause.WRITE_FAILED)
        posted = (message.writes_posted, message.tail_writes_posted)
        self._hold(pending, posted if min(posted) >= 0 else None, verdict,
                   self.reliability.quarantine_timeout_s)

    def prefiller_gone(self, index: int, reason: str) -> None:
        """A prefiller died or stopped answering: hold its requests' pages for a grace period,
        then retry them on another prefiller or fail them."""
        if not self._pool.mark_gone(index):
            return
        logger.error("prefiller %d is gone (%s)", index, reason)
        can_retry = self.reliability.retry_on_prefiller_failure and self._pool.any_alive()
        for pending in self._pending.of_prefiller(index):
            verdict = pending.cancel or self.verdict(
                pending.request, FailureCause.PREFILLER_DIED, f"prefiller died: {reason}",
                retry=can_retry)
            if verdict.then is RequestState.WAITING_FOR_KV and not self._pool.any_alive():
                verdict = Verdict(RequestState.FINISHED_FAILED, verdict.cause, verdict.detail)
            self._hold(pending, None, verdict, self.reliability.death_grace_s)

    def released(self) -> list[Outcome]:
        """Carry out the verdicts of requests whose pages are free again: a retried request
        comes back as `WAITING_FOR_KV` (one attempt more), the others end."""
        outcomes = []
        for entry in self.quarantine.release_due():
            request, verdict = entry.request, entry.verdict
            if verdict.then is RequestState.WAITING_FOR_KV:
                logger.warning("retrying %s: %s", request.request_id, verdict.detail)
                request.kv_attempts += 1
                outcomes.append(Outcome(request, verdict.then, verdict.cause, verdict.detail))
            else:
                outcomes.append(dropped(request, verdict))
        return outcomes

    def _cancel(self, pending: PendingKV, verdict: Verdict) -> None:
        """Ask the prefiller to stop; its KVFailed answer carries the fence."""
        pending.start_cancel(verdict, self.reliability.quarantine_timeout_s)
        if not self._pool.send(pending.prefiller, Cancel(pending.request.request_id)):
            self.prefiller_gone(pending.prefiller, "unreachable")

    def _hold(self, pending: PendingKV, writes_posted: tuple[int, int] | None,
              verdict: Verdict, grace_s: float) -> None:
        self._pending.forget(pending)
        self.quarantine.hold(pending.request, pending.imms, writes_posted, verdict, grace_s,
                             expected_writes=pending.armed)
