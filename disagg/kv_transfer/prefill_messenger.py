"""The prefiller's KV messenger: stream each layer's pages to the decoder as they are computed
(S2b, S3, S4a, S4b, S6a, S9a).

Before a batch runs the engine tells the messenger which chunks it holds (S3a); the messenger
plans, per request, the pages those chunks complete. The model bumps a layer counter after each
layer's attention output projection; a `CounterPoller` thread sees every bump and posts that
layer's page writes at once, while the forward moves on (S3b). After the request's last chunk
it writes the context slot (hidden state and logits, S4a), and when every write has completed
it frees the source pages and finishes the request (S4b). Pages the decoder holds already are
never written; pages found in this node's prefix cache go with the first chunk (X2b). Every
write carries the request's immediate value; the decoder counts them (S4c); each leaves through
its source rank's domains (`rank_domains`, S6a, S9a). KV memory the NIC cannot read is staged:
a layer's pages are copied to a host shadow just before they are posted (S5, `staging.py`).
Threads: the engine's (plans, context, frees), the poller's (staging, page writes), the transfer
engine's (completions, which only count). Wired once by the node's builder: the model bumps the
counter given here, the engine tells this `StepObserver` of every step, `wake` rings the node's
inbox; the draft-KV plug-in is built when a decoder first asks for it (`plugins.py`).
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from disagg.control.channel import Channel
from disagg.engine.batch import Batch, ForwardOutput
from disagg.engine.llm_engine import EngineParts
from disagg.engine.request import FailureCause, Request, RequestState, SamplingParams
from disagg.errors import PeerClosedError, RequestError
from disagg.kv_transfer.context_slot import (
    ContextSlots,
    pack_context,
    prefill_token_ids,
)
from disagg.kv_transfer.kv_checksum import kv_checksum
from disagg.kv_transfer.messages import Hello, HelloProof, KVFailed, KVRequest
from disagg.kv_transfer.plugins import DraftSource, DraftSourceFactory
from disagg.kv_transfer.transfer_context import (
    DecoderPeer,
    PlannedWrite,
    Transfer,
    check_kv_request,
    parse_peer,
    stage_out_layer,
    trace_transfer,
)
from disagg.kv_transfer.transfer_plan import (
    PageGeometry,
    pages_to_send,
    plan_request,
)
from disagg.model.layer_counter import LayerCounter
from disagg.utils.trace import Tracer
from transfer_core.engine import TransferEngine
from transfer_core.errors import TransferError
from transfer_core.poller import CounterPoller
from transfer_core.staging import register_kv
from transfer_core.transport import PagedWrite

logger = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 10.0  # warming a new decoder's fabric connection at handshake


class PrefillMessenger:
    """Follows the prefiller's forward passes and ships KV pages as layers finish."""

    def __init__(self, parts: EngineParts, transfer: TransferEngine, counter: LayerCounter, *,
                 wake: Callable[[], None], make_draft_source: DraftSourceFactory | None = None,
                 num_context_slots: int = 16, wait_timeout_s: float = 60.0,
                 tracer: Tracer | None = None, lease_s: float = 300.0,
                 kv_memory_path: str | None = None, rank_domains: list[tuple[int, ...]]
                 | None = None, poller_cpus: tuple[int, ...] | None = None) -> None:
        self._parts = parts
        self.lease_s = lease_s  # a transfer older than this is stopped (issue 8)
        self.tracer = tracer or Tracer()
        self.transfer = transfer
        self.kv_cache = parts.kv_cache
        self.num_layers = parts.model.config.num_layers
        self.wait_timeout_s = wait_timeout_s
        # One region per TP rank, as one process registering every GPU's KV (S5a), no peer may
        # write (S5); its path (host, hmem, staged) defaults to the engine's `memory_path`.
        self._kv = [register_kv(transfer, shard.buffer, f"prefill-kv{rank}", kv_memory_path,
                                remote_write=False)
                    for rank, shard in enumerate(self.kv_cache.shards)]
        self._rng = random.Random(0)
        self._rank_domains = rank_domains  # rank r's writes leave through these (S6a, S9a)
        self._slots = ContextSlots(transfer, parts.model.config, num_context_slots)
        self._lock = threading.Condition()
        self._transfers: dict[str, Transfer] = {}
        self._make_draft = make_draft_source
        self.draft: DraftSource | None = None  # built when a decoder first asks (issue 6)
        self._plans: dict[int, list[PlannedWrite]] = {}
        self._forwards_planned = 0
        self._handled_value = 0  # counter value whose writes have all been posted
        self._finished: queue.SimpleQueue[Transfer] = queue.SimpleQueue()
        self.recent: deque[Transfer] = deque(maxlen=64)  # ended transfers, for tests and tools
        self._wake = wake  # the node's "something happened" bell
        self.stats = {"pages": 0, "writes": 0, "bytes": 0, "requests": 0, "failed": 0,
                      "expired_leases": 0, "staged_bytes": 0}
        self._finished_writes: OrderedDict[str, int] = OrderedDict()  # ended: for a late Cancel
        # The model bumps this after each layer; the poller thread turns bumps into writes.
        self.counter = counter
        self._poller = CounterPoller([self.counter.poll_target], self._on_counter,
                                     name="layer-counter-poller", cpus=poller_cpus)
        self._poller.start()

    # Peers and requests (engine thread).

    def add_peer(self, hello: Hello, channel: Channel) -> DecoderPeer:
        """A decoder whose handshake was validated: parse its descriptors, open the fabric
        connection (warm, before its first request), write its proof (`accept_proof`, S5)."""
        peer = parse_peer(hello, channel, self.num_layers, PageGeometry.of(self.kv_cache),
                          self._slots.slot_nbytes)
        # tcp;ofi_rxm connects on the first write (25-80 ms); pay it now, not in a request's
        # first layer. A peer we cannot reach fails its handshake with a TransferError.
        self.transfer.connect(hello.engine_address, timeout_s=CONNECT_TIMEOUT_S)
        peer.proof = self._slots.write_proof(hello, peer.context)
        if hello.draft_kv_descriptor:
            self._draft_source()  # built before HelloAck; told of the peer once it proved
        logger.info("decoder %s: its KV memory path is %s; ours is %s", peer.peer_id,
                    peer.kv_memory_path or "unknown", self._kv[0].path.kind)
        return peer

    def accept_proof(self, peer: DecoderPeer, hello: Hello, proof: HelloProof) -> None:
        """The decoder's answer to HelloAck (S5): only now are its requests taken."""
        self._slots.check_proof(peer, proof)
        if hello.draft_kv_descriptor:
            self._draft_source().add_peer(hello, peer.num_pages)

    def _draft_source(self) -> DraftSource:
        """The draft-KV plug-in, built on the first decoder that asks for it."""
        with self._lock:
            if self.draft is None:
                if self._make_draft is None:
                    raise RequestError("this prefiller cannot ship draft KV")
                self.draft = self._make_draft()
            return self.draft

    @property
    def num_in_flight(self) -> int:
        """Requests being prefilled or transferred."""
        return len(self._transfers)

    def start_request(self, message: KVRequest, peer: DecoderPeer) -> None:
        """Validate a decoder's request and queue its prefill; raises `RequestError`."""
        key = f"{peer.peer_id}/{message.request_id}"
        prompt = message.prompt_token_ids
        if key in self._transfers:
            raise RequestError(f"request {message.request_id} is already in flight")
        check_kv_request(message, peer, self.kv_cache.page_size,
                         self._parts.model.config.vocab_size)
        request = Request(key, prefill_token_ids(prompt), SamplingParams(max_tokens=1))
        # An MTP head runs over every prefilled position, so its decoder's requests never
        # start from cached pages (they still leave theirs in the cache); nor does a retry,
        # whose first KV may have been wrong here.
        request.reuse_prefix = not peer.wants_draft_kv and message.attempt == 1
        self._parts.scheduler.add_request(request)
        held = message.num_cached_tokens // self.kv_cache.page_size
        self._transfers[key] = Transfer(
            key, message.request_id, request, peer, message.imm, list(message.dst_page_ids),
            message.context_slot, plan_request(self.kv_cache.sharding, peer.sharding,
                                               PageGeometry.of(self.kv_cache), self._rng,
                                               self._rank_domains),
            nonce=message.nonce, num_held_pages=held, num_sent_pages=held,
            received_at=time.time())

    def fail_peer(self, peer: DecoderPeer, reason: str) -> None:
        """The decoder is gone: nothing more is written to it; its requests end as failed
        once no write reads their pages any more."""
        for transfer in [t for t in self._transfers.values() if t.peer is peer]:
            self._stop(transfer, FailureCause.DECODER_GONE, reason)

    def cancel(self, peer: DecoderPeer, request_id: str) -> None:
        """The decoder dropped `request_id`: write nothing more. It is answered with KVFailed
        carrying the writes posted, now or once the writes in flight have completed."""
        key = f"{peer.peer_id}/{request_id}"
        transfer = self._transfers.get(key)
        if transfer is not None:
            self._stop(transfer, FailureCause.CANCELLED, "cancelled by the decoder")
            return
        # Finished already (its counter should have fired: a lost immediate?) or unknown.
        self._tell(peer, KVFailed(request_id, FailureCause.CANCELLED,
                                  "not in flight at the prefiller",
                                  self._finished_writes.get(key, -1)))

    def expire_leases(self) -> None:
        """Stop transfers older than their lease: the decoder has given up on them by now."""
        now = time.time()
        for transfer in list(self._transfers.values()):
            if transfer.error is None and now - transfer.received_at > self.lease_s:
                self.stats["expired_leases"] += 1
                self._stop(transfer, FailureCause.LEASE_EXPIRED,
                           f"lease of {self.lease_s:g} s expired")

    def _stop(self, transfer: Transfer, cause: FailureCause, reason: str) -> None:
        """Engine thread, between forwards: post nothing more for `transfer`; it ends when its
        last write in flight completes (its pages are read until then)."""
        self._parts.scheduler.detach(transfer.key)
        with self._lock:
            transfer.fail(cause, reason)
            transfer.all_submitted = True
            if transfer.pending_writes == 0:
                self._finish(transfer)

    def has_work(self) -> bool:
        """Whether any request is still being prefilled or transferred."""
        return bool(self._transfers)

    # Forward pass hooks.

    def on_batch(self, batch: Batch) -> None:
        """Before a forward (S3a): plan the pages each chunk completes, and with a request's
        first chunk those it found in this node's prefix cache (the decoder lacks them)."""
        plan = []
        for chunk in batch.chunks:
            transfer = self._transfers.get(chunk.request.request_id)
            if transfer is None or transfer.error is not None:
                continue
            request = chunk.request
            transfer.first_scheduled_at = transfer.first_scheduled_at or time.time()
            indices = pages_to_send(transfer.num_sent_pages, chunk.start, chunk.end,
                                    request.num_prompt_tokens, self.kv_cache.page_size)
            if indices:
                transfer.num_sent_pages = indices.stop
                plan.append(PlannedWrite(transfer, [request.page_ids[i] for i in indices],
                                         [transfer.dst_page_ids[i] for i in indices]))
        with self._lock:
            self._plans[self._forwards_planned] = plan
            self._forwards_planned += 1

    def _on_counter(self, index: int, old: int, new: int) -> None:
        """Poller thread (S3b): post the writes of every layer that finished since `old`."""
        for value in range(old + 1, new + 1):
            forward, layer = LayerCounter.decode(value, self.num_layers)
            with self._lock:
                plan = self._plans.get(forward, [])
            self._count(staged_bytes=stage_out_layer(self._kv, plan, layer))  # no-op unless staged
            now = time.perf_counter()
            for write in plan:
                write.transfer.layer_post_times.append((layer, now))
                self._submit_layer(write, layer)
            self.tracer.instant("layer", forward=forward, layer=layer)  # every counter bump
            if plan:
                self.tracer.instant("layer_writes_posted", forward=forward, layer=layer,
                                    requests=len(plan))
            with self._lock:
                if layer == self.num_layers - 1:
                    self._plans.pop(forward, None)
                self._handled_value = value
                self._lock.notify_all()

    def _submit_layer(self, write: PlannedWrite, layer: int) -> None:
        """One paged-write call per planned page write: the pages of the chunk, one layer."""
        transfer, peer = write.transfer, write.transfer.peer
        src_page_nbytes = self.kv_cache.shards[0].page_nbytes
        src_layer_nbytes = self.kv_cache.shards[0].layer_nbytes
        num_pages = len(write.src_page_ids)
        for plan in transfer.page_writes:
            with self._lock:
                if transfer.error is not None:
                    return
                transfer.pending_writes += 1
            try:
                self.transfer.submit_paged_writes(
                    PagedWrite(self._kv[plan.src_rank].region, write.src_page_ids,
                               src_page_nbytes, layer * src_layer_nbytes + plan.src_offset,
                               peer.kv[plan.dst_rank], write.dst_page_ids, peer.page_nbytes,
                               layer * peer.layer_nbytes + plan.dst_offset, plan.nbytes,
                               transfer.imm, plan.domains),
                    on_done=lambda n=num_pages, layer=layer: self._layer_done(transfer, n, layer),
                    on_error=lambda error: self._write_done(transfer, error))
            except (TransferError, ValueError) as error:
                self._write_done(transfer, error)
                return
            self._count(writes=num_pages, bytes=num_pages * plan.nbytes)
        self._count(pages=num_pages)

    def after_forward(self, batch: Batch, output: ForwardOutput) -> None:
        """After a forward: once every layer's writes are posted, write the context of
        requests whose prefill is complete (S4a) and mark them fully submitted."""
        if self.draft is not None:  # the head's pages must exist before the context ships
            self.draft.after_forward(batch, output, self._transfers)
        target = self._forwards_planned * self.num_layers
        with self._lock:
            done = self._lock.wait_for(lambda: self._handled_value >= target,
                                       self.wait_timeout_s)
        self._poller.check()
        if not done:
            raise TimeoutError(f"layer poller saw {self._handled_value} of {target} bumps")
        for row, chunk_idx in enumerate(output.sample_chunk_indices):
            transfer = self._transfers.get(batch.chunks[chunk_idx].request.request_id)
            if transfer is None:
                continue
            transfer.last_layer_at = time.time()
            self._submit_context(transfer, output, row)
            with self._lock:
                transfer.all_submitted = True
                if transfer.pending_writes == 0:
                    self._finish(transfer)

    def _submit_context(self, transfer: Transfer, output: ForwardOutput, row: int) -> None:
        with self._lock:
            if transfer.error is not None:
                return
            transfer.pending_writes += 1
        draft = self.draft if self.draft is not None and self.draft.wants(transfer) else None
        if draft is not None:  # the MTP head's pages, before the slot (issue 6)
            with self._lock:
                transfer.pending_writes += 1
            draft.submit(transfer, lambda err=None, n=0: self._write_done(transfer, err, n))
        slot, request = self._slots.take(self.wait_timeout_s), transfer.request
        checksum = kv_checksum(self.kv_cache, request.page_ids, request.num_prompt_tokens,
                               transfer.num_held_pages)  # held pages: neither sent nor summed
        checksum += draft.checksum(transfer) if draft is not None else 0.0
        pack_context(self._slots.buffer[slot], output.hidden_states[row], output.logits[row],
                     checksum, transfer.nonce)
        if self._slots.submit(slot, transfer.imm, transfer.peer.context, transfer.context_slot,
                              lambda error: self._write_done(transfer, error, 1)):
            self._count(writes=1, bytes=self._slots.slot_nbytes)

    def _finish(self, transfer: Transfer) -> None:
        """Any thread, lock held: nothing of `transfer` is in flight; the engine thread frees
        it, once (a Cancel and the loss of its decoder may both stop it)."""
        if not transfer.ended:
            transfer.ended = True
            self._finished.put(transfer)
            self._wake()

    def _count(self, **amounts: int) -> None:
        with self._lock:  # the poller thread and the engine thread both post writes
            for name, amount in amounts.items():
                self.stats[name] += amount

    def _layer_done(self, transfer: Transfer, writes: int, layer: int) -> None:
        self.tracer.instant("layer_writes_done", layer=layer, request_id=transfer.request_id)
        self._write_done(transfer, None, writes)

    def _write_done(self, transfer: Transfer, error: BaseException | None,
                    writes: int = 0) -> None:
        """Transfer-engine thread: count a finished write call (`writes` writes when it
        succeeded); the last one finishes the request."""
        with self._lock:
            transfer.pending_writes -= 1
            transfer.done_at = time.time()
            if error is None:
                transfer.writes_ok += writes
            else:
                transfer.writes_unknown = True
                transfer.fail(FailureCause.WRITE_FAILED, f"write failed: {error}")
            if transfer.pending_writes == 0 and transfer.all_submitted:
                self._finish(transfer)

    # Completion (engine thread).

    def poll(self) -> list[Transfer]:
        """Free the source pages of requests whose writes all completed (S4b); tell the
        decoder of failures. Returns the transfers that ended."""
        ended = []
        while not self._finished.empty():  # this thread alone takes from it
            transfer = self._finished.get_nowait()
            request = transfer.request
            self._parts.allocator.free(request.page_ids)
            request.page_ids = []
            del self._transfers[transfer.key]
            self._finished_writes[transfer.key] = transfer.writes_ok
            while len(self._finished_writes) > 4096:
                self._finished_writes.popitem(last=False)
            self.stats["requests"] += 1
            trace_transfer(self.tracer, transfer)
            if transfer.error is None:
                request.state = RequestState.FINISHED_TRANSFERRED
            else:
                request.state = RequestState.FINISHED_FAILED
                self.stats["failed"] += 1
                logger.warning("request %s failed: %s", transfer.key, transfer.error)
                posted = -1 if transfer.writes_unknown else transfer.writes_ok
                assert transfer.cause is not None, "a failed transfer names its cause"
                self._tell(transfer.peer, KVFailed(transfer.request_id, transfer.cause,
                                                   transfer.error, posted))
            ended.append(transfer)
            self.recent.append(transfer)
        return ended

    def _tell(self, peer: DecoderPeer, message: KVFailed) -> None:
        try:
            peer.channel.send(message)
        except PeerClosedError:
            logger.info("decoder %s is gone; not told about %s", peer.peer_id, message.request_id)

    def close(self) -> None:
        """Stop the poller and unregister memory (call after the transfer engine drained)."""
        self._poller.stop()
        for kv in self._kv:
            kv.close(self.transfer)
        self._slots.close()
        if self.draft is not None:
            self.draft.close()
