"""A request's last writes from the prefiller: the draft plug-in's pages, then the context slot
(S4a, S8).

Once every layer of a request's last chunk has been posted, the prefiller packs the hidden
state of the last prefilled position, the KV checksum of the pages it sent and the
decoder's nonce into one of its registered context slots and writes it to the slot the decoder
named; that write is the request's last, so when the decoder's counter fires its context is
there. A decoder drafting with an MTP head also gets the head's pages, written just before the
slot; the draft plug-in is built when a decoder first asks for it (`plugins.py`). Both count
under the request's tail immediate, with its last layer's pages (S4c).
"""

from __future__ import annotations

import threading

import torch

from disagg.engine.batch import Batch, ForwardOutput
from disagg.errors import RequestError
from disagg.kv_transfer.context_slot import ContextSlots, pack_context
from disagg.kv_transfer.kv_checksum import kv_checksum
from disagg.kv_transfer.messages import Hello
from disagg.kv_transfer.outgoing_kv import OutgoingKV
from disagg.kv_transfer.plugins import DraftSource, DraftSourceFactory
from disagg.model.kv_cache import KVCache
from disagg.utils.tally import Tally


class ContextSender:
    """Posts each request's context slot, after its draft pages when its decoder wants them."""

    def __init__(self, slots: ContextSlots, kv_cache: KVCache, stats: Tally,
                 make_draft: DraftSourceFactory | None, wait_timeout_s: float) -> None:
        self.slots = slots
        self._kv_cache = kv_cache
        self._stats = stats
        self._make_draft = make_draft
        self._wait_timeout_s = wait_timeout_s  # for a free slot
        self.draft: DraftSource | None = None  # built when a decoder first asks (S8)
        self._lock = threading.Lock()  # decoders' reader threads may ask together

    def draft_source(self) -> DraftSource:
        """The draft plug-in, built on the first call; `RequestError` if there is none."""
        with self._lock:
            if self.draft is None:
                if self._make_draft is None:
                    raise RequestError("this prefiller cannot ship draft KV")
                self.draft = self._make_draft()
            return self.draft

    def add_draft_peer(self, hello: Hello, peer_pages: int) -> None:
        """A decoder that asked for draft KV proved its handshake."""
        self.draft_source().add_peer(hello, peer_pages)

    def after_forward(self, batch: Batch, output: ForwardOutput,
                      in_flight: dict[str, OutgoingKV]) -> None:
        """The head's pages must exist before the context ships: compute this forward's."""
        if self.draft is not None:
            self.draft.after_forward(batch, output, in_flight)

    def post(self, outgoing: OutgoingKV, hidden: torch.Tensor) -> None:
        """Write the draft pages (if any), then the context slot of `outgoing`."""
        if not outgoing.begin_write():
            return  # stopped: nothing more is posted
        draft = self.draft if self.draft is not None and self.draft.wants(outgoing) else None
        if draft is not None and outgoing.begin_write():
            draft.post(outgoing, lambda error=None, n=0: outgoing.write_done(error, tail=n))
        slot, request = self.slots.take(self._wait_timeout_s), outgoing.request
        # Added up as the layers were posted (X8d), else summed here; held pages: neither sent
        # nor summed.
        running = outgoing.kv_sum.value(request.num_prompt_tokens) if outgoing.kv_sum else None
        checksum = running if running is not None else kv_checksum(
            self._kv_cache, request.page_ids, request.num_prompt_tokens, outgoing.num_held_pages)
        checksum += draft.checksum(outgoing) if draft is not None else 0.0
        pack_context(self.slots.buffer[slot], hidden, checksum, outgoing.nonce)
        if self.slots.post(slot, outgoing.tail_imm, outgoing.peer.context, outgoing.context_slot,
                           lambda error: outgoing.write_done(error, tail=1)):
            self._stats.add(writes=1, bytes=self.slots.slot_nbytes)

    def close(self) -> None:
        """Unregister the slots and the plug-in's memory (after the transfer engine drained)."""
        self.slots.close()
        if self.draft is not None:
            self.draft.close()
