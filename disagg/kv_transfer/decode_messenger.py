"""The decoder's KV messenger: pages reserved, request sent, counters armed, then decode (S2a,
S2c, S4c).

A request arrives at the decoder (`admit`). The messenger pins pages for its whole prompt, arms
two immediate counters, one for the body (pages x every layer but the last x writes per page)
and one for the tail (the last layer's writes, a draft head's and the context write), and asks a
prefiller to fill them. Until both fire the request stays out of the decode schedule. When the
body's fires, the messenger sums it while the last layer is still computed on the prefiller
(X8d); when the tail's has fired too, it checks the KV (checksum and nonce, S5), unpins the
pages, gives back the context slot and hands the request to the engine with every prompt token
but the last already computed; the engine's next step runs the last prompt token as an ordinary
decode step (S8). No message says "done": the writes' immediates do. KV memory the NIC cannot
reach is staged (S5): writes land in a host shadow, copied into the cache when their counter
fires, before the checksum. With prefix caching (X2b) the request first takes the pages of its
longest cached prefix; the prefiller is asked only for the rest, or not at all.

Collaborators, wired once by the node's builder: the `PrefillerPool` (liveness, choice,
reconnection), the `PendingTable` of `PendingKV` records, `KVRecovery` (deadlines, cancels,
quarantine, retries: every request that does not complete leaves through it), the landing
slots, and a speculating decoder's draft-KV sink. `poll` reports what became of each request
as an `Outcome`; `wake` rings the node's inbox.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable

import torch

from disagg.config import ReliabilityConfig
from disagg.control.channel import Channel
from disagg.engine.llm_engine import EngineParts
from disagg.engine.request import FailureCause, Request, RequestState
from disagg.kv_transfer.context_slot import LandingSlots, new_nonce
from disagg.kv_transfer.handshake import decoder_hello
from disagg.kv_transfer.kv_arrival import KVArrival
from disagg.kv_transfer.kv_recovery import ABORTED, KVRecovery, dropped
from disagg.kv_transfer.messages import Hello, HelloAck, KVFailed, KVRequest
from disagg.kv_transfer.pending_kv import Outcome, PendingKV, PendingTable
from disagg.kv_transfer.plugins import DraftSink
from disagg.kv_transfer.prefiller_pool import PrefillerPool
from disagg.kv_transfer.quarantine import PageQuarantine, Verdict
from disagg.kv_transfer.transfer_plan import expected_writes, num_pages, rank_descriptors
from disagg.model.page_geometry import PageGeometry
from transfer_core.imm_counter import random_imm
from transfer_core.staging import register_kv
from transfer_core.transport import Transport


class DecodeMessenger:
    """Gets KV for new requests from prefillers and releases them to the engine."""

    def __init__(self, parts: EngineParts, transport: Transport, node_id: str,
                 model_fingerprint: str, *, wake: Callable[[], None],
                 draft_sink: DraftSink | None = None, num_context_slots: int = 16,
                 reliability: ReliabilityConfig | None = None,
                 kv_memory_path: str | None = None,
                 rank_domains: list[tuple[int, ...]] | None = None) -> None:
        self._parts = parts
        self.transport = transport
        self._rank_domains = rank_domains  # rank r's KV is written through these (S5b, S6a)
        self.node_id = node_id
        self.model_fingerprint = model_fingerprint
        cache = parts.kv_cache
        # One region per TP rank: prefillers write each rank's heads into it (S5a), or into its
        # host shadow when staged (the path defaults to the transfer engine's `memory_path`).
        self.kv = [register_kv(transport, shard.buffer, f"decode-kv{rank}", kv_memory_path)
                   for rank, shard in enumerate(cache.shards)]
        self.slots = LandingSlots(transport, parts.model.config, num_context_slots)
        self.draft_kv = draft_sink  # the MTP head's cache, when this decoder drafts with one
        self.pool = PrefillerPool(cache.sharding, PageGeometry.of(cache))
        self.pending = PendingTable(self.pool, self.slots)
        reliability = reliability or ReliabilityConfig()
        self.arrival = KVArrival(parts, self.kv, self.slots, draft_sink, reliability.verify_kv)
        self.recovery = KVRecovery(transport, parts.allocator, self.pending, self.pool,
                                   reliability)
        self.waiting: deque[Request] = deque()  # no pages (or no context slot) yet
        # (request id, immediate value) of each counter that fired, for the engine thread.
        self._landed: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._outcomes: list[Outcome] = []  # decided outside poll(), reported by the next one
        self._wake = wake  # the node's "something happened" bell

    @property
    def context(self) -> torch.Tensor:
        """The registered context buffer ``[num_slots, slot_numel]`` (the last: the proof)."""
        return self.slots.buffer

    @property
    def quarantine(self) -> PageQuarantine:
        """Pages of abandoned requests, held until no write can land in them."""
        return self.recovery.quarantine

    def hello(self) -> Hello:
        """This decoder's handshake: model, cache geometry, fabric address, descriptors."""
        return decoder_hello(
            self.node_id, self.model_fingerprint, self._parts.model.config,
            self._parts.kv_cache, self.transport.address,
            rank_descriptors([kv.descriptor for kv in self.kv], self._rank_domains),
            self.slots.descriptor, self.draft_kv.descriptor if self.draft_kv else b"",
            self.kv[0].path.kind)

    def add_prefiller(self, channel: Channel, ack: HelloAck, index: int | None = None) -> int:
        """Use a prefiller whose handshake succeeded (`index`: one that is back)."""
        return self.pool.add(channel, ack, index)

    def admit(self, request: Request) -> None:
        """A new request (S2a): ask for its KV now, or queue it until pages free up.

        Raises `RequestError` at once for a request that could never fit this node's cache.
        """
        self._parts.scheduler.check_fits(request)
        if not len(self.pool):
            self._parts.scheduler.add_request(request)  # single node: prefill it here (S1)
            return
        request.state = RequestState.WAITING_FOR_KV
        self.waiting.append(request)
        self._start_waiting()

    def _start_waiting(self) -> None:
        allocator, scheduler = self._parts.allocator, self._parts.scheduler
        while self.waiting:
            request = self.waiting[0]
            # Pages of the longest cached prefix first: their KV is here, nobody writes them.
            held = scheduler.prefix.take(request)
            if held >= request.num_prompt_tokens - 1:
                # Nothing to prefill (a one-token prompt, or all but the last token cached): the
                # last token is an ordinary step here (S8).
                self.waiting.popleft()
                scheduler.prefix.release(request)
                scheduler.add_request(request)
                continue
            needed = (num_pages(request.num_prompt_tokens, self._parts.kv_cache.page_size)
                      - len(request.page_ids))
            if not allocator.can_allocate(needed) or not self.slots:
                scheduler.prefix.release(request)  # hold nothing while waiting
                return
            self.waiting.popleft()
            scheduler.prefix.record_lookup(request)
            request.page_ids += allocator.allocate(needed, pinned=True)
            self._ask_for_kv(request)

    def _ask_for_kv(self, request: Request) -> None:
        index = self.pool.choose()
        if index is None:
            # Nothing was asked of anyone, so no write can land: the pages go back at once.
            self._parts.allocator.unpin(request.page_ids[self.arrival.held_pages(request):])
            self._parts.allocator.free(request.page_ids)
            request.page_ids, request.page_digests = [], []
            self._outcomes.append(dropped(request, Verdict(
                RequestState.FINISHED_FAILED, FailureCause.NO_PREFILLER, "no prefiller is alive")))
            return
        imm = random_imm(self._imm_in_use)
        tail_imm = random_imm(lambda v: v == imm or self._imm_in_use(v))
        expected = expected_writes(
            request.num_prompt_tokens, self._parts.kv_cache.page_size,
            self._parts.model.config.num_layers, self.pool.link(index).writes_per_page,
            request.num_cached_tokens)
        if self.draft_kv is not None:
            expected = expected.plus_tail(self.draft_kv.expected_writes(request.num_prompt_tokens))
        now = time.monotonic()
        pending = PendingKV(request, imm, tail_imm, self.slots.take(), expected, index,
                            new_nonce(), now, now + self.recovery.reliability.kv_timeout_s)
        self.pending.add(pending)
        self.pool.take(index)
        # Arm the counters before asking: writes may land before this line would otherwise run.
        rid = request.request_id
        if expected.body:
            self.transport.expect_imm_count(imm, expected.body, lambda: self._on_landed(rid, imm))
        else:  # one layer: all of it is the tail
            self.arrival.body_landed(pending)
        self.transport.expect_imm_count(tail_imm, expected.tail,
                                        lambda: self._on_landed(rid, tail_imm))
        message = KVRequest(request.request_id, imm, tail_imm, request.prompt_token_ids,
                            request.page_ids, pending.context_slot, request.num_cached_tokens,
                            request.kv_attempts, pending.nonce, request.traceparent)
        if not self.pool.send(index, message):
            self.recovery.prefiller_gone(index, "unreachable")

    def _imm_in_use(self, value: int) -> bool:
        """Whether a request may still count `value`: held, waiting or with arrivals."""
        return (value in self.quarantine or self.transport.imm_counted(value) > 0
                or self.pending.uses_imm(value))

    def _on_landed(self, request_id: str, imm: int) -> None:
        """Transfer-engine thread: a counter fired; the engine thread takes it from here."""
        self._landed.put((request_id, imm))
        self._wake()

    def poll(self) -> list[Outcome]:
        """Sum the bodies that landed, release requests whose tail landed too to the engine
        (S2c), enforce deadlines, carry out the verdicts of quarantined requests. Returns what
        happened."""
        outcomes, self._outcomes = self._outcomes, []
        while True:
            try:
                request_id, imm = self._landed.get_nowait()
            except queue.Empty:
                break
            pending = self.pending.get(request_id)
            if pending is None or pending.cancel is not None or imm not in pending.imms:
                continue  # abandoned meanwhile (the quarantine's fence takes it), or retried
            if imm == pending.imm:
                self.arrival.body_landed(pending)  # while its last layer is computed (X8d)
                # The last layer is one layer's compute away: a napping receiver (shm) naps
                # briefly until it lands (nothing to do if it landed first).
                self.transport.expect_soon(pending.tail_imm)
            else:
                pending.tail_landed = True
            if not pending.landed:
                continue
            if not self.arrival.verified(pending):
                self.recovery.reject(pending, FailureCause.CHECKSUM, "KV checksum mismatch")
                continue
            receipt = self.arrival.release(pending)
            self.pending.forget(pending)
            outcomes.append(Outcome(pending.request, RequestState.RUNNING, receipt=receipt))
        self.recovery.check_deadlines()
        for outcome in self.recovery.released():
            if outcome.state is RequestState.WAITING_FOR_KV:
                self.waiting.appendleft(outcome.request)
            outcomes.append(outcome)
        outcomes += self._outcomes
        self._outcomes = []
        self._start_waiting()
        return outcomes

    def on_kv_failed(self, message: KVFailed) -> None:
        """A prefiller's `KVFailed` (S4b): the recovery settles the request."""
        self.recovery.on_kv_failed(message)

    def prefiller_gone(self, index: int, reason: str) -> None:
        """A prefiller died or stopped answering (its requests are settled by the recovery)."""
        self.recovery.prefiller_gone(index, reason)

    def abort(self, request_id: str) -> bool:
        """A client abort of a request still waiting for KV; False if it is not here."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self._outcomes.append(dropped(request, ABORTED))
                return True
        pending = self.pending.get(request_id)
        if pending is None:
            return False
        self.recovery.abort(pending)
        return True

    def received_writes(self, request_id: str) -> tuple[int, int]:
        """(writes landed, writes expected) of a pending request, for progress displays."""
        pending = self.pending.get(request_id)
        if pending is None:
            return 0, 0
        parts = ((pending.imm, pending.expected.body, pending.body_landed),
                 (pending.tail_imm, pending.expected.tail, pending.tail_landed))
        counted = sum(armed if landed else self.transport.imm_counted(imm)
                      for imm, armed, landed in parts)
        return counted, pending.expected_writes

    def idle(self) -> bool:
        """Nothing waiting, in flight or quarantined."""
        return not (self.waiting or len(self.pending) or len(self.quarantine) or self._outcomes)

    def close(self) -> None:
        """Unregister memory (after the transfer engine drained)."""
        for kv in self.kv:
            kv.close(self.transport)
        self.slots.close()
        if self.draft_kv is not None:
            self.draft_kv.close()
