"""The decoder's record of one request waiting for its KV, and the table of them (S2a, S4c).

`PendingKV` owns what the request waits for: the two immediate values its writes carry and how
many writes land under each (its pages in every layer but the last under `imm`, the body; the
last layer's, a draft head's and the context slot under `tail_imm`, the tail: S4c, S6b), the
checksum of the body once it landed (summed while the tail is still on its way, X8d), the
deadline by which it all must have landed, the nonce its context slot must carry back (S5), and,
once given up on, what becomes of it after the prefiller confirms the cancel. `PendingTable`
holds the records and gives back what each holds (its prefiller's load, its context slot) when
it leaves. `Outcome` is what became of a request in one poll.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from disagg.engine.request import FailureCause, Request, RequestState
from disagg.kv_transfer.context_slot import LandingSlots
from disagg.kv_transfer.kv_checksum import ReplicaSums
from disagg.kv_transfer.prefiller_pool import PrefillerPool
from disagg.kv_transfer.quarantine import Verdict
from disagg.kv_transfer.transfer_plan import ExpectedWrites


@dataclass
class PendingKV:
    """A request waiting for its KV: the decoder-side transfer context."""

    request: Request
    imm: int  # the body's writes carry it
    tail_imm: int  # the tail's writes carry it
    context_slot: int
    expected: ExpectedWrites
    prefiller: int  # index in the prefiller pool
    nonce: int  # sent with the request; its context slot must carry it back (S5)
    started_at: float  # time.monotonic() when the prefiller was asked
    deadline: float  # time.monotonic() by which the KV must have arrived
    cancel: Verdict | None = None  # what happens once the Cancel sent is answered
    cancel_deadline: float = float("inf")  # by when the prefiller must have answered it
    body_landed: bool = False  # the body's counter fired and the body was staged in
    body_sums: list[int] = field(default_factory=list)  # its checksum per replica set
    sums: ReplicaSums | None = None  # how its pages are summed, found with the body's sum
    tail_landed: bool = False  # the tail's counter fired

    @property
    def imms(self) -> tuple[int, int]:
        return self.imm, self.tail_imm

    @property
    def armed(self) -> tuple[int, int]:
        """What each value's counter was armed for (0: not armed, nothing to count)."""
        return self.expected.body, self.expected.tail

    @property
    def expected_writes(self) -> int:
        return self.expected.total

    @property
    def landed(self) -> bool:
        """Both counters fired (and the body was taken in): ready to be checked."""
        return self.body_landed and self.tail_landed

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
        return any(imm in p.imms for p in self._by_id.values())

    def values(self) -> list[PendingKV]:
        """A snapshot of the records (safe to change the table while iterating it)."""
        return list(self._by_id.values())

    def __getitem__(self, request_id: str) -> PendingKV:
        return self._by_id[request_id]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)
