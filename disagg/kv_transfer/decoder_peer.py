"""A decoder as its prefiller knows it, and what that decoder may ask for (S2a, S5, S6).

`DecoderPeer` is built from a decoder's validated handshake (`handshake.py`): where its KV pages
(one region per TP rank) and context slots are, and whether it proved that it owns them. Every
`KVRequest` is checked against it (`check_kv_request`) before anything is planned or posted: a
page id, slot or immediate outside what the peer advertised is refused, naming the value.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.control.channel import Channel
from disagg.errors import RequestError
from disagg.kv_transfer.messages import KVRequest
from disagg.kv_transfer.transfer_plan import num_pages
from disagg.model.sharding import Sharding
from transfer_core.memory import MemoryRegionDescriptor


@dataclass
class DecoderPeer:
    """A connected decoder: where its KV pages (one region per TP rank) and context slots are."""

    peer_id: str
    channel: Channel
    kv: list[MemoryRegionDescriptor]
    context: MemoryRegionDescriptor
    sharding: Sharding
    num_pages: int
    num_context_slots: int
    page_nbytes: int  # of one rank's page
    layer_nbytes: int  # of one rank's layer
    kv_memory_path: str = ""  # how the decoder's NIC reaches its KV (host, hmem, staged)
    wants_draft_kv: bool = False  # it drafts with an MTP head whose KV we ship (S8)
    proof: int = 0  # the nonce written into its proof slot at handshake, for it to echo (S5)
    proven: bool = False  # it echoed it: only now are its requests taken
    engine_address: bytes = b""  # its transfer engine's, from the Hello: where we write (X4)
    handshake: int = 0  # this prefiller's count of handshakes when it shook hands (X4)


def check_kv_request(message: KVRequest, peer: DecoderPeer, page_size: int,
                     vocab_size: int) -> None:
    """Refuse a request whose prompt, pages, slot or immediate the peer could not mean."""
    prompt, request_id = message.prompt_token_ids, message.request_id
    if not peer.proven:
        raise RequestError(f"request {request_id}: decoder {peer.peer_id} has not proved it "
                           "owns the memory its Hello names (no HelloProof)")
    if len(prompt) < 2:
        raise RequestError(f"request {request_id}: a prompt of {len(prompt)} tokens needs no "
                           "prefill (the decoder runs its last token)")
    cached = message.num_cached_tokens
    if cached < 0 or cached % page_size or cached >= len(prompt) - 1:
        raise RequestError(f"request {request_id}: num_cached_tokens={cached} is not a whole "
                           f"number of {page_size}-token pages below the {len(prompt) - 1} "
                           "prefilled tokens")
    if len(message.dst_page_ids) < num_pages(len(prompt) - 1, page_size):
        raise RequestError(f"request {request_id}: {len(message.dst_page_ids)} destination "
                           f"pages for {len(prompt) - 1} tokens")
    bad = [p for p in message.dst_page_ids if not 0 <= p < peer.num_pages]
    if bad:
        raise RequestError(f"request {request_id}: page ids {bad[:4]} are outside the "
                           f"decoder's region of {peer.num_pages} pages")
    if not 0 <= message.context_slot < peer.num_context_slots:
        raise RequestError(f"request {request_id}: context slot {message.context_slot} "
                           f"outside [0, {peer.num_context_slots})")
    if any(not 0 <= t < vocab_size for t in prompt):
        raise RequestError(f"request {request_id}: token ids outside [0, {vocab_size})")
    if message.attempt < 1:
        raise RequestError(f"request {request_id}: attempt {message.attempt} is not >= 1")
    if not 0 <= message.imm < 2**32:
        raise RequestError(f"request {request_id}: imm {message.imm} not 32-bit")
    if not 0 <= message.nonce < 2**64:
        raise RequestError(f"request {request_id}: nonce {message.nonce} not 64-bit")
