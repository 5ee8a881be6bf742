"""Pages of abandoned requests, held until no write can still land in them (X4b, S2, S4c).

A request the decoder gives up on (deadline, client abort, failed or dead prefiller) may still
have writes in flight towards its pages. Reusing those pages for another request would let a
late write corrupt it and decode garbage with a success status. So the pages wait here.

NOTE (the counted fence). Every write of a request carries one of its two immediate values
(the body's or the tail's, S4c), and the prefiller answers a cancellation only once none of its
writes is in flight, telling how many completed under each (`KVFailed.writes_posted`,
`tail_writes_posted`). When the decoder has counted that many arrivals of each value, no write
of the request can still land: the pages are released. When the number is
unknown (the prefiller died, or lost track) the pages are held for a grace period instead; a
fence that is never reached (a lost immediate) is released at a deadline, with a warning.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from disagg.engine.page_allocator import PageAllocator
from disagg.engine.request import FailureCause, Request, RequestState
from transfer_core.transport import Transport

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What becomes of an abandoned request once no write can land in its pages: it waits
    for its KV again (`WAITING_FOR_KV`, a retry), or ends `FINISHED_FAILED` or
    `FINISHED_ABORTED`; `cause` and `detail` say why."""

    then: RequestState
    cause: FailureCause
    detail: str

    def __post_init__(self) -> None:
        assert self.then in VERDICT_STATES, f"no request is quarantined into {self.then}"


VERDICT_STATES = (RequestState.WAITING_FOR_KV, RequestState.FINISHED_FAILED,
                  RequestState.FINISHED_ABORTED)


@dataclass
class Quarantined:
    """An abandoned request's pages and what to do with the request once they are free."""

    request: Request
    page_ids: list[int]
    imms: tuple[int, ...]
    release_at: float  # time.monotonic(): release even if the fence was not reached
    verdict: Verdict
    fence_known: bool  # False: the writes posted are unknown, a grace period stands in
    unfenced: set[int] = field(default_factory=set)  # values whose fence is still armed

    @property
    def fenced(self) -> bool:
        """Every value's fence was reached."""
        return self.fence_known and not self.unfenced


class PageQuarantine:
    """Holds pinned pages until their counted fence fires or a deadline passes."""

    def __init__(self, transfer: Transport, allocator: PageAllocator,
                 timeout_s: float = 10.0) -> None:
        self.transfer = transfer
        self.allocator = allocator
        self.timeout_s = timeout_s
        self._held: dict[int, Quarantined] = {}  # by the first of its imms
        # (entry's key, value) of each fence reached, from the transfer engine's thread.
        self._fenced: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.forced_releases = 0  # fences never reached: the lost-immediate case

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, imm: object) -> bool:
        """Whether a request with immediate value `imm` is held here (its value is in use)."""
        return any(imm in entry.imms for entry in self._held.values())

    def hold(self, request: Request, imms: Sequence[int], writes_posted: Sequence[int] | None,
             verdict: Verdict, grace_s: float, expected_writes: Sequence[int]) -> None:
        """Take over `request`'s pinned pages (and free the others, prefix-cache hits); its
        counter for each value of `imms` becomes a fence, and the pages wait for all of them.

        `writes_posted`: the writes that completed under each value; None: unknown, hold for
        `grace_s` (a dead peer's bytes in flight). `expected_writes`: what each counter was
        armed for (0: none was). A counter that is gone has fired (nothing else removes it),
        consuming that many arrivals: they count too.
        """
        counted = []
        for imm, expected in zip(imms, expected_writes, strict=True):
            armed = self.transfer.remove_imm_count(imm)
            counted.append(expected if armed is None else armed[0])
        now = time.monotonic()
        known = writes_posted is not None
        # Pages from the prefix cache are never written by a prefiller: they go back at once.
        pinned = [p for p in request.page_ids if self.allocator.is_pinned(p)]
        self.allocator.free([p for p in request.page_ids if not self.allocator.is_pinned(p)])
        entry = Quarantined(request, pinned, tuple(imms),
                            now + (self.timeout_s if known else grace_s), verdict, known)
        request.page_ids, request.page_digests = [], []
        key = entry.imms[0]
        self._held[key] = entry
        if writes_posted is None:
            return
        for imm, posted, seen in zip(imms, writes_posted, counted, strict=True):
            if posted > seen:
                entry.unfenced.add(imm)
                self.transfer.expect_imm_count(imm, posted - seen,
                                               lambda imm=imm: self._fenced.put((key, imm)))

    def release_due(self) -> list[Quarantined]:
        """Free the pages whose fence fired or whose time is up; returns those entries."""
        while True:
            try:
                key, imm = self._fenced.get_nowait()
            except queue.Empty:
                break
            if (entry := self._held.get(key)) is not None:
                entry.unfenced.discard(imm)
        now = time.monotonic()
        released = [e for e in self._held.values() if e.fenced or now >= e.release_at]
        for entry in released:
            del self._held[entry.imms[0]]
            if not entry.fenced:
                for imm in entry.imms:  # a fence still armed, or arrivals nobody counts on
                    self.transfer.remove_imm_count(imm)
                if entry.fence_known:
                    self.forced_releases += 1
                    logger.warning("fence of %s never reached (a lost immediate?): pages "
                                   "released at the deadline", entry.request.request_id)
            self.allocator.unpin(entry.page_ids)
            self.allocator.free(entry.page_ids)
        return released
