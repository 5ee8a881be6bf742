"""The prefiller's KV messenger: a request's KV, streamed to its decoder layer by layer as it is
computed (S2b, S3, S4a, S4b).

A decoder's `KVRequest` becomes a prefill-only request in this node's scheduler and an
`OutgoingKV` record. Before each forward the engine tells the messenger which chunks it holds
(`on_batch`); the `LayerStreamer` plans, per request, the pages those chunks complete and posts
each layer's writes as the model's counter reports the layer done (S3). After the request's
last chunk the messenger writes the context slot (hidden state, KV checksum, S4a); when
every write has completed the record ends and, on the engine thread, `poll` frees the source
pages (S4b). Pages the decoder holds already are never
written; pages found in this node's prefix cache go with the first chunk (X2b). Every write
carries the request's immediate value; the decoder counts them (S4c).

A gone decoder's writes still queued are given up at once (`Transport.abandon_peer`, X4),
so its requests end now rather than at their writes' deadline (a dead peer's writes never
complete: tcp;ofi_rxm answers -FI_EAGAIN until then), unless the same decoder has shaken
hands again meanwhile: what is queued to its address may then be the new handshake's own.

Collaborators, wired once by the node's builder: the layer streamer (plans, poller thread,
page writes), the context sender (context slots and the draft-KV plug-in, built when a decoder
first asks for it), the handshake's prefiller side (`handshake.py`). `wake` rings the node's
inbox.
"""

from __future__ import annotations

import itertools
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
from disagg.kv_transfer import handshake
from disagg.kv_transfer.context_sender import ContextSender
from disagg.kv_transfer.context_slot import ContextSlots, prefill_token_ids
from disagg.kv_transfer.decoder_peer import DecoderPeer, check_kv_request
from disagg.kv_transfer.kv_checksum import sums_in_place
from disagg.kv_transfer.layer_streamer import LayerStreamer
from disagg.kv_transfer.messages import Hello, HelloProof, KVFailed, KVRequest
from disagg.kv_transfer.outgoing_kv import OutgoingKV, trace_outgoing
from disagg.kv_transfer.plugins import DraftSource, DraftSourceFactory
from disagg.kv_transfer.running_checksum import RunningChecksum
from disagg.kv_transfer.transfer_plan import plan_request
from disagg.model.layer_counter import LayerCounter
from disagg.model.page_geometry import PageGeometry
from disagg.utils.tally import Tally
from disagg.utils.trace import Tracer
from transfer_core.errors import TransferError
from transfer_core.staging import register_kv
from transfer_core.transport import Transport

logger = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 10.0  # warming a new decoder's fabric connection at handshake
STATS = ("pages", "writes", "bytes", "requests", "failed", "expired_leases", "staged_bytes")
FORGET_AFTER = 4096  # ended requests remembered, for a late Cancel's fence


class PrefillMessenger:
    """Follows the prefiller's forward passes and ships KV pages as layers finish."""

    def __init__(self, parts: EngineParts, transport: Transport, counter: LayerCounter, *,
                 wake: Callable[[], None], make_draft_source: DraftSourceFactory | None = None,
                 num_context_slots: int = 16, wait_timeout_s: float = 60.0,
                 tracer: Tracer | None = None, lease_s: float = 300.0,
                 kv_memory_path: str | None = None,
                 rank_domains: list[tuple[int, ...]] | None = None,
                 poller_cpus: tuple[int, ...] | None = None, min_post_bytes: int) -> None:
        self._parts = parts
        self.transport = transport
        self.kv_cache = parts.kv_cache
        self.lease_s = lease_s  # a request older than this is stopped: its decoder gave up
        self.wait_timeout_s = wait_timeout_s
        self.tracer = tracer or Tracer()
        self.stats = Tally(*STATS)
        # One region per TP rank, as one process registering every GPU's KV (S5a); no peer may
        # write it (S5). Its path (host, hmem, staged) defaults to the engine's `memory_path`.
        self.kv = [register_kv(transport, shard.buffer, f"prefill-kv{rank}", kv_memory_path,
                               remote_write=False)
                   for rank, shard in enumerate(self.kv_cache.shards)]
        self.streamer = LayerStreamer(transport, self.kv, self.kv_cache, counter, self.stats,
                                      self.tracer, poller_cpus, min_post_bytes)
        self.context = ContextSender(
            ContextSlots(transport, parts.model.config, num_context_slots), self.kv_cache,
            self.stats, make_draft_source, wait_timeout_s)
        self._rank_domains = rank_domains  # rank r's writes leave through these (S6a, S9a)
        self._rng = random.Random(0)  # source replica sets and NICs per request (S6c, S9a)
        self._in_flight: dict[str, OutgoingKV] = {}  # by key; the engine thread's alone
        self._forward_started = 0.0  # wall clock of the forward under way, for its spans
        self._ended: queue.SimpleQueue[OutgoingKV] = queue.SimpleQueue()
        # Writes completed under each immediate of ended requests, for a late Cancel.
        self._ended_writes: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.recent: deque[OutgoingKV] = deque(maxlen=64)  # ended requests, for tools
        self._wake = wake  # the node's "something happened" bell
        # The latest handshake per decoder engine address, and the lock that orders a
        # handshake's first write after any abandon of that address (reader threads vs the
        # engine thread).
        self._handshakes = itertools.count(1)
        self._latest_handshake: dict[bytes, int] = {}
        self._abandon_lock = threading.Lock()

    @property
    def draft(self) -> DraftSource | None:
        """The draft-KV plug-in, once a decoder asked for it."""
        return self.context.draft

    # Decoders (their reader threads).

    def add_peer(self, hello: Hello, channel: Channel) -> DecoderPeer:
        """A decoder whose Hello matched: parse its regions, open the fabric connection (warm,
        before its first request), write its proof. Raises `RequestError`/`TransferError`."""
        peer = handshake.parse_peer(hello, channel, self.kv_cache.num_layers,
                                    PageGeometry.of(self.kv_cache), self.context.slots.slot_nbytes)
        with self._abandon_lock:  # before our first write: a later abandon spares it
            peer.handshake = next(self._handshakes)
            self._latest_handshake[peer.engine_address] = peer.handshake
        # tcp;ofi_rxm connects on the first write (25-80 ms); pay it now, not in a request's
        # first layer.
        self.transport.connect(hello.engine_address, timeout_s=CONNECT_TIMEOUT_S)
        peer.proof = handshake.write_proof(self.context.slots, self.transport, hello,
                                          peer.context)
        if hello.draft_kv_descriptor:
            self.context.draft_source()  # built before HelloAck; told of the peer once proven
        logger.info("decoder %s: its KV memory path is %s; ours is %s", peer.peer_id,
                    peer.kv_memory_path or "unknown", self.kv[0].path.kind)
        return peer

    def accept_proof(self, peer: DecoderPeer, hello: Hello, proof: HelloProof) -> None:
        """The decoder's answer to HelloAck (S5): only now are its requests taken."""
        handshake.check_proof(peer, proof)
        if hello.draft_kv_descriptor:
            self.context.add_draft_peer(hello, peer.num_pages)

    # Requests (engine thread).

    @property
    def num_in_flight(self) -> int:
        """Requests being prefilled or transferred."""
        return len(self._in_flight)

    def has_work(self) -> bool:
        """Whether any request is still being prefilled or transferred."""
        return bool(self._in_flight)

    def start_request(self, message: KVRequest, peer: DecoderPeer) -> None:
        """Validate a decoder's request and queue its prefill; raises `RequestError`."""
        key = f"{peer.peer_id}/{message.request_id}"
        if key in self._in_flight:
            raise RequestError(f"request {message.request_id} is already in flight")
        check_kv_request(message, peer, self.kv_cache.page_size,
                         self._parts.model.config.vocab_size)
        request = Request(key, prefill_token_ids(message.prompt_token_ids),
                          SamplingParams(max_tokens=1))
        # An MTP head runs over every prefilled position, so its decoder's requests never
        # start from cached pages (they still leave theirs in the cache); nor does a retry,
        # whose first KV may have been wrong here.
        request.reuse_prefix = not peer.wants_draft_kv and message.attempt == 1
        self._parts.scheduler.add_request(request)
        held = message.num_cached_tokens // self.kv_cache.page_size
        page_writes = plan_request(self.kv_cache.sharding, peer.sharding,
                                   PageGeometry.of(self.kv_cache), self._rng, self._rank_domains)
        self._in_flight[key] = OutgoingKV(
            key, message.request_id, request, peer, message.imm, message.tail_imm,
            list(message.dst_page_ids), message.context_slot, page_writes, self._on_end,
            nonce=message.nonce, num_held_pages=held, num_planned_pages=held,
            received_at=time.time(),
            kv_sum=(RunningChecksum.from_token(held * self.kv_cache.page_size)
                    if sums_in_place(self.kv_cache) else None),
            traceparent=self.tracer.open(key, "kv_request", parent=message.traceparent,
                                         request_id=message.request_id, decoder=peer.peer_id,
                                         attempt=message.attempt))

    def cancel(self, peer: DecoderPeer, request_id: str) -> None:
        """The decoder dropped `request_id`: write nothing more. It hears `KVFailed` with the
        writes posted, now or once the writes in flight have completed."""
        key = f"{peer.peer_id}/{request_id}"
        if key in self._in_flight:
            self._stop(self._in_flight[key], FailureCause.CANCELLED, "cancelled by the decoder")
            return
        # Ended already (its counter should have fired: a lost immediate?) or unknown.
        self._tell(peer, KVFailed(request_id, FailureCause.CANCELLED,
                                  "not in flight at the prefiller",
                                  *self._ended_writes.get(key, (-1, -1))))

    def fail_peer(self, peer: DecoderPeer, reason: str) -> None:
        """The decoder is gone: nothing more is written to it, what is queued for it is
        given up, and its requests end as failed once no write reads their pages any more
        (at once, unless the provider still holds some of their writes)."""
        for outgoing in [o for o in self._in_flight.values() if o.peer is peer]:
            self._stop(outgoing, FailureCause.DECODER_GONE, reason)
        with self._abandon_lock:
            # A newer handshake from that engine may have writes queued already (its proof):
            # then leave them, and the old requests' writes go to a live decoder anyway.
            if self._latest_handshake.get(peer.engine_address) == peer.handshake:
                self._abandon(peer.engine_address)

    def fail_all(self, reason: str) -> None:
        """This node is shutting down: every request still in flight ends as failed (its
        decoder retries it elsewhere) once no write reads its pages; their decoders' queued
        writes are given up."""
        stopped = [o for o in self._in_flight.values() if not o.failed]
        for outgoing in stopped:
            self._stop(outgoing, FailureCause.PREFILLER_DIED, reason)
        for address in {o.peer.engine_address for o in self._in_flight.values()}:
            self._abandon(address)

    def _abandon(self, address: bytes) -> None:
        if not address:
            return
        try:
            self.transport.abandon_peer(address)
        except TransferError as error:  # closed engine, or an address that never parsed
            logger.warning("could not give up the writes to %r: %s", address[:16], error)

    def expire_leases(self) -> None:
        """Stop requests older than their lease: the decoder has given up on them by now."""
        now = time.time()
        for outgoing in list(self._in_flight.values()):
            if not outgoing.failed and now - outgoing.received_at > self.lease_s:
                self.stats.add(expired_leases=1)
                self._stop(outgoing, FailureCause.LEASE_EXPIRED,
                           f"lease of {self.lease_s:g} s expired")

    def _stop(self, outgoing: OutgoingKV, cause: FailureCause, reason: str) -> None:
        self._parts.scheduler.detach(outgoing.key)
        outgoing.stop(cause, reason)

    # The engine's step observer (engine thread).

    def on_batch(self, batch: Batch) -> None:
        """Before a forward (S3a): the streamer plans the pages its chunks complete."""
        self._forward_started = time.time()
        self.streamer.plan_forward(batch, self._in_flight)

    def after_forward(self, batch: Batch, output: ForwardOutput) -> None:
        """After a forward: once every layer's writes are posted, write the context of the
        requests whose prefill is complete (S4a); their writes are then all posted."""
        self.context.after_forward(batch, output, self._in_flight)
        self.streamer.wait_posted(self.wait_timeout_s)
        if self.tracer.enabled:  # each request's chunk, in its trace (X7a)
            self._trace_chunks(batch, time.time())
        for row, chunk_index in enumerate(output.sample_chunk_indices):
            outgoing = self._in_flight.get(batch.chunks[chunk_index].request.request_id)
            if outgoing is None:
                continue
            outgoing.last_layer_at = time.time()
            self.context.post(outgoing, output.hidden_states[row])
            outgoing.all_posted()

    def _trace_chunks(self, batch: Batch, now: float) -> None:
        for chunk in batch.chunks:
            if (outgoing := self._in_flight.get(chunk.request.request_id)) is not None:
                self.tracer.complete("prefill_chunk", self._forward_started, now,
                                     parent=outgoing.traceparent, start=chunk.start,
                                     tokens=chunk.end - chunk.start,
                                     request_id=outgoing.request_id)

    def _on_end(self, outgoing: OutgoingKV) -> None:
        """Any thread: nothing of `outgoing` is in flight; the engine thread frees it."""
        self._ended.put(outgoing)
        self._wake()

    # Completion (engine thread).

    def poll(self) -> list[OutgoingKV]:
        """Free the source pages of requests whose writes all completed (S4b); tell the
        decoder of failures. Returns the requests that ended."""
        ended = []
        while not self._ended.empty():  # this thread alone takes from it
            outgoing = self._ended.get_nowait()
            request = outgoing.request
            self._parts.allocator.free(request.page_ids)
            request.page_ids = []
            del self._in_flight[outgoing.key]
            self._remember(outgoing)
            trace_outgoing(self.tracer, outgoing)
            self.tracer.end(outgoing.key, error=outgoing.error,
                            failed=outgoing.error is not None)
            if outgoing.error is None:
                request.state = RequestState.FINISHED_TRANSFERRED
            else:
                request.state = RequestState.FINISHED_FAILED
                self.stats.add(failed=1)
                logger.warning("request %s failed: %s", outgoing.key, outgoing.error)
                assert outgoing.cause is not None, "a failed request names its cause"
                self._tell(outgoing.peer, KVFailed(outgoing.request_id, outgoing.cause,
                                                   outgoing.error, *outgoing.writes_posted))
            ended.append(outgoing)
        return ended

    def _remember(self, outgoing: OutgoingKV) -> None:
        self.stats.add(requests=1)
        self.recent.append(outgoing)
        self._ended_writes[outgoing.key] = outgoing.writes_posted
        while len(self._ended_writes) > FORGET_AFTER:
            self._ended_writes.popitem(last=False)

    def _tell(self, peer: DecoderPeer, message: KVFailed) -> None:
        try:
            peer.channel.send(message)
        except PeerClosedError:
            logger.info("decoder %s is gone; not told about %s", peer.peer_id, message.request_id)

    def close(self) -> None:
        """Stop the poller and unregister memory (call after the transfer engine drained)."""
        self.streamer.close()
        for kv in self.kv:
            kv.close(self.transport)
        self.context.close()
