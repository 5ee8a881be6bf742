"""The MTP head's KV across the split: prefilled by the prefiller, shipped after the last
chunk with the context, counted by the decoder (S4a, S4c, S8).

The head at position t needs the token at t+1, so a prefiller can run it on every prefilled
position but the last one: positions `[0, P - 2)` of a P-token prompt. It does, chunk by chunk,
for requests of decoders that asked (`Hello.draft_kv_descriptor`), into a one-layer cache
indexed by the request's own page ids. After the last chunk it writes those pages (one write
each: the head is unsharded, on the leader) and then the context slot, whose KV checksum now
covers them too. The decoder expects `draft_kv_pages` more writes under the request's tail
immediate, runs position P - 2 from the shipped hidden state, and position P - 1 after the
ordinary decode step of the last prompt token (S8). The early-exit draft needs none of this: its
KV is the target's own. The MTP cache takes the same memory path as the target's KV (staged:
copied out before its write, copied in before the checksum; `transfer_core.staging`). Both
classes are the messengers' plug-ins (`plugins.py`); a node's builder creates them, and only
when drafting needs them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from disagg.config import ModelConfig
from disagg.engine.batch import Batch, ForwardOutput
from disagg.engine.llm_engine import EngineParts
from disagg.engine.request import Request
from disagg.errors import RequestError
from disagg.kv_transfer.context_slot import unpack_context
from disagg.kv_transfer.kv_checksum import DRAFT_SALT, kv_checksum
from disagg.kv_transfer.messages import Hello
from disagg.kv_transfer.outgoing_kv import OutgoingKV
from disagg.kv_transfer.plugins import WriteDone
from disagg.kv_transfer.transfer_plan import num_pages
from disagg.model.draft_heads import build_mtp_head, mtp_kv_cache
from disagg.model.kv_cache import PagedKVCache
from disagg.speculative.proposers import CatchUp, mtp_catch_up
from transfer_core.errors import TransferError
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor
from transfer_core.staging import register_kv
from transfer_core.transport import Transport
from transfer_core.transport import PagedWrite


def draft_kv_pages(num_prompt_tokens: int, page_size: int) -> int:
    """MTP pages a prefiller writes for a prompt: those of positions `[0, P - 2)`.

    >>> draft_kv_pages(num_prompt_tokens=35, page_size=16)  # positions 0..32: 3 pages
    3
    >>> draft_kv_pages(2, 16)  # one prefilled position: its row runs on the decoder
    0
    """
    return num_pages(max(num_prompt_tokens - 2, 0), page_size)


class DraftKVSource:
    """Prefiller side (a `DraftSource`): the MTP head over prefill chunks, and its pages
    written after the last one."""

    def __init__(self, parts: EngineParts, transport: Transport,
                 kv_memory_path: str | None = None) -> None:
        model, config = parts.model, parts.config
        self.target = model
        self.head = build_mtp_head(model.config, dtype=config.dtype).to(config.device)
        self.kv_cache = mtp_kv_cache(model.config, config.cache, config.device)
        self.transport = transport
        # A source only: no peer may write it (S5).
        self.kv = register_kv(transport, self.kv_cache.buffer, "prefill-mtp", kv_memory_path,
                              remote_write=False)
        self._peers: dict[str, MemoryRegionDescriptor] = {}  # decoders that draft with MTP

    @property
    def region(self) -> MemoryRegion:
        """The registered memory the head's pages are written from (the shadow if staged)."""
        return self.kv.region

    def add_peer(self, hello: Hello, peer_pages: int) -> None:
        """Remember a decoder's MTP cache, if it has one; it must match its page count."""
        if not hello.draft_kv_descriptor:
            return
        descriptor = MemoryRegionDescriptor.from_bytes(hello.draft_kv_descriptor)
        if descriptor.length != peer_pages * self.kv_cache.page_nbytes:
            raise RequestError(f"decoder {hello.node_id}: MTP cache of {descriptor.length} "
                               f"bytes is not {peer_pages} pages of {self.kv_cache.page_nbytes}")
        self._peers[hello.node_id] = descriptor

    def _num_pages(self, outgoing: OutgoingKV) -> int:
        """MTP pages `outgoing` ships (0 if its decoder does not draft with MTP)."""
        if outgoing.peer.peer_id not in self._peers:
            return 0
        # The prefiller's request holds the prompt minus its last token.
        return draft_kv_pages(outgoing.request.num_prompt_tokens + 1, self.kv_cache.page_size)

    def wants(self, outgoing: OutgoingKV) -> bool:
        """Whether `outgoing` ships MTP pages."""
        return self._num_pages(outgoing) > 0

    @torch.inference_mode()
    def after_forward(self, batch: Batch, output: ForwardOutput,
                      in_flight: Mapping[str, OutgoingKV]) -> None:
        """Run the head on this forward's rows of requests whose decoder wants its KV."""
        assert output.all_hidden_states is not None
        items, row = [], 0
        for chunk in batch.chunks:
            rows = output.all_hidden_states[row:row + chunk.num_tokens]
            row += chunk.num_tokens
            outgoing = in_flight.get(chunk.request.request_id)
            if outgoing is None or outgoing.failed or not self.wants(outgoing):
                continue
            request = chunk.request
            end = min(chunk.end, request.num_prompt_tokens - 1)  # the last row needs t+1
            if end > chunk.start:
                items.append(CatchUp(request.page_ids, chunk.start, rows[:end - chunk.start],
                                     request.prompt_token_ids[chunk.start + 1:end + 1]))
        if items:
            mtp_catch_up(self.head, self.target, self.kv_cache, items)

    def checksum(self, outgoing: OutgoingKV) -> float:
        """What the shipped MTP pages add to the context slot's KV checksum."""
        if not self.wants(outgoing):
            return 0.0
        request = outgoing.request
        return kv_checksum(self.kv_cache, request.page_ids, request.num_prompt_tokens - 1,
                           salt=DRAFT_SALT)

    def post(self, outgoing: OutgoingKV, done: WriteDone) -> None:
        """Write the request's MTP pages (one paged-write call); `done(error, writes)` once."""
        count = self._num_pages(outgoing)
        nbytes = self.kv_cache.page_nbytes
        page_ids = outgoing.request.page_ids[:count]
        # The head ran after the forward: no layer counter vouches for its pages, so a staged
        # copy waits for the compute stream.
        self.kv.stage_out(0, page_ids, wait_for_compute=True)
        try:
            self.transport.post_paged_writes(
                PagedWrite(self.kv.region, page_ids, nbytes, 0,
                           self._peers[outgoing.peer.peer_id], outgoing.dst_page_ids[:count],
                           nbytes, 0, nbytes, outgoing.tail_imm),
                on_done=lambda: done(None, count), on_error=done)
        except (TransferError, ValueError) as error:
            done(error)

    def close(self) -> None:
        """Unregister the MTP cache (after the transfer engine drained)."""
        self.kv.close(self.transport)


class DraftKVSink:
    """Decoder side (a `DraftSink`): the speculating engine's MTP cache, registered for
    prefillers to write, and what it adds to a request's expected writes and KV checksum."""

    def __init__(self, kv_cache: PagedKVCache, model: ModelConfig, page_size: int,
                 transport: Transport, kv_memory_path: str | None = None) -> None:
        self.transport = transport
        self._model = model
        self.page_size = page_size
        self.kv_cache = kv_cache
        self.kv = register_kv(transport, kv_cache.buffer, "decode-mtp", kv_memory_path,
                              remote_write=True)  # prefillers write the head's pages here
        self.descriptor = self.kv.descriptor.to_bytes()

    def expected_writes(self, num_prompt_tokens: int) -> int:
        """Writes of MTP pages a request's prefiller sends."""
        return draft_kv_pages(num_prompt_tokens, self.page_size)

    def stage_in(self, request: Request) -> None:
        """Copy the request's received MTP pages from the host shadow (staged path only)."""
        self.kv.stage_in(request.page_ids[:self.expected_writes(request.num_prompt_tokens)])

    def checksum(self, request: Request) -> float:
        """The received MTP pages' part of the KV checksum."""
        return kv_checksum(self.kv_cache, request.page_ids, request.num_prompt_tokens - 2,
                           salt=DRAFT_SALT)

    def keep_context(self, request: Request, slot: torch.Tensor) -> None:
        """Copy the shipped hidden state onto the request before its context slot is reused:
        the MTP head runs the last prefilled position from it (S4a)."""
        request.prefill_context = unpack_context(slot, self._model).clone()

    def close(self) -> None:
        """Unregister the MTP cache (after the transfer engine drained)."""
        self.kv.close(self.transport)
