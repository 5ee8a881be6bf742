"""What the decoder does with a request whose counters fired: stage the KV in, check it, hand
the request to the engine (S2c, S4c, S5, S8, X8d).

A request's writes are counted under two immediates. The body's counter fires when its pages in
every layer but the last have landed: a staged cache copies those layers in from its host shadow
(S5) and they are summed at once, while the prefiller still computes the last layer. The tail's
fires when the last layer, the draft pages and the context slot have: those are staged in and
the last layer summed. Before the request decodes, the KV checksum (the two sums added) and the
request's nonce in the context slot must match (a duplicated immediate can fire a counter early;
a corrupted page or a slot nobody wrote must never decode). Released, the request has every
prompt token but the last computed: the engine's next step runs the last one as an ordinary
decode step and samples the first token (S8). Pages found in this node's prefix cache (X2b) were
never written by a prefiller: they are neither staged nor summed.
"""

from __future__ import annotations

from disagg.engine.llm_engine import EngineParts
from disagg.engine.request import Request
from disagg.kv_transfer.context_slot import LandingSlots, context_slot_nbytes, slot_matches
from disagg.kv_transfer.kv_checksum import MASK, ReplicaSums, agreed
from disagg.kv_transfer.pending_kv import KVReceipt, PendingKV
from disagg.kv_transfer.plugins import DraftSink
from disagg.kv_transfer.transfer_plan import num_pages
from transfer_core.staging import RegisteredKV


class KVArrival:
    """Stages, verifies and releases requests whose KV has landed."""

    def __init__(self, parts: EngineParts, kv: list[RegisteredKV], slots: LandingSlots,
                 draft_kv: DraftSink | None, verify: bool) -> None:
        self._parts = parts
        self._kv = kv
        self._slots = slots
        self._draft_kv = draft_kv
        self._verify = verify  # check the checksum and nonce before release (S5)
        num_layers = parts.kv_cache.num_layers
        self._body, self._tail = range(num_layers - 1), range(num_layers - 1, num_layers)

    def held_pages(self, request: Request) -> int:
        """Leading pages found in this node's prefix cache: never written by a prefiller."""
        return request.num_cached_tokens // self._parts.kv_cache.page_size

    def body_landed(self, pending: PendingKV) -> None:
        """The body's counter fired (or it had nothing to count): take its layers in and sum
        them, on every rank's copy, before the tail lands."""
        request = pending.request
        self._stage_in(request, self._body)
        if self._verify:  # the pages' rows found once: the last layer reuses them
            pending.sums = ReplicaSums(self._parts.kv_cache, request.page_ids,
                                       request.num_prompt_tokens - 1, self.held_pages(request))
            pending.body_sums = pending.sums.over(self._body)
        pending.body_landed = True

    def verified(self, pending: PendingKV) -> bool:
        """Both counters fired: take the tail in, then whether the context slot carries the
        request's nonce and the checksum of what landed, on every rank's copy (S5). Without
        verification (`verify` off) the tail is only taken in."""
        request = pending.request
        self._stage_in(request, self._tail)
        if self._draft_kv is not None:
            self._draft_kv.stage_in(request)
        if not self._verify:
            return True
        assert pending.sums is not None, "the body was summed before the tail"
        sums = [(body + tail) & MASK
                for body, tail in zip(pending.body_sums, pending.sums.over(self._tail),
                                      strict=True)]
        # Every replica of every head must match (NaN when copies disagree: no match).
        got = agreed(self._parts.kv_cache, sums)
        if self._draft_kv is not None:
            got += self._draft_kv.checksum(request)
        return slot_matches(self._slots.buffer[pending.context_slot], self._parts.model.config,
                            pending.nonce, got, request.request_id)

    def _stage_in(self, request: Request, layers: range) -> None:
        """Copy `layers` of the written pages in from the host shadow (a no-op unless staged)."""
        # Only the written pages: a held page's shadow is stale (its KV may be computed here).
        pages = num_pages(request.num_prompt_tokens - 1, self._parts.kv_cache.page_size)
        for kv in self._kv:
            kv.stage_in(request.page_ids[self.held_pages(request):pages], layers)

    def release(self, pending: PendingKV) -> KVReceipt:
        """Hand the request to the engine (its pages unpinned, all but the last prompt token
        computed); returns what its transfer took."""
        request, cache, model = pending.request, self._parts.kv_cache, self._parts.model.config
        if self._draft_kv is not None:  # before the slot is reused
            self._draft_kv.keep_context(request, self._slots.buffer[pending.context_slot])
        held = self.held_pages(request)
        self._parts.allocator.unpin(request.page_ids[held:])
        request.num_computed_tokens = request.num_prompt_tokens - 1
        self._parts.scheduler.add_prefilled(request)
        moved = num_pages(request.num_prompt_tokens - 1, cache.page_size) - held
        return pending.receipt(moved, sum(shard.page_nbytes for shard in cache.shards),
                               model.num_layers, context_slot_nbytes(model))
