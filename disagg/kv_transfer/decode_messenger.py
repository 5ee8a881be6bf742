"""The decoder's KV messenger: pages reserved, request sent, counter armed, then decode (S2a,
S2c, S4c).

A request arrives at the decoder. The messenger pins pages for its whole prompt, arms an
immediate counter expecting pages x layers + 1 context writes, and asks a prefiller to fill
them. Until the counter fires the request stays out of the decode schedule. When it fires, the
messenger unpins the pages, frees the transfer context and hands the request to the engine
with every prompt token but the last already computed; the engine's next step runs the last
prompt token as an ordinary decode step (S8). No message says "done": the writes' immediates do.
KV memory the NIC cannot reach is staged (S5): writes land in a host shadow, copied into the
cache when the counter fires, before the checksum and the release (`transfer_core.staging`).

Failures (issue 8): a request whose KV misses its deadline is cancelled at the prefiller and
retried once; a client abort cancels it; a dead prefiller's requests are retried elsewhere or
failed. Abandoned pages go to the `PageQuarantine` until no write can still land in them.
Every request leaves through exactly one of: released to the engine, retried, failed, aborted.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from disagg.engine.llm_engine import LLMEngine
from disagg.engine.request import Request, RequestStatus
from disagg.errors import PeerClosedError
from disagg.kv_transfer.channel import Channel
from disagg.kv_transfer.context_slot import (
    allocate_context_buffer,
    context_checksum,
    context_slot_nbytes,
    kv_checksum,
    unpack_context,
)
from disagg.kv_transfer.draft_kv import DraftKVSink
from disagg.kv_transfer.messages import Cancel, Hello, HelloAck, KVFailed, KVRequest
from disagg.kv_transfer.quarantine import PageQuarantine
from disagg.kv_transfer.transfer_plan import (
    PageGeometry,
    expected_write_count,
    num_pages,
    writes_per_page,
)
from disagg.model.sharding import Sharding
from transfer_core.engine import TransferEngine
from transfer_core.staging import register_kv

logger = logging.getLogger(__name__)


@dataclass
class PendingKV:
    """A request waiting for its KV: the decoder-side transfer context."""

    request: Request
    imm: int
    context_slot: int
    expected_writes: int
    prefiller: int  # index into the messenger's prefiller list
    started_at: float = 0.0  # time.monotonic() when the prefiller was asked
    deadline: float = float("inf")  # time.monotonic() by which the KV must have arrived
    cancel: tuple[str, str] | None = None  # (then, reason) once a Cancel was sent
    cancel_deadline: float = float("inf")  # by when the prefiller must have answered it


@dataclass(frozen=True, slots=True)
class ReliabilityConfig:
    """Deadlines and retry policy of the decoder side."""

    kv_timeout_s: float = 120.0  # from asking a prefiller to the counter firing
    quarantine_timeout_s: float = 10.0  # longest wait for a fence or a cancel answer
    death_grace_s: float = 1.0  # pages of a dead prefiller's requests are held this long
    max_attempts: int = 2  # a timed-out or orphaned request is retried this many times in all
    retry_on_prefiller_failure: bool = True
    verify_kv: bool = True  # compare a checksum of the received KV with the prefiller's


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to a request this poll: released (with its receipt), retried, failed or
    aborted."""

    request: Request
    kind: str  # "released", "retry", "failed", "aborted"
    detail: str = ""
    receipt: KVReceipt | None = None


@dataclass(frozen=True, slots=True)
class KVReceipt:
    """What one request's KV transfer took, as the decoder saw it."""

    writes: int
    nbytes: int
    wait_ms: float  # from asking the prefiller to the counter firing (prefill included)


class DecodeMessenger:
    """Gets KV for new requests from prefillers and releases them to the engine."""

    def __init__(self, engine: LLMEngine, transfer: TransferEngine, node_id: str,
                 model_fingerprint: str, num_context_slots: int = 16,
                 reliability: ReliabilityConfig | None = None,
                 kv_memory_path: str | None = None) -> None:
        self.engine = engine
        self.reliability = reliability or ReliabilityConfig()
        self.quarantine = PageQuarantine(transfer, engine.allocator,
                                         self.reliability.quarantine_timeout_s)
        self.transfer = transfer
        self.node_id = node_id
        self.model_fingerprint = model_fingerprint
        config = engine.model.config
        # One region per TP rank: prefillers write each rank's heads into it (S5a), or into its
        # host shadow when staged (the path defaults to the transfer engine's `memory_path`).
        self.kv = [register_kv(transfer, shard.buffer, f"decode-kv{rank}", kv_memory_path)
                   for rank, shard in enumerate(engine.kv_cache.shards)]
        self.context = allocate_context_buffer(config, num_context_slots)
        self._context_region, self._context_descriptor = transfer.register_memory(
            self.context, name="decode-ctx")
        self.draft_kv = DraftKVSink(engine, transfer, kv_memory_path)  # MTP cache (issue 6)
        self._free_slots = list(range(num_context_slots))
        self._imms = itertools.count(1)
        self.prefillers: list[Channel] = []
        self.alive: list[bool] = []
        self._page_writes: list[int] = []  # writes per page per layer, per prefiller
        self._load: list[int] = []  # requests in flight per prefiller
        self.waiting: deque[Request] = deque()  # no pages (or no context slot) yet
        self.pending: dict[str, PendingKV] = {}
        self._ready: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._outcomes: list[Outcome] = []  # decided outside poll(), reported by the next one
        self.wake: Callable[[], None] = lambda: None  # the node's "something happened" bell

    def hello(self) -> Hello:
        """This decoder's handshake: model, cache geometry, fabric address, descriptors."""
        config, cache = self.engine.model.config, self.engine.kv_cache
        return Hello(
            node_id=self.node_id, model=self.model_fingerprint,
            dtype=str(cache.dtype).removeprefix("torch."), page_size=cache.page_size,
            kv_layout=cache.kv_layout, num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
            engine_address=self.transfer.address,
            kv_descriptors=[kv.descriptor.to_bytes() for kv in self.kv],
            context_descriptor=self._context_descriptor.to_bytes(),
            context_slot_nbytes=context_slot_nbytes(config), tp=cache.sharding.tp,
            replicated_kv=cache.sharding.replicated, draft_kv_descriptor=self.draft_kv.descriptor,
            kv_memory_path=self.kv[0].path.kind)

    def add_prefiller(self, channel: Channel, ack: HelloAck) -> int:
        """Use a prefiller whose handshake succeeded; returns its index."""
        cache = self.engine.kv_cache
        theirs = Sharding(ack.tp, cache.num_kv_heads, ack.replicated_kv)
        geometry = PageGeometry(cache.kv_layout, cache.page_size, cache.head_dim,
                                cache.shards[0].element_size)
        # The prefiller plans with the same function: both sides agree on the count (S6b).
        self._page_writes.append(writes_per_page(theirs, cache.sharding, geometry))
        self.prefillers.append(channel)
        self.alive.append(True)
        self._load.append(0)
        return len(self.prefillers) - 1

    def submit(self, request: Request) -> None:
        """A new request (S2a): start its transfer now, or queue it until pages free up.

        Raises `RequestError` at once for a request that could never fit this node's cache.
        """
        self.engine.scheduler.check_fits(request)
        if not self.prefillers:
            self.engine.scheduler.add_request(request)  # single node: prefill it here (S1)
            return
        request.status = RequestStatus.WAITING_FOR_KV
        self.waiting.append(request)
        self._start_waiting()

    def _start_waiting(self) -> None:
        allocator, page_size = self.engine.allocator, self.engine.kv_cache.page_size
        while self.waiting:
            request = self.waiting[0]
            if request.num_prompt_tokens == 1:
                # Nothing to prefill: the one token is an ordinary prefill step here.
                self.waiting.popleft()
                self.engine.scheduler.add_request(request)
                continue
            needed = num_pages(request.num_prompt_tokens, page_size)
            if not allocator.can_allocate(needed) or not self._free_slots:
                return
            self.waiting.popleft()
            request.page_ids = allocator.allocate(needed, pinned=True)
            self._request_kv(request)

    def _request_kv(self, request: Request) -> None:
        config, page_size = self.engine.model.config, self.engine.kv_cache.page_size
        live = [i for i, alive in enumerate(self.alive) if alive]
        if not live:
            self._outcomes.append(self._drop(request, "failed", "no prefiller is alive"))
            return
        imm = next(self._imms) % 2**32
        slot = self._free_slots.pop()
        index = min(live, key=self._load.__getitem__)
        expected = (expected_write_count(request.num_prompt_tokens, page_size, config.num_layers,
                                         self._page_writes[index])
                    + self.draft_kv.expected_writes(request.num_prompt_tokens))
        now = time.monotonic()
        self.pending[request.request_id] = PendingKV(
            request, imm, slot, expected, index, now, now + self.reliability.kv_timeout_s)
        self._load[index] += 1
        # Arm the counter before asking: writes may land before this line would otherwise run.
        self.transfer.expect_imm_count(imm, expected, lambda: self._on_ready(request.request_id))
        message = KVRequest(request.request_id, imm, request.prompt_token_ids,
                            request.page_ids, slot)
        try:
            self.prefillers[index].send(message)
        except PeerClosedError:
            self.prefiller_gone(index, "unreachable")

    def _on_ready(self, request_id: str) -> None:
        """Transfer-engine thread: a counter fired; the engine thread takes it from here."""
        self._ready.put(request_id)
        self.wake()

    def poll(self) -> list[Outcome]:
        """Release requests whose counter fired to the engine (S2c), enforce deadlines, free
        quarantined pages and retry or end their requests. Returns what happened."""
        outcomes, self._outcomes = self._outcomes, []
        while True:
            try:
                request_id = self._ready.get_nowait()
            except queue.Empty:
                break
            pending = self.pending.get(request_id)
            if pending is None or pending.cancel is not None:
                continue  # abandoned meanwhile: the quarantine fence takes it from here
            self._stage_in(pending.request)  # no-op unless staged; the checksum reads the cache
            if self.reliability.verify_kv and not self._checksum_matches(pending):
                # Fired early (a duplicated immediate) or over corrupted pages: writes may
                # still be landing, so hold the pages and ask again.
                retry = pending.request.kv_attempts < self.reliability.max_attempts
                self._quarantine(pending, None, "retry" if retry else "fail",
                                 "KV checksum mismatch", self.reliability.quarantine_timeout_s)
                continue
            self.draft_kv.keep_context(pending.request, self.context[pending.context_slot])
            self._forget(pending)
            self._release(pending.request)
            outcomes.append(Outcome(pending.request, "released", receipt=self._receipt(pending)))
        self._check_deadlines()
        for entry in self.quarantine.release_due():
            outcomes.append(self._after_quarantine(entry.request, entry.then, entry.reason))
        outcomes += self._outcomes
        self._outcomes = []
        self._start_waiting()
        return outcomes

    def _stage_in(self, request: Request) -> None:
        pages = num_pages(request.num_prompt_tokens - 1, self.engine.kv_cache.page_size)
        for kv in self.kv:
            kv.stage_in(request.page_ids[:pages])
        self.draft_kv.stage_in(request)

    def _checksum_matches(self, pending: PendingKV) -> bool:
        config = self.engine.model.config
        expected = context_checksum(self.context[pending.context_slot], config)
        request = pending.request
        got = (kv_checksum(self.engine.kv_cache, request.page_ids, request.num_prompt_tokens - 1)
               + self.draft_kv.checksum(request))
        if got != expected:
            logger.warning("request %s: KV checksum %r, prefiller sent %r", request.request_id,
                           got, expected)
        return got == expected

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for pending in list(self.pending.values()):
            if pending.cancel is None and now >= pending.deadline:
                retry = pending.request.kv_attempts < self.reliability.max_attempts
                self._cancel(pending, "retry" if retry else "fail",
                             f"KV did not arrive within {self.reliability.kv_timeout_s:g} s")
            elif pending.cancel is not None and now >= pending.cancel_deadline:
                # The prefiller never answered the cancel: hold the pages for a last grace.
                self._quarantine(pending, None, *pending.cancel,
                                 grace_s=self.reliability.quarantine_timeout_s)

    def _cancel(self, pending: PendingKV, then: str, reason: str) -> None:
        """Ask the prefiller to stop; its KVFailed answer carries the fence."""
        pending.cancel = (then, reason)
        pending.cancel_deadline = time.monotonic() + self.reliability.quarantine_timeout_s
        try:
            self.prefillers[pending.prefiller].send(Cancel(pending.request.request_id))
        except PeerClosedError:
            self.prefiller_gone(pending.prefiller, "unreachable")

    def on_kv_failed(self, message: KVFailed) -> None:
        """The prefiller gave up on (or was told to drop) a request; nothing of it is in flight
        there, and `writes_posted` of its writes were sent: that count is the fence."""
        pending = self.pending.get(message.request_id)
        if pending is None:
            return  # already handled (e.g. the counter fired first)
        then, reason = pending.cancel or ("fail", f"prefiller: {message.reason}")
        posted = message.writes_posted if message.writes_posted >= 0 else None
        self._quarantine(pending, posted, then, reason,
                         grace_s=self.reliability.quarantine_timeout_s)

    def prefiller_gone(self, index: int, reason: str) -> None:
        """A prefiller died or stopped answering: hold its requests' pages for a grace period,
        then retry them on another prefiller or fail them."""
        if not self.alive[index]:
            return
        self.alive[index] = False
        logger.error("prefiller %d is gone (%s)", index, reason)
        for pending in [p for p in self.pending.values() if p.prefiller == index]:
            retry = (self.reliability.retry_on_prefiller_failure and any(self.alive)
                     and pending.request.kv_attempts < self.reliability.max_attempts)
            then, why = pending.cancel or ("retry" if retry else "fail",
                                           f"prefiller died: {reason}")
            if then == "retry" and not any(self.alive):
                then = "fail"
            self._quarantine(pending, None, then, why, grace_s=self.reliability.death_grace_s)

    def abort(self, request_id: str) -> bool:
        """A client abort of a request still waiting for KV; False if it is not here."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self._outcomes.append(self._drop(request, "aborted", "aborted by the client"))
                return True
        pending = self.pending.get(request_id)
        if pending is None:
            return False
        if pending.cancel is None:
            self._cancel(pending, "abort", "aborted by the client")
        else:
            pending.cancel = ("abort", "aborted by the client")
        return True

    def _quarantine(self, pending: PendingKV, writes_posted: int | None, then: str,
                    reason: str, grace_s: float) -> None:
        self._forget(pending)
        self.quarantine.hold(pending.request, pending.imm, writes_posted, then, reason, grace_s)

    def _forget(self, pending: PendingKV) -> None:
        del self.pending[pending.request.request_id]
        self._load[pending.prefiller] -= 1
        self._free_slots.append(pending.context_slot)

    def _after_quarantine(self, request: Request, then: str, reason: str) -> Outcome:
        if then == "retry":
            logger.warning("retrying %s: %s", request.request_id, reason)
            request.kv_attempts += 1
            self.waiting.appendleft(request)
            return Outcome(request, "retry", reason)
        return self._drop(request, "aborted" if then == "abort" else "failed", reason)

    def _drop(self, request: Request, kind: str, reason: str) -> Outcome:
        request.status = (RequestStatus.FINISHED_ABORTED if kind == "aborted"
                          else RequestStatus.FINISHED_FAILED)
        if kind == "failed":
            logger.warning("request %s failed: %s", request.request_id, reason)
        return Outcome(request, kind, reason)

    def _receipt(self, pending: PendingKV) -> KVReceipt:
        cache, model = self.engine.kv_cache, self.engine.model.config
        pages = num_pages(pending.request.num_prompt_tokens - 1, cache.page_size)
        kv_nbytes = sum(shard.page_nbytes for shard in cache.shards)
        nbytes = pages * model.num_layers * kv_nbytes + context_slot_nbytes(model)
        wait_ms = (time.monotonic() - pending.started_at) * 1e3
        return KVReceipt(pending.expected_writes, nbytes, wait_ms)

    def _release(self, request: Request) -> None:
        self.engine.allocator.unpin(request.page_ids)
        request.num_computed_tokens = request.num_prompt_tokens - 1
        self.engine.scheduler.add_prefilled(request)

    def context_of(self, request_id: str) -> tuple | None:
        """The shipped (hidden state, logits) of a pending request, for tests and S4a users."""
        pending = self.pending.get(request_id)
        if pending is None:
            return None
        return unpack_context(self.context[pending.context_slot], self.engine.model.config)

    def received_writes(self, request_id: str) -> tuple[int, int]:
        """(writes landed, writes expected) of a pending request, for progress displays."""
        pending = self.pending.get(request_id)
        if pending is None:
            return 0, 0
        return self.transfer.imm_counted(pending.imm), pending.expected_writes

    def idle(self) -> bool:
        """Nothing waiting, in flight or quarantined."""
        return not (self.waiting or self.pending or len(self.quarantine) or self._outcomes)

    def close(self) -> None:
        """Unregister memory (after the transfer engine drained)."""
        for kv in self.kv:
            kv.close(self.transfer)
        self.transfer.unregister_memory(self._context_region)
        self.draft_kv.close()
