"""The decoder's record of one request waiting for its KV, and the table of them (S2a, S4c).

`PendingKV` owns what the request waits for: the immediate value every write of it carries,
the number of writes that make it complete (pages x layers x writes per page, plus the context
slot, S4c, S6b), the deadline by which they must have landed, the nonce its context slot must
carry back (S5), and, once given up on, what becomes of it after the prefiller confirms the
cancel. `PendingTable` holds the records and gives back what each holds (its prefiller's
load, its context slot) when it leaves. `Outcome` is what became of a request in one poll.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from disagg.engine.request import FailureCause, Request, RequestState
from disagg.kv_transfer.context_slot import LandingSlots
from disagg.kv_transfer.prefiller_pool import PrefillerPool
from disagg.kv_transfer.quarantine import Verdict


@dataclass
class PendingKV:
    """A request waiting for its KV: the decoder-side transfer context."""

    request: Request
    imm: int
    context_slot: int
    expected_writes: int
    prefiller: int  # index in the prefiller pool
    nonce: int  # sent with the request; its context slot must carry it back (S5)
    started_at: float  # time.monotonic() when the prefiller was asked
    deadline: float  # time.monotonic() by which the KV must have arrived
    cancel: Verdict | None = None  # what happens once the Cancel sent is answered
    cancel_deadline: float = float("inf")  # by when the prefiller must have answered it

    def overdue(self, now: float) -> bool:
        """Still awaited past its deadline (a request being cancelled is not)."""
        return self.cancel is None and now >= self.deadline

    def cancel_overdue(self, now: float) -> bool:
        """Being cancelled, and the prefiller has not confirmed in time."""
        return self.cancel is not None and now >= self.cancel_deadline

    def start_cancel(self, verdict: Verdict, answer_within_s: float) -> None:
        """A Cancel is on its way: `verdict` applies once the prefiller confirms it."""
        self.cancel = verdict
        self.cancel_deadline = time.monotonic() + answer_within_s

    def receipt(self, num_pages_moved: int, page_nbytes: int, num_layers: int,
                context_nbytes: int) -> KVReceipt:
        """What the transfer took: `page_nbytes` is one page of one layer over every rank."""
        nbytes = num_pages_moved * num_layers * page_nbytes + context_nbytes
        wait_ms = (time.monotonic() - self.started_at) * 1e3
        return KVReceipt(self.expected_writes, nbytes, wait_ms)


@dataclass(frozen=True, slots=True)
class KVReceipt:
    """What one request's KV transfer took, as the decoder saw it."""

    writes: int
    nbytes: int
    wait_ms: float  # from asking the prefiller to the counter firing (prefill included)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to a request this poll: `RUNNING` (released, with its receipt),
    `WAITING_FOR_KV` (retried), `FINISHED_FAILED` or `FINISHED_ABORTED`."""

    request: Request
    state: RequestState
    cause: FailureCause | None = None
    detail: str = ""
    receipt: KVReceipt | None = None


class PendingTable:
    """Every request waiting for KV, by request id."""

    def __init__(self, pool: PrefillerPool, slots: LandingSlots) -> None:
        self._pool = pool
        self._slots = slots
        self._by_id: dict[str, PendingKV] = {}

    def add(self, pending: PendingKV) -> None:
        """`pending` holds a slot and a unit of its prefiller's load until `forget`."""
        self._by_id[pending.request.request_id] = pending

    def get(self, request_id: str) -> PendingKV | None:
        """The record of `request_id`, if it waits for KV."""
        return self._by_id.get(request_id)

    def forget(self, pending: PendingKV) -> None:
        """It no longer waits (released, or handed to the quarantine)."""
        del self._by_id[pending.request.request_id]
        self._pool.release(pending.prefiller)
        self._slots.give_back(pending.context_slot)

    def of_prefiller(self, index: int) -> list[PendingKV]:
        """The requests prefiller `index` was asked for."""
        return [p for p in self._by_id.values() if p.prefiller == index]

    def uses_imm(self, imm: int) -> bool:
        """Whether a waiting request carries immediate value `imm`."""
        return any(p.imm == imm for p in self._by_id.values())

    def values(self) -> list[PendingKV]:
        """A snapshot of the records (safe to change the table while iterating it)."""
        return list(self._by_id.values())

    def __getitem__(self, request_id: str) -> PendingKV:
        return self._by_id[request_id]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)
