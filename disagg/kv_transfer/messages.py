"""The messengers' messages (S2a, S4b, S5): the handshake and the requests for KV.

A decoder introduces itself (`Hello`), the prefiller accepts (`HelloAck`) and the decoder
proves it owns the memory it named (`HelloProof`, `handshake.py`). Then the decoder asks for
KV (`KVRequest`), may drop a request (`Cancel`), and hears of a request whose KV will not all
arrive (`KVFailed`). Framed and checked like every control message (`disagg.control.framing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from disagg.control.framing import NATURAL, POSITIVE, U32, U64, Bounds, Message, register
from disagg.engine.request import FailureCause

# Handshake (decoder -> prefiller, prefiller -> decoder).

@register
@dataclass(frozen=True, slots=True)
class Hello(Message):
    """A decoder introduces itself: what it runs, where its KV and context buffers are."""

    TYPE: ClassVar[int] = 1
    BOUNDS: ClassVar[dict[str, Bounds]] = {
        "page_size": POSITIVE, "num_layers": POSITIVE, "num_kv_heads": POSITIVE,
        "head_dim": POSITIVE, "context_slot_nbytes": POSITIVE, "tp": POSITIVE}
    node_id: str
    model: str  # a fingerprint of the model's shape and weights
    dtype: str
    page_size: int
    kv_layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    engine_address: bytes
    kv_descriptors: list[bytes]  # one memory region per TP rank (S5a)
    context_descriptor: bytes
    context_slot_nbytes: int
    tp: int = 1
    replicated_kv: bool = False
    draft_kv_descriptor: bytes = b""  # the MTP head's cache, if the decoder drafts with one
    kv_memory_path: str = ""  # how the decoder's NIC reaches its KV: host, hmem or staged


@register
@dataclass(frozen=True, slots=True)
class HelloAck(Message):
    """The prefiller accepts: here is its fabric address."""

    TYPE: ClassVar[int] = 2
    BOUNDS: ClassVar[dict[str, Bounds]] = {"tp": POSITIVE}
    node_id: str
    engine_address: bytes
    tp: int = 1  # the prefiller's sharding: the decoder needs it to count writes (S6b)
    replicated_kv: bool = False


@register
@dataclass(frozen=True, slots=True)
class HelloProof(Message):
    """The decoder echoes the nonce the prefiller wrote into its proof slot after Hello: it owns
    the memory its Hello named. The prefiller takes no request before this (S5)."""

    TYPE: ClassVar[int] = 8
    BOUNDS: ClassVar[dict[str, Bounds]] = {"nonce": U64}
    nonce: int


# Requests between messengers.

@register
@dataclass(frozen=True, slots=True)
class KVRequest(Message):
    """Decoder -> prefiller: prefill these tokens and write their KV into my pages (S2a)."""

    TYPE: ClassVar[int] = 4
    BOUNDS: ClassVar[dict[str, Bounds]] = {
        "imm": U32, "tail_imm": U32, "prompt_token_ids": NATURAL, "dst_page_ids": NATURAL,
        "context_slot": NATURAL, "num_cached_tokens": NATURAL, "attempt": POSITIVE, "nonce": U64}
    request_id: str
    # The decoder counts the request's writes under two values (S4c): `imm` for its pages in
    # every layer but the last (the body, checked while the last layer is computed), `tail_imm`
    # for the last layer's pages, a draft head's and the context slot.
    imm: int
    tail_imm: int
    prompt_token_ids: list[int]  # the whole prompt; the prefiller computes all but the last
    dst_page_ids: list[int]  # one per page of the prefilled tokens, the held ones included
    context_slot: int
    # Prompt tokens whose KV the decoder holds already (whole pages from its prefix cache): the
    # prefiller writes only the pages after them, and the checksum covers only those.
    num_cached_tokens: int = 0
    attempt: int = 1  # a retry (2, ...) is computed afresh: the KV sent before was wrong or lost
    nonce: int = 0  # random, 64-bit: packed next to the KV checksum, which the decoder checks
    traceparent: str = ""  # W3C trace context of the decoder's span of the request (X7a)


@register
@dataclass(frozen=True, slots=True)
class KVFailed(Message):
    """Prefiller -> decoder: this request's KV will not (all) arrive.

    Sent only once the prefiller has no write of the request in flight. `writes_posted` is how
    many of its writes under `imm` completed at the sender, `tail_writes_posted` under
    `tail_imm`: once the decoder has counted that many arrivals of each, no write of the
    request can still land, and its pages may be reused (the counted fence). -1 means the
    prefiller does not know the request (or what landed).
    """

    TYPE: ClassVar[int] = 5
    BOUNDS: ClassVar[dict[str, Bounds]] = {"writes_posted": (-1, None),
                                           "tail_writes_posted": (-1, None)}
    request_id: str
    cause: FailureCause
    reason: str
    writes_posted: int = -1
    tail_writes_posted: int = -1


@register
@dataclass(frozen=True, slots=True)
class Cancel(Message):
    """Decoder -> prefiller: drop this request (its writes may still be in flight)."""

    TYPE: ClassVar[int] = 6
    request_id: str
