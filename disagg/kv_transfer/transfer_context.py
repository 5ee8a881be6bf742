"""A request's transfer context on both sides, the decoder a prefiller writes to, and the
checks on what a decoder asks for (S2a, S2b, S4b, S6; issue 8's bounds checks).

`Transfer` is the prefiller's record of one request's outgoing KV; `PendingKV` the decoder's
record of one it waits for, and `Outcome` what became of it.

Plain data, pure validation and the staging step of a layer (S5: pages of a staged KV region
are copied into its host shadow before the NIC reads them), split from `prefill_messenger.py`
so the messenger file holds only the streaming logic. Every remote page id and slot is checked
against the region the peer advertised before anything is posted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.control.channel import Channel
from disagg.engine.request import FailureCause, Request, RequestState
from disagg.errors import RequestError
from disagg.kv_transfer.messages import Hello, KVRequest
from disagg.kv_transfer.quarantine import Verdict
from disagg.kv_transfer.transfer_plan import PageGeometry, PageWrite, num_pages
from disagg.model.sharding import Sharding
from disagg.utils.trace import Tracer
from transfer_core.memory import MemoryRegionDescriptor
from transfer_core.memory_paths import MEMORY_PATH_KINDS
from transfer_core.staging import RegisteredKV

# What a decoder may say its KV memory path is ("": it did not say).
PEER_MEMORY_PATHS = ("", *MEMORY_PATH_KINDS)


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
    wants_draft_kv: bool = False  # it drafts with an MTP head whose KV we ship (issue 6)
    proof: int = 0  # the nonce written into its proof slot at handshake, for it to echo (S5)
    proven: bool = False  # it echoed it: only now are its requests taken


@dataclass
class Transfer:
    """One request's outgoing KV: the prefiller-side transfer context."""

    key: str  # "<peer_id>/<request_id>", unique on this prefiller
    request_id: str  # as the decoder named it
    request: Request
    peer: DecoderPeer
    imm: int
    dst_page_ids: list[int]
    context_slot: int
    page_writes: list[PageWrite]  # the plan for every page and layer (S6)
    nonce: int = 0  # the decoder's, packed next to the KV checksum (S5)
    num_held_pages: int = 0  # leading pages the decoder holds already (its prefix cache)
    num_sent_pages: int = 0  # pages below this one are held there or planned here
    pending_writes: int = 0
    all_submitted: bool = False
    ended: bool = False  # queued for the engine thread to free (exactly once)
    error: str | None = None  # what went wrong, for logs and the decoder
    cause: FailureCause | None = None  # ... and why, as the decoder's metrics count it
    writes_ok: int = 0  # writes completed at the sender (the fence a decoder waits for)
    writes_unknown: bool = False  # a failed call may have placed some of its writes
    layer_post_times: list[tuple[int, float]] = field(default_factory=list)
    # Wall-clock milestones (time.time()) for traces: the TTFT split of S1.
    received_at: float = 0.0
    first_scheduled_at: float = 0.0
    last_layer_at: float = 0.0
    done_at: float = 0.0

    def fail(self, cause: FailureCause, reason: str) -> None:
        """Record the first failure; later ones change nothing (the first is the cause)."""
        if self.error is None:
            self.error, self.cause = reason, cause


@dataclass(frozen=True, slots=True)
class PlannedWrite:
    """Pages of one request completed by one forward, to be written layer by layer."""

    transfer: Transfer
    src_page_ids: list[int]
    dst_page_ids: list[int]


def parse_peer(hello: Hello, channel: Channel, num_layers: int, geometry: PageGeometry,
               slot_nbytes: int) -> DecoderPeer:
    """A decoder's regions from its handshake; `RequestError` if they do not add up."""
    sharding = Sharding(hello.tp, hello.num_kv_heads, hello.replicated_kv)
    if len(hello.kv_descriptors) != sharding.tp:
        raise RequestError(f"decoder {hello.node_id}: {len(hello.kv_descriptors)} KV "
                           f"regions for tp={sharding.tp}")
    if hello.kv_memory_path not in PEER_MEMORY_PATHS:
        raise RequestError(f"decoder {hello.node_id}: unknown KV memory path "
                           f"{hello.kv_memory_path!r}, expected one of {PEER_MEMORY_PATHS[1:]}")
    kv = [MemoryRegionDescriptor.from_bytes(d) for d in hello.kv_descriptors]
    context = MemoryRegionDescriptor.from_bytes(hello.context_descriptor)
    page_nbytes = geometry.page_nbytes(sharding.heads_per_rank)
    layer_nbytes, rest = divmod(kv[0].length, num_layers)
    peer_pages, rest2 = divmod(layer_nbytes, page_nbytes)
    if rest or rest2 or peer_pages == 0 or any(d.length != kv[0].length for d in kv):
        raise RequestError(f"decoder {hello.node_id}: KV regions of {kv[0].length} bytes "
                           f"are not {num_layers} layers of whole {page_nbytes}-byte pages")
    return DecoderPeer(hello.node_id, channel, kv, context, sharding, peer_pages,
                       context.length // slot_nbytes, page_nbytes, layer_nbytes,
                       hello.kv_memory_path, bool(hello.draft_kv_descriptor))


def stage_out_layer(kv: list[RegisteredKV], plan: list[PlannedWrite], layer: int) -> int:
    """Copy the pages `plan` sends of `layer` into the host shadow of every staged rank they
    are read from, one copy call per rank; returns the bytes copied (0 unless staged)."""
    pages: dict[int, list[int]] = {}
    for write in plan:
        for rank in {w.src_rank for w in write.transfer.page_writes}:
            if kv[rank].staged:
                pages.setdefault(rank, []).extend(write.src_page_ids)
    copied = 0
    for rank, page_ids in pages.items():
        before = kv[rank].staged_bytes
        kv[rank].stage_out(layer, page_ids)
        copied += kv[rank].staged_bytes - before
    return copied


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


def trace_transfer(tracer: Tracer, t: Transfer) -> None:
    """An ended transfer's spans: queued, prefilling, then the writes' tail (the TTFT split)."""
    ids = {"request_id": t.request_id, "decoder": t.peer.peer_id}
    scheduled = t.first_scheduled_at or t.done_at
    last_layer = t.last_layer_at or t.done_at
    tracer.complete("queue", t.received_at, scheduled, **ids)
    tracer.complete("prefill", scheduled, last_layer, **ids)
    tracer.complete("transfer_tail", last_layer, t.done_at, error=t.error, **ids)


@dataclass
class PendingKV:
    """A request waiting for its KV: the decoder-side transfer context."""

    request: Request
    imm: int
    context_slot: int
    expected_writes: int
    prefiller: int  # index into the messenger's prefiller list
    started_at: float = 0.0  # time.monotonic() when the prefiller was asked
    deadline: float = float("inf")  # time.monotonic() by which the KV must have arrived
    cancel: Verdict | None = None  # what happens once the Cancel sent is answered
    cancel_deadline: float = float("inf")  # by when the prefiller must have answered it
    nonce: int = 0  # sent with the request; its context slot must carry it back (S5)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to a request this poll: `RUNNING` (released, with its receipt),
    `WAITING_FOR_KV` (retried), `FINISHED_FAILED` or `FINISHED_ABORTED`."""

    request: Request
    state: RequestState
    cause: FailureCause | None = None
    detail: str = ""
    receipt: KVReceipt | None = None


@dataclass(frozen=True, slots=True)
class KVReceipt:
    """What one request's KV transfer took, as the decoder saw it."""

    writes: int
    nbytes: int
    wait_ms: float  # from asking the prefiller to the counter firing (prefill included)
