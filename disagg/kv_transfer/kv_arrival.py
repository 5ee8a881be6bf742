"""What the decoder does with a request whose counter fired: stage the KV in, check it, hand
the request to the engine (S2c, S4c, S5, S8).

The counter fires when the expected number of writes has landed; before the request decodes,
a staged cache copies the written pages in from its host shadow (S5), and the KV checksum and
the request's nonce in the context slot must match (a duplicated immediate can fire a counter
early; a corrupted page or a slot nobody wrote must never decode). Released, the request has
every prompt token but the last computed: the engine's next step runs the last one as an
ordinary decode step and samples the first token (S8). Pages found in this node's prefix cache
(X2b) were never written by a prefiller: they are neither staged nor summed.
"""

from __future__ import annotations

from disagg.engine.llm_engine import EngineParts
from disagg.engine.request import Request
from disagg.kv_transfer.context_slot import LandingSlots, context_slot_nbytes, slot_matches
from disagg.kv_transfer.kv_checksum import agreed_kv_checksum
from disagg.kv_transfer.pending_kv import KVReceipt, PendingKV
from disagg.kv_transfer.plugins import DraftSink
from disagg.kv_transfer.transfer_plan import num_pages
from transfer_core.staging import RegisteredKV


class KVArrival:
    """Stages, verifies and releases requests whose KV has landed."""

    def __init__(self, parts: EngineParts, kv: list[RegisteredKV], slots: LandingSlots,
                 draft_kv: DraftSink | None) -> None:
        self._parts = parts
        self._kv = kv
        self._slots = slots
        self._draft_kv = draft_kv

    def held_pages(self, request: Request) -> int:
        """Leading pages found in this node's prefix cache: never written by a prefiller."""
        return request.num_cached_tokens // self._parts.kv_cache.page_size

    def stage_in(self, request: Request) -> None:
        """Copy the written pages in from the host shadow (a no-op unless staged)."""
        # Only the written pages: a held page's shadow is stale (its KV may be computed here).
        pages = num_pages(request.num_prompt_tokens - 1, self._parts.kv_cache.page_size)
        for kv in self._kv:
            kv.stage_in(request.page_ids[self.held_pages(request):pages])
        if self._draft_kv is not None:
            self._draft_kv.stage_in(request)

    def verified(self, pending: PendingKV) -> bool:
        """Whether the context slot carries the request's nonce and the checksum of what
        landed, on every rank's copy (S5)."""
        request = pending.request
        # Every replica of every head must match (NaN when copies disagree: no match).
        got = agreed_kv_checksum(self._parts.kv_cache, request.page_ids,
                                 request.num_prompt_tokens - 1, self.held_pages(request))
        if self._draft_kv is not None:
            got += self._draft_kv.checksum(request)
        return slot_matches(self._slots.buffer[pending.context_slot], self._parts.model.config,
                            pending.nonce, got, request.request_id)

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
