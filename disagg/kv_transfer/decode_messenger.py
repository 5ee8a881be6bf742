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
With prefix caching (X2b) the request first takes the pages of its longest cached prefix; the
prefiller is asked only for the rest, or not at all when all but the last token is here.

Failures (issue 8): a request whose KV misses its deadline is cancelled at the prefiller and
retried once; a client abort cancels it; a dead prefiller's requests are retried elsewhere or
failed. Abandoned pages go to the `PageQuarantine` until no write can still land in them.
Every request leaves through exactly one of: released to the engine (`RUNNING`), retried
(`WAITING_FOR_KV` again), failed or aborted; each comes back from `poll` as an `Outcome` in
`RequestState` terms, with a `FailureCause` where one applies. The node's builder wires it
once: `wake` rings the node's inbox, and a speculating decoder passes its draft-KV sink in.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable

from disagg.config import ReliabilityConfig
from disagg.control.channel import Channel
from disagg.engine.llm_engine import EngineParts
from disagg.engine.request import FailureCause, Request, RequestState
from disagg.errors import PeerClosedError
from disagg.kv_transfer.context_slot import (
    allocate_context_buffer,
    clear_proof,
    context_slot_nbytes,
    new_nonce,
    slot_matches,
)
from disagg.kv_transfer.kv_checksum import agreed_kv_checksum
from disagg.kv_transfer.messages import Cancel, Hello, HelloAck, KVFailed, KVRequest
from disagg.kv_transfer.plugins import DraftSink
from disagg.kv_transfer.quarantine import PageQuarantine, Verdict
from disagg.kv_transfer.transfer_context import KVReceipt, Outcome, PendingKV
from disagg.kv_transfer.transfer_plan import (
    PageGeometry,
    expected_write_count,
    num_pages,
    rank_descriptors,
    writes_per_page,
)
from disagg.model.sharding import Sharding
from transfer_core.engine import TransferEngine
from transfer_core.imm_counter import random_imm
from transfer_core.staging import register_kv

logger = logging.getLogger(__name__)
ABORTED = Verdict(RequestState.FINISHED_ABORTED, FailureCause.ABORTED, "aborted by the client")


class DecodeMessenger:
    """Gets KV for new requests from prefillers and releases them to the engine."""

    def __init__(self, parts: EngineParts, transfer: TransferEngine, node_id: str,
                 model_fingerprint: str, *, wake: Callable[[], None],
                 draft_sink: DraftSink | None = None, num_context_slots: int = 16,
                 reliability: ReliabilityConfig | None = None,
                 kv_memory_path: str | None = None,
                 rank_domains: list[tuple[int, ...]] | None = None) -> None:
        self._parts = parts
        self._rank_domains = rank_domains  # rank r's KV is written through these (S5b, S6a)
        self.reliability = reliability or ReliabilityConfig()
        self.quarantine = PageQuarantine(transfer, parts.allocator,
                                         self.reliability.quarantine_timeout_s)
        self.transfer = transfer
        self.node_id = node_id
        self.model_fingerprint = model_fingerprint
        config = parts.model.config
        # One region per TP rank: prefillers write each rank's heads into it (S5a), or into its
        # host shadow when staged (the path defaults to the transfer engine's `memory_path`).
        self.kv = [register_kv(transfer, shard.buffer, f"decode-kv{rank}", kv_memory_path)
                   for rank, shard in enumerate(parts.kv_cache.shards)]
        self.context = allocate_context_buffer(config, num_context_slots)
        self._context_region, self._context_descriptor = transfer.register_memory(
            self.context, name="decode-ctx", remote_write=True)
        self.draft_kv = draft_sink  # the MTP head's cache, when this decoder drafts with one
        self._free_slots = list(range(num_context_slots - 1))  # the last proves (`read_proof`)
        self.prefillers: list[Channel] = []
        self.alive: list[bool] = []
        self._page_writes: list[int] = []  # writes per page per layer, per prefiller
        self._load: list[int] = []  # requests in flight per prefiller
        self.waiting: deque[Request] = deque()  # no pages (or no context slot) yet
        self.pending: dict[str, PendingKV] = {}
        self._ready: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._outcomes: list[Outcome] = []  # decided outside poll(), reported by the next one
        self._wake = wake  # the node's "something happened" bell

    def hello(self) -> Hello:
        """This decoder's handshake: model, cache geometry, fabric address, descriptors."""
        config, cache = self._parts.model.config, self._parts.kv_cache
        clear_proof(self.context)  # the prefiller's answer to this Hello lands there (S5)
        return Hello(
            node_id=self.node_id, model=self.model_fingerprint,
            dtype=str(cache.dtype).removeprefix("torch."), page_size=cache.page_size,
            kv_layout=cache.kv_layout, num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
            engine_address=self.transfer.address,
            kv_descriptors=[d.to_bytes() for d in rank_descriptors(
                [kv.descriptor for kv in self.kv], self._rank_domains)],
            context_descriptor=self._context_descriptor.to_bytes(),
            context_slot_nbytes=context_slot_nbytes(config), tp=cache.sharding.tp,
            replicated_kv=cache.sharding.replicated,
            draft_kv_descriptor=self.draft_kv.descriptor if self.draft_kv else b"",
            kv_memory_path=self.kv[0].path.kind)

    def add_prefiller(self, channel: Channel, ack: HelloAck, index: int | None = None) -> int:
        """Use a prefiller whose handshake succeeded; returns its index. With `index`, that
        prefiller is back (a new handshake after it was lost, whose requests were all
        quarantined then): it takes requests again."""
        cache = self._parts.kv_cache
        theirs = Sharding(ack.tp, cache.num_kv_heads, ack.replicated_kv)
        # The prefiller plans with the same function: both sides agree on the count (S6b).
        page_writes = writes_per_page(theirs, cache.sharding, PageGeometry.of(cache))
        if index is None:  # a new one: each list grows by one
            for items in (self.prefillers, self._page_writes, self.alive, self._load):
                items.append(None)
            index = len(self.prefillers) - 1
        elif self.alive[index]:
            raise ValueError(f"prefiller {index} is still in use")
        self.prefillers[index], self._page_writes[index] = channel, page_writes
        self.alive[index], self._load[index] = True, 0
        return index

    def submit(self, request: Request) -> None:
        """A new request (S2a): start its transfer now, or queue it until pages free up.

        Raises `RequestError` at once for a request that could never fit this node's cache.
        """
        self._parts.scheduler.check_fits(request)
        if not self.prefillers:
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
            held = scheduler.take_cached_prefix(request)
            if held >= request.num_prompt_tokens - 1:
                # Nothing to prefill (a one-token prompt, or all but the last token cached): the
                # last token is an ordinary step here (S8).
                self.waiting.popleft()
                scheduler.release_cached_prefix(request)
                scheduler.add_request(request)
                continue
            needed = num_pages(request.num_prompt_tokens, self._page_size) - len(request.page_ids)
            if not allocator.can_allocate(needed) or not self._free_slots:
                scheduler.release_cached_prefix(request)  # hold nothing while waiting
                return
            self.waiting.popleft()
            scheduler.record_lookup(request)
            request.page_ids += allocator.allocate(needed, pinned=True)
            self._request_kv(request)

    def _request_kv(self, request: Request) -> None:
        config, page_size = self._parts.model.config, self._parts.kv_cache.page_size
        live = [i for i, alive in enumerate(self.alive) if alive]
        if not live:
            # Nothing was asked of anyone, so no write can land: the pages go back at once.
            self._parts.allocator.unpin(request.page_ids[self._held_pages(request):])
            self._parts.allocator.free(request.page_ids)
            request.page_ids, request.page_digests = [], []
            self._outcomes.append(self._drop(request, Verdict(
                RequestState.FINISHED_FAILED, FailureCause.NO_PREFILLER, "no prefiller is alive")))
            return
        imm = random_imm(lambda v: v in self.quarantine or self.transfer.imm_counted(v) > 0
                         or any(p.imm == v for p in self.pending.values()))
        slot, nonce = self._free_slots.pop(), new_nonce()
        index = min(live, key=self._load.__getitem__)
        expected = expected_write_count(request.num_prompt_tokens, page_size, config.num_layers,
                                        self._page_writes[index], request.num_cached_tokens)
        if self.draft_kv is not None:
            expected += self.draft_kv.expected_writes(request.num_prompt_tokens)
        now = time.monotonic()
        self.pending[request.request_id] = PendingKV(
            request, imm, slot, expected, index, now, now + self.reliability.kv_timeout_s,
            nonce=nonce)
        self._load[index] += 1
        # Arm the counter before asking: writes may land before this line would otherwise run.
        self.transfer.expect_imm_count(imm, expected, lambda: self._on_ready(request.request_id))
        message = KVRequest(request.request_id, imm, request.prompt_token_ids,
                            request.page_ids, slot, request.num_cached_tokens,
                            request.kv_attempts, nonce)
        try:
            self.prefillers[index].send(message)
        except PeerClosedError:
            self.prefiller_gone(index, "unreachable")

    def _on_ready(self, request_id: str) -> None:
        """Transfer-engine thread: a counter fired; the engine thread takes it from here."""
        self._ready.put(request_id)
        self._wake()

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
                self._quarantine(pending, None, self._retry_or_fail(
                    pending.request, FailureCause.CHECKSUM, "KV checksum mismatch"),
                    self.reliability.quarantine_timeout_s)
                continue
            if self.draft_kv is not None:
                self.draft_kv.keep_context(pending.request, self.context[pending.context_slot])
            self._forget(pending)
            self._release(pending.request)
            outcomes.append(Outcome(pending.request, RequestState.RUNNING,
                                    receipt=self._receipt(pending)))
        self._check_deadlines()
        for entry in self.quarantine.release_due():
            outcomes.append(self._after_quarantine(entry.request, entry.verdict))
        outcomes += self._outcomes
        self._outcomes = []
        self._start_waiting()
        return outcomes

    @property
    def _page_size(self) -> int:
        return self._parts.kv_cache.page_size

    def _held_pages(self, request: Request) -> int:
        """Leading pages found in this node's prefix cache: never written by a prefiller."""
        return request.num_cached_tokens // self._page_size

    def _stage_in(self, request: Request) -> None:
        # Only the written pages: a held page's shadow is stale (its KV may be computed here).
        pages = num_pages(request.num_prompt_tokens - 1, self._page_size)
        for kv in self.kv:
            kv.stage_in(request.page_ids[self._held_pages(request):pages])
        if self.draft_kv is not None:
            self.draft_kv.stage_in(request)

    def _checksum_matches(self, pending: PendingKV) -> bool:
        request = pending.request
        got = agreed_kv_checksum(self._parts.kv_cache, request.page_ids,
                                 request.num_prompt_tokens - 1, self._held_pages(request))
        if self.draft_kv is not None:
            got += self.draft_kv.checksum(request)
        return slot_matches(self.context[pending.context_slot], self._parts.model.config,
                            pending.nonce, got, request.request_id)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for pending in list(self.pending.values()):
            if pending.cancel is None and now >= pending.deadline:
                self._cancel(pending, self._retry_or_fail(
                    pending.request, FailureCause.DEADLINE,
                    f"KV did not arrive within {self.reliability.kv_timeout_s:g} s"))
            elif pending.cancel is not None and now >= pending.cancel_deadline:
                # The prefiller never answered the cancel: hold the pages for a last grace.
                self._quarantine(pending, None, pending.cancel,
                                 grace_s=self.reliability.quarantine_timeout_s)

    def _retry_or_fail(self, request: Request, cause: FailureCause, detail: str,
                       retry: bool = True) -> Verdict:
        """Retry while attempts remain (and `retry` allows it), else fail."""
        if retry and request.kv_attempts < self.reliability.max_attempts:
            return Verdict(RequestState.WAITING_FOR_KV, cause, detail)
        return Verdict(RequestState.FINISHED_FAILED, cause, detail)

    def _cancel(self, pending: PendingKV, verdict: Verdict) -> None:
        """Ask the prefiller to stop; its KVFailed answer carries the fence."""
        pending.cancel = verdict
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
        # A write that failed at the fabric (e.g. a connection a forged Hello got dropped) is
        # worth another try; a prefiller's refusal or lease is not.
        verdict = pending.cancel or self._retry_or_fail(
            pending.request, message.cause, f"prefiller: {message.reason}",
            retry=message.cause is FailureCause.WRITE_FAILED)
        posted = message.writes_posted if message.writes_posted >= 0 else None
        self._quarantine(pending, posted, verdict, grace_s=self.reliability.quarantine_timeout_s)

    def prefiller_gone(self, index: int, reason: str) -> None:
        """A prefiller died or stopped answering: hold its requests' pages for a grace period,
        then retry them on another prefiller or fail them."""
        if not self.alive[index]:
            return
        self.alive[index] = False
        logger.error("prefiller %d is gone (%s)", index, reason)
        can_retry = self.reliability.retry_on_prefiller_failure and any(self.alive)
        for pending in [p for p in self.pending.values() if p.prefiller == index]:
            verdict = pending.cancel or self._retry_or_fail(
                pending.request, FailureCause.PREFILLER_DIED, f"prefiller died: {reason}",
                retry=can_retry)
            if verdict.then is RequestState.WAITING_FOR_KV and not any(self.alive):
                verdict = Verdict(RequestState.FINISHED_FAILED, verdict.cause, verdict.detail)
            self._quarantine(pending, None, verdict, grace_s=self.reliability.death_grace_s)

    def abort(self, request_id: str) -> bool:
        """A client abort of a request still waiting for KV; False if it is not here."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self._outcomes.append(self._drop(request, ABORTED))
                return True
        pending = self.pending.get(request_id)
        if pending is None:
            return False
        if pending.cancel is None:
            self._cancel(pending, ABORTED)
        else:
            pending.cancel = ABORTED
        return True

    def _quarantine(self, pending: PendingKV, writes_posted: int | None, verdict: Verdict,
                    grace_s: float) -> None:
        self._forget(pending)
        self.quarantine.hold(pending.request, pending.imm, writes_posted, verdict, grace_s,
                             expected_writes=pending.expected_writes)

    def _forget(self, pending: PendingKV) -> None:
        del self.pending[pending.request.request_id]
        self._load[pending.prefiller] -= 1
        self._free_slots.append(pending.context_slot)

    def _after_quarantine(self, request: Request, verdict: Verdict) -> Outcome:
        if verdict.then is RequestState.WAITING_FOR_KV:
            logger.warning("retrying %s: %s", request.request_id, verdict.detail)
            request.kv_attempts += 1
            self.waiting.appendleft(request)
            return Outcome(request, verdict.then, verdict.cause, verdict.detail)
        return self._drop(request, verdict)

    def _drop(self, request: Request, verdict: Verdict) -> Outcome:
        request.state = verdict.then
        if verdict.then is RequestState.FINISHED_FAILED:
            logger.warning("request %s failed: %s", request.request_id, verdict.detail)
        return Outcome(request, verdict.then, verdict.cause, verdict.detail)

    def _receipt(self, pending: PendingKV) -> KVReceipt:
        cache, model = self._parts.kv_cache, self._parts.model.config
        request = pending.request
        pages = num_pages(request.num_prompt_tokens - 1, cache.page_size) - self._held_pages(
            request)
        kv_nbytes = sum(shard.page_nbytes for shard in cache.shards)
        nbytes = pages * model.num_layers * kv_nbytes + context_slot_nbytes(model)
        wait_ms = (time.monotonic() - pending.started_at) * 1e3
        return KVReceipt(pending.expected_writes, nbytes, wait_ms)

    def _release(self, request: Request) -> None:
        self._parts.allocator.unpin(request.page_ids[self._held_pages(request):])
        request.num_computed_tokens = request.num_prompt_tokens - 1
        self._parts.scheduler.add_prefilled(request)

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
        if self.draft_kv is not None:
            self.draft_kv.close()
