"""Layer-by-layer KV streaming on the prefiller: counter bumps become that layer's page writes
(S3, S3a, S3b, S6a, S9a, X8d).

NOTE (the streaming invariant). Before a forward runs, the streamer plans the pages each
request's chunks complete (`plan_forward`, S3a). The model bumps a layer counter after each
layer's attention output projection; a `CounterPoller` thread sees every bump and, for that
layer, posts the writes of every planned request at once, while the forward moves on (S3b): one
paged write per decoder and rank pair, each page carrying its request's immediate
(`forward_writes`; the last layer's pages carry the request's tail immediate, S4c). So layer l's
KV is on the wire while layer l + 1 computes, and after the forward only the last layer's writes
are left. `wait_posted` is the engine thread's barrier: the forward returned, and every one of
its bumps has been handled.

Each write leaves through its source rank's domains (`PageWrite.domains`, S6a, S9a); KV memory
the NIC cannot read is staged first: a layer's pages are copied to a host shadow just before
they are posted (S5). Threads: the engine's (`plan_forward`, `wait_posted`), the poller's
(staging, posting, then each layer's part of the requests' KV checksums: X8d), the transfer
engine's (completions, which only count).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from disagg.engine.batch import Batch
from disagg.kv_transfer.forward_writes import Member, PeerWrite, forward_writes
from disagg.kv_transfer.kv_checksum import LayerSums
from disagg.kv_transfer.layer_writes import layer_writes
from disagg.kv_transfer.outgoing_kv import ChunkPages, OutgoingKV
from disagg.kv_transfer.transfer_plan import pages_to_send
from disagg.model.kv_cache import KVCache
from disagg.model.layer_counter import LayerCounter
from disagg.utils.tally import Tally
from disagg.utils.trace import Tracer
from transfer_core.errors import TransferError
from transfer_core.poller import CounterPoller
from transfer_core.staging import RegisteredKV
from transfer_core.transport import PagedWrite, Transport


class LayerStreamer:
    """Posts each layer's page writes as soon as the model's counter says the layer is done."""

    def __init__(self, transport: Transport, kv: list[RegisteredKV], kv_cache: KVCache,
                 counter: LayerCounter, stats: Tally, tracer: Tracer,
                 poller_cpus: tuple[int, ...] | None = None) -> None:
        self._transport = transport
        self._kv = kv  # one registered region per TP rank (S5a)
        self._kv_cache = kv_cache
        self._page_nbytes = kv_cache.shards[0].page_nbytes
        self._layer_nbytes = kv_cache.shards[0].layer_nbytes
        self._page_size = kv_cache.page_size
        self.num_layers = kv_cache.num_layers
        self._stats = stats
        self._tracer = tracer
        self._lock = threading.Condition()
        # By forward index: its chunks, and their writes merged per peer (`forward_writes`),
        # each with its paged write at layer 0 (None: making it failed; each layer raises).
        self._forwards: dict[int, tuple[list[ChunkPages], list[tuple[PeerWrite,
                                                                      PagedWrite | None]]]] = {}
        self._num_forwards = 0  # forwards planned
        self._handled = 0  # counter value whose writes have all been posted
        self.counter = counter
        # A CPU counter rings its doorbell after each bump and the poller sleeps until then: a
        # poller that naps wakes the core the forward runs on (S3b); a GPU's counter is polled.
        self._poller = CounterPoller([counter.poll_target], self._on_counter,
                                     name="layer-counter-poller", cpus=poller_cpus,
                                     doorbell=counter.doorbell)
        self._poller.start()

    def plan_forward(self, batch: Batch, in_flight: Mapping[str, OutgoingKV]) -> None:
        """Engine thread, before a forward (S3a): plan the pages each chunk of a request in
        `in_flight` completes, and with a request's first chunk the pages found in this
        node's prefix cache (the decoder lacks them; X2b)."""
        chunks = []
        for chunk in batch.chunks:
            outgoing = in_flight.get(chunk.request.request_id)
            if outgoing is None or outgoing.failed:
                continue
            request = chunk.request
            outgoing.first_scheduled_at = outgoing.first_scheduled_at or time.time()
            indices = pages_to_send(outgoing.num_planned_pages, chunk.start, chunk.end,
                                    request.num_prompt_tokens, self._page_size)
            if indices:
                outgoing.num_planned_pages = indices.stop
                src_ids = [request.page_ids[i] for i in indices]
                dst_ids = [outgoing.dst_page_ids[i] for i in indices]
                writes = layer_writes(outgoing.page_writes, src_ids, dst_ids, self._page_nbytes,
                                      outgoing.peer.page_nbytes)
                span = outgoing.kv_sum.plan(chunk.end) if outgoing.kv_sum is not None else None
                sums = (None if span is None else
                        LayerSums(self._kv_cache, request.page_ids, span.start, span.end))
                chunks.append(ChunkPages(outgoing, src_ids, dst_ids, writes, span, sums))
        merged = [(write, self._layer_zero(write)) for write in forward_writes(chunks)]
        with self._lock:
            self._forwards[self._num_forwards] = (chunks, merged)
            self._num_forwards += 1

    def wait_posted(self, timeout_s: float) -> None:
        """Engine thread, after a forward: block until every layer's writes are posted;
        `TimeoutError` if the poller fell behind by `timeout_s` (it raises if it died)."""
        target = self._num_forwards * self.num_layers
        with self._lock:
            done = self._lock.wait_for(lambda: self._handled >= target, timeout_s)
        self._poller.check()
        if not done:
            raise TimeoutError(f"layer poller saw {self._handled} of {target} bumps")

    def _on_counter(self, index: int, old: int, new: int) -> None:
        """Poller thread (S3b): post the writes of every layer that finished since `old`."""
        for value in range(old + 1, new + 1):
            forward, layer = LayerCounter.decode(value, self.num_layers)
            with self._lock:
                chunks, merged = self._forwards.get(forward, ([], []))
            self._stage_out(chunks, layer)  # no-op unless staged
            now = time.perf_counter()
            for chunk in chunks:
                chunk.outgoing.layer_post_times.append((layer, now))
            for write, layer_zero in merged:
                self._post_layer(write, layer_zero, layer)
            self._add_checksums(chunks, layer)  # the layer is on the wire: now its sum
            self._stats.add(pages=sum(len(c.src_page_ids) for c in chunks
                                      if not c.outgoing.failed))
            self._tracer.instant("layer", forward=forward, layer=layer)  # every counter bump
            if chunks:
                self._tracer.instant("layer_writes_posted", forward=forward, layer=layer,
                                     requests=len(chunks))
            with self._lock:
                if layer == self.num_layers - 1:
                    self._forwards.pop(forward, None)
                self._handled = value
                self._lock.notify_all()

    def _paged_write(self, merged: PeerWrite, layer: int) -> PagedWrite:
        """`merged`'s writes at `layer`'s offsets, each page with its request's immediate
        (the tail's in the last layer)."""
        shape, peer = merged.shape, merged.peer
        return PagedWrite(self._kv[shape.src_rank].region, merged.src_offsets, 1,
                          layer * self._layer_nbytes, peer.kv[shape.dst_rank],
                          merged.dst_offsets, 1, layer * peer.layer_nbytes, shape.nbytes, None,
                          shape.domains, imms=merged.imms_of(layer, self.num_layers))

    def _layer_zero(self, merged: PeerWrite) -> PagedWrite | None:
        """Engine thread: `merged` checked once, at layer 0; a layer then moves its offsets
        (`PagedWrite.at`) instead of checking every page again on the poller's thread."""
        try:
            return self._paged_write(merged, 0)
        except ValueError:
            return None  # each layer's own attempt raises, and fails the requests there

    def _post_layer(self, merged: PeerWrite, layer_zero: PagedWrite | None, layer: int) -> None:
        """One paged-write call for this layer's writes of every request bound for one peer
        and rank pair, at the layer's offsets, each page with its request's immediate."""
        live = [m for m in merged.members if m.outgoing.begin_write()]
        if not live:
            return  # all stopped or failed: nothing more is posted for them
        write = merged.only(live)
        posted = time.time()  # the layer_writes span runs from here to completion
        try:
            if write is merged and layer_zero is not None:
                tail = merged.tail_imms if layer == self.num_layers - 1 else None
                paged = layer_zero.at(layer * self._layer_nbytes,
                                      layer * merged.peer.layer_nbytes, imms=tail)
            else:
                paged = self._paged_write(write, layer)
            self._transport.post_paged_writes(
                paged, on_done=lambda: self._layer_done(live, layer, posted),
                on_error=lambda error: self._layer_failed(live, error))
        except (TransferError, ValueError) as error:
            self._layer_failed(live, error)
            return
        self._stats.add(writes=write.num_writes, bytes=write.num_writes * merged.shape.nbytes)

    def _layer_done(self, members: list[Member], layer: int, posted: float) -> None:
        end = time.time()
        tail = layer == self.num_layers - 1  # counted under the tail's immediate
        for m in members:
            self._tracer.complete("layer_writes", posted, end, parent=m.outgoing.traceparent,
                                  layer=layer, writes=m.write.num_writes,
                                  request_id=m.outgoing.request_id)
            m.outgoing.write_done(None, m.write.num_writes, tail=tail)

    @staticmethod
    def _layer_failed(members: list[Member], error: BaseException) -> None:
        for m in members:
            m.outgoing.write_done(error)

    def _add_checksums(self, chunks: list[ChunkPages], layer: int) -> None:
        """Poller thread (X8d): each chunk's part of its request's KV checksum in `layer`."""
        for chunk in chunks:
            span, sums, outgoing = chunk.sum_span, chunk.layer_sums, chunk.outgoing
            if span is None or sums is None or outgoing.kv_sum is None or outgoing.failed:
                continue
            outgoing.kv_sum.add(sums.of(layer))
            if layer == self.num_layers - 1:
                outgoing.kv_sum.finish(span)

    def _stage_out(self, chunks: list[ChunkPages], layer: int) -> None:
        """Copy the pages `chunks` send of `layer` into the host shadow of every staged rank
        they are read from, one copy call per rank (S5)."""
        pages: dict[int, list[int]] = {}
        for chunk in chunks:
            for rank in {w.src_rank for w in chunk.outgoing.page_writes}:
                if self._kv[rank].staged:
                    pages.setdefault(rank, []).extend(chunk.src_page_ids)
        for rank, page_ids in pages.items():
            before = self._kv[rank].staged_bytes
            self._kv[rank].stage_out(layer, page_ids)
            self._stats.add(staged_bytes=self._kv[rank].staged_bytes - before)

    def close(self) -> None:
        """Stop the poller thread."""
        self._poller.stop()
