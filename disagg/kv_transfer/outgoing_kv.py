"""The prefiller's record of one request's outgoing KV: it owns its write accounting and its end
(S2b, S4b).

Every write call posted for the request is begun here (`begin_write`) and ends here
(`write_done`, on the transfer engine's thread), counted under the immediate it carried: the
body's (`imm`, every layer but the last) or the tail's (`tail_imm`: the last layer, the draft
pages and the context, S4c). The record ends exactly once: when it has been fully posted
(`all_posted`) or stopped, and no write is in flight, because until then the NIC may still read
its source pages. Its end is handed to `on_end` (the messenger's queue for the engine thread,
which frees the pages). A failure is recorded once: the first cause is the cause. Also here:
`ChunkPages`, the pages of one request one forward completes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg.engine.request import FailureCause, Request
from disagg.kv_transfer.decoder_peer import DecoderPeer
from disagg.kv_transfer.kv_checksum import LayerSums
from disagg.kv_transfer.layer_writes import LayerWrite
from disagg.kv_transfer.running_checksum import RunningChecksum, TokenRange
from disagg.kv_transfer.transfer_plan import PageWrite
from disagg.utils.trace import Tracer


@dataclass(eq=False)
class OutgoingKV:
    """One request's KV on its way to a decoder: the prefiller-side transfer context."""

    key: str  # "<peer_id>/<request_id>", unique on this prefiller
    request_id: str  # as the decoder named it
    request: Request
    peer: DecoderPeer
    imm: int  # carried by its pages in every layer but the last
    tail_imm: int  # ... in the last layer, and by its draft pages and context slot
    dst_page_ids: list[int]
    context_slot: int
    page_writes: list[PageWrite]  # how every page of every layer is written (S6)
    on_end: Callable[[OutgoingKV], None]  # called once, from any thread, when it ends
    nonce: int = 0  # the decoder's, packed next to the KV checksum (S5)
    num_held_pages: int = 0  # leading pages the decoder holds already (its prefix cache)
    num_planned_pages: int = 0  # pages below this one are held there or planned here
    # Writes completed at the sender under `imm` and `tail_imm`: the fence a decoder waits for.
    writes_ok: int = 0
    tail_writes_ok: int = 0
    writes_unknown: bool = False  # a failed call may have placed some of its writes
    error: str | None = None  # what went wrong, for logs and the decoder
    cause: FailureCause | None = None  # ... and why, as the decoder's metrics count it
    layer_post_times: list[tuple[int, float]] = field(default_factory=list)
    # Its KV checksum, added up as layers are posted (None: summed whole at the end).
    kv_sum: RunningChecksum | None = None
    # Wall-clock milestones (time.time()) for traces: the TTFT split of S1.
    received_at: float = 0.0
    first_scheduled_at: float = 0.0
    last_layer_at: float = 0.0
    done_at: float = 0.0
    traceparent: str = ""  # the decoder's span of the request: this side's spans join it
    _in_flight: int = 0
    _all_posted: bool = False
    _ended: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def failed(self) -> bool:
        """Whether it was stopped or a write failed: nothing more is posted for it."""
        return self.error is not None

    def begin_write(self) -> bool:
        """Account for one write call about to be posted; False once it has failed."""
        with self._lock:
            if self.error is not None:
                return False
            self._in_flight += 1
            return True

    def write_done(self, error: BaseException | None, *, body: int = 0, tail: int = 0) -> None:
        """A write call completed (`body` writes landed under `imm` and `tail` under
        `tail_imm` when it succeeded: a call may carry both, X9a) or failed."""
        with self._lock:
            self._in_flight -= 1
            self.done_at = time.time()
            if error is None:
                self.writes_ok += body
                self.tail_writes_ok += tail
            else:
                self.writes_unknown = True
                self._fail(FailureCause.WRITE_FAILED, f"write failed: {error}")
            self._end_if_done()

    def all_posted(self) -> None:
        """Every write of the request has been posted (its context included)."""
        with self._lock:
            self._all_posted = True
            self._end_if_done()

    def stop(self, cause: FailureCause, reason: str) -> None:
        """Post nothing more; it ends when its last write in flight completes."""
        with self._lock:
            self._fail(cause, reason)
            self._all_posted = True
            self._end_if_done()

    @property
    def writes_posted(self) -> tuple[int, int]:
        """What the decoder may count on as this request's fence, under `imm` and `tail_imm`:
        -1 each when unknown."""
        return (-1, -1) if self.writes_unknown else (self.writes_ok, self.tail_writes_ok)

    def _fail(self, cause: FailureCause, reason: str) -> None:
        if self.error is None:
            self.error, self.cause = reason, cause

    def _end_if_done(self) -> None:
        if self._all_posted and self._in_flight == 0 and not self._ended:
            self._ended = True
            self.on_end(self)


@dataclass(frozen=True, slots=True)
class ChunkPages:
    """Pages of one request completed by one forward, written layer by layer: each layer's
    `writes` at that layer's offsets (`layer_writes`)."""

    outgoing: OutgoingKV
    src_page_ids: list[int]
    dst_page_ids: list[int]
    writes: list[LayerWrite]
    sum_span: TokenRange | None = None  # tokens whose checksum each layer adds (X8d)
    layer_sums: LayerSums | None = None  # their parts, layer by layer


def trace_outgoing(tracer: Tracer, t: OutgoingKV) -> None:
    """An ended request's spans: queued, prefilling, then the writes' tail (the TTFT split)."""
    ids = {"request_id": t.request_id, "decoder": t.peer.peer_id, "parent": t.traceparent}
    scheduled = t.first_scheduled_at or t.done_at
    last_layer = t.last_layer_at or t.done_at
    tracer.complete("queue", t.received_at, scheduled, **ids)
    tracer.complete("prefill", scheduled, last_layer, **ids)
    tracer.complete("transfer_tail", last_layer, t.done_at, error=t.error, **ids)
