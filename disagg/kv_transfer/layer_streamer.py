"""Layer-by-layer KV streaming on the prefiller: counter bumps become that layer's page writes
(S3, S3a, S3b, S6a, S9a, X8d, X9a).

NOTE (the streaming invariant). Before a forward runs, the streamer plans the pages each
request's chunks complete (`plan_forward`, S3a) and the groups its layers post in
(`layer_groups`, X9a: a layer of a short prompt rides with the next ones until together they
carry `min_post_bytes`; every layer is its own group when they are large, or with 0). The model
bumps a layer counter after each layer's attention output projection; a `CounterPoller` thread
sees every bump and, at the last layer of a group, posts the group's writes of every planned
request at once, while the forward moves on (S3b): one paged write per decoder and rank pair,
each page carrying its request's immediate (`forward_writes`; the last layer's pages carry the
request's tail immediate, S4c). So layer l's KV is on the wire while layer l + 1 computes, and
after the forward only the last group's writes are left. `wait_posted` is the engine thread's
barrier: the forward returned, and every one of its bumps has been handled.

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
from dataclasses import dataclass

import numpy as np

from disagg.engine.batch import Batch
from disagg.kv_transfer.forward_writes import Member, PeerWrite, forward_writes
from disagg.kv_transfer.kv_checksum import LayerSums
from disagg.kv_transfer.layer_groups import layer_groups
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


@dataclass(frozen=True, slots=True)
class PlannedForward:
    """One forward's chunks, their writes merged per peer (`forward_writes`), each with its
    paged write at layer 0 (None: making it failed; each post raises), and the groups its
    layers post in (`layer_groups`)."""

    chunks: list[ChunkPages]
    merged: list[tuple[PeerWrite, PagedWrite | None]]
    groups: tuple[range, ...]

    def ending_at(self, layer: int) -> tuple[range | None, range | None]:
        """The group whose last layer is `layer` (None: it rides with a later one), and the
        group after it (None: the forward's last)."""
        for i, group in enumerate(self.groups):
            if group[-1] == layer:
                return group, self.groups[i + 1] if i + 1 < len(self.groups) else None
        return None, None


class LayerStreamer:
    """Posts each layer's page writes as soon as the model's counter says the layer is done
    (with the next layers', while together they carry under `min_post_bytes`: X9a)."""

    def __init__(self, transport: Transport, kv: list[RegisteredKV], kv_cache: KVCache,
                 counter: LayerCounter, stats: Tally, tracer: Tracer,
                 poller_cpus: tuple[int, ...] | None, min_post_bytes: int) -> None:
        if min_post_bytes < 0:
            raise ValueError(f"min_post_bytes must be >= 0, got {min_post_bytes}")
        self._transport = transport
        self._kv = kv  # one registered region per TP rank (S5a)
        self._kv_cache = kv_cache
        self._page_nbytes = kv_cache.shards[0].page_nbytes
        self._layer_nbytes = kv_cache.shards[0].layer_nbytes
        self._page_size = kv_cache.page_size
        self.num_layers = kv_cache.num_layers
        self._stats = stats
        self._tracer = tracer
        self.min_post_bytes = min_post_bytes
        self._lock = threading.Condition()
        self._forwards: dict[int, PlannedForward] = {}  # by forward index
        self._num_forwards = 0  # forwards planned
        self._handled = 0  # counter value up to which every layer's writes have been posted
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
        layer_bytes = sum(write.num_writes * write.shape.nbytes for write, _ in merged)
        groups = layer_groups(layer_bytes, self.num_layers, self.min_post_bytes)
        with self._lock:
            forward = self._num_forwards
            self._forwards[forward] = PlannedForward(chunks, merged, groups)
            self._num_forwards += 1
        self._hold_until(forward, groups[0][-1])

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
        """Poller thread (S3b): post the writes of every group whose last layer finished since
        `old` (X9a)."""
        for value in range(old + 1, new + 1):
            forward, layer = LayerCounter.decode(value, self.num_layers)
            self._tracer.instant("layer", forward=forward, layer=layer)  # every counter bump
            with self._lock:
                planned = self._forwards.get(forward)
            if planned is not None:  # else unplanned: nothing to post
                group, after = planned.ending_at(layer)
                if group is None:
                    continue  # it rides with a later layer of its group
                self._post_group(forward, planned, group)
                if after is not None:
                    self._hold_until(forward, after[-1])
            with self._lock:
                if layer == self.num_layers - 1:
                    self._forwards.pop(forward, None)
                self._handled = value
                self._lock.notify_all()

    def _hold_until(self, forward: int, layer: int) -> None:
        """Nothing is posted before `layer` of `forward` is done: until then the poller's
        thread stays in its C wait, off the GIL the forward needs (X9a)."""
        self._poller.report_from(0, forward * self.num_layers + layer + 1)

    def _post_group(self, forward: int, planned: PlannedForward, group: range) -> None:
        """Stage, post and sum the layers of `group` for every request `forward` plans."""
        chunks = planned.chunks
        self._stage_out(chunks, group)  # no-op unless staged
        now = time.perf_counter()
        for chunk in chunks:
            chunk.outgoing.layer_post_times.extend((layer, now) for layer in group)
        for write, layer_zero in planned.merged:
            self._post_layers(write, layer_zero, group)
        self._add_checksums(chunks, group)  # the layers are on the wire: now their sum
        self._stats.add(pages=len(group) * sum(len(c.src_page_ids) for c in chunks
                                               if not c.outgoing.failed))
        for layer in group if chunks else ():
            self._tracer.instant("layer_writes_posted", forward=forward, layer=layer,
                                 requests=len(chunks))

    def _paged_write(self, merged: PeerWrite, group: range) -> PagedWrite:
        """`merged`'s writes in every layer of `group`, each page with its request's immediate
        (the tail's in the last layer): one paged write whose "page ids" are byte offsets from
        the group's first layer."""
        shape, peer = merged.shape, merged.peer
        first = group[0]
        src = [merged.src_offsets + (layer - first) * self._layer_nbytes for layer in group]
        dst = [merged.dst_offsets + (layer - first) * peer.layer_nbytes for layer in group]
        imms = [merged.imms_of(layer, self.num_layers) for layer in group]
        return PagedWrite(self._kv[shape.src_rank].region, np.concatenate(src), 1,
                          first * self._layer_nbytes, peer.kv[shape.dst_rank],
                          np.concatenate(dst), 1, first * peer.layer_nbytes, shape.nbytes, None,
                          shape.domains, imms=np.concatenate(imms))

    def _layer_zero(self, merged: PeerWrite) -> PagedWrite | None:
        """Engine thread: `merged` checked once, at layer 0; a layer then moves its offsets
        (`PagedWrite.at`) instead of checking every page again on the poller's thread."""
        try:
            return self._paged_write(merged, range(1))
        except ValueError:
            return None  # each layer's own attempt raises, and fails the requests there

    def _post_layers(self, merged: PeerWrite, layer_zero: PagedWrite | None,
                     group: range) -> None:
        """One paged-write call for `group`'s writes of every request bound for one peer and
        rank pair, at its layers' offsets, each page with its request's immediate."""
        live = [m for m in merged.members if m.outgoing.begin_write()]
        if not live:
            return  # all stopped or failed: nothing more is posted for them
        write = merged.only(live)
        layer = group[0]
        posted = time.time()  # the layer_writes span runs from here to completion
        try:
            if write is merged and layer_zero is not None and len(group) == 1:
                tail = merged.tail_imms if layer == self.num_layers - 1 else None
                paged = layer_zero.at(layer * self._layer_nbytes,
                                      layer * merged.peer.layer_nbytes, imms=tail)
            else:
                paged = self._paged_write(write, group)
            self._transport.post_paged_writes(
                paged, on_done=lambda: self._group_done(live, group, posted),
                on_error=lambda error: self._layer_failed(live, error))
        except (TransferError, ValueError) as error:
            self._layer_failed(live, error)
            return
        writes = write.num_writes * len(group)
        self._stats.add(writes=writes, bytes=writes * merged.shape.nbytes)

    def _group_done(self, members: list[Member], group: range, posted: float) -> None:
        end = time.time()
        # The last layer's writes are counted under the tail's immediate, the others the body's.
        tail_layers = int(group[-1] == self.num_layers - 1)
        for m in members:
            self._tracer.complete("layer_writes", posted, end, parent=m.outgoing.traceparent,
                                  layer=group[0], layers=len(group),
                                  writes=m.write.num_writes * len(group),
                                  request_id=m.outgoing.request_id)
            m.outgoing.write_done(None, body=m.write.num_writes * (len(group) - tail_layers),
                                  tail=m.write.num_writes * tail_layers)

    @staticmethod
    def _layer_failed(members: list[Member], error: BaseException) -> None:
        for m in members:
            m.outgoing.write_done(error)

    def _add_checksums(self, chunks: list[ChunkPages], layers: range) -> None:
        """Poller thread (X8d): each chunk's part of its request's KV checksum in `layers`."""
        for chunk in chunks:
            span, sums, outgoing = chunk.sum_span, chunk.layer_sums, chunk.outgoing
            if span is None or sums is None or outgoing.kv_sum is None or outgoing.failed:
                continue
            outgoing.kv_sum.add(sums.over(layers))
            if layers[-1] == self.num_layers - 1:
                outgoing.kv_sum.finish(span)

    def _stage_out(self, chunks: list[ChunkPages], layers: range) -> None:
        """Copy the pages `chunks` send of `layers` into the host shadow of every staged rank
        they are read from, one copy call (and one wait) per rank (S5)."""
        pages: dict[int, list[int]] = {}
        for chunk in chunks:
            for rank in {w.src_rank for w in chunk.outgoing.page_writes}:
                if self._kv[rank].staged:
                    pages.setdefault(rank, []).extend(chunk.src_page_ids)
        for rank, page_ids in pages.items():
            before = self._kv[rank].staged_bytes
            self._kv[rank].stage_out(layers, page_ids)
            self._stats.add(staged_bytes=self._kv[rank].staged_bytes - before)

    def close(self) -> None:
        """Stop the poller thread."""
        self._poller.stop()
