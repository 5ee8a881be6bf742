"""The control messages of routers and nodes (S2): requests in, events out, liveness, shutdown.

What a front door sends a decoder (`Submit`, `Abort`), what it hears back (`RequestEvent`,
`Status`), and what any two nodes exchange (`Heartbeat`, `Reject`, `Shutdown`). The framing is
`framing.py`; the messengers' own messages are in `disagg.kv_transfer.messages`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from disagg.control.framing import NATURAL, POSITIVE, Bounds, Message, register
from disagg.engine.request import FailureCause, RequestState


@register
@dataclass(frozen=True, slots=True)
class Reject(Message):
    """The sender refuses the connection or a message, and says why; it may then close."""

    TYPE: ClassVar[int] = 3
    reason: str


@register
@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Either direction, every second or so: "I am alive" (peer liveness, X4)."""

    TYPE: ClassVar[int] = 7



# Router <-> decoder.

@register
@dataclass(frozen=True, slots=True)
class Submit(Message):
    """Router -> decoder: serve this prompt."""

    TYPE: ClassVar[int] = 10
    BOUNDS: ClassVar[dict[str, Bounds]] = {"prompt_token_ids": NATURAL, "max_tokens": POSITIVE,
                                              "temperature": NATURAL, "top_p": (0, 1),
                                              "top_k": (-1, None), "seed": (-1, 2**63 - 1),
                                              "stop_token_ids": NATURAL, "min_tokens": NATURAL,
                                              "logit_bias_ids": NATURAL, "logprobs": (-1, None),
                                              "n": POSITIVE}
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = -1  # -1: unseeded
    ignore_eos: bool = False  # generate max_tokens whatever the model says (load generators)
    # What shapes the logits before sampling (`SamplingParams` checks their ranges).
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias_ids: list[int] = field(default_factory=list)  # with the bias of each, in order
    logit_bias_values: list[float] = field(default_factory=list)
    logprobs: int = -1  # -1: none; k: the chosen token's logprob and the top k's
    n: int = 1  # parallel samples: forked from one prefill on the decoder
    guide_kind: str = ""  # structured output: a `GuideKind` value, "" for none
    guide_spec: str = ""  # ... and its schema, regex, choices or grammar
    guide_strict: bool = True  # json_schema: refuse keywords the grammar cannot enforce
    traceparent: str = ""  # W3C trace context of the caller's span, "" for none (X7a)


@register
@dataclass(frozen=True, slots=True)
class RequestEvent(Message):
    """Decoder -> router: a request changed state or produced tokens."""

    TYPE: ClassVar[int] = 11
    BOUNDS: ClassVar[dict[str, Bounds]] = {
        "token_ids": NATURAL, "kv_writes_received": NATURAL, "kv_writes": NATURAL,
        "kv_bytes": NATURAL, "kv_wait_ms": NATURAL, "num_draft_tokens": NATURAL,
        "num_accepted_tokens": NATURAL, "num_cached_tokens": NATURAL, "index": NATURAL,
        "top_logprob_ids": NATURAL}
    request_id: str
    state: RequestState
    token_ids: list[int] = field(default_factory=list)
    kv_writes_received: int = 0  # while waiting for KV: writes landed so far
    kv_writes: int = 0  # once decoding: writes the request's KV took (pages x layers + 1)
    kv_bytes: int = 0  # ... and their bytes
    kv_wait_ms: float = 0.0  # ... and the time from asking a prefiller to the counter firing
    cause: FailureCause | None = None  # why it failed, was retried or aborted
    detail: str = ""
    num_draft_tokens: int = 0  # speculative decoding so far: drafts verified (S8)
    num_accepted_tokens: int = 0  # ... and accepted
    num_cached_tokens: int = 0  # prompt tokens found in the decoder's prefix cache
    index: int = 0  # which of the request's `n` parallel samples this is about
    # With Submit.logprobs >= 0: each of `token_ids`' log probability, and the top k ids and
    # theirs, k per token in order.
    logprobs: list[float] = field(default_factory=list)
    top_logprob_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@register
@dataclass(frozen=True, slots=True)
class Status(Message):
    """Decoder -> router, on connect and on every change: whether it takes new requests (a
    decoder with prefillers but none alive does not, until one is back)."""

    TYPE: ClassVar[int] = 9
    accepting: bool
    reason: str = ""


@register
@dataclass(frozen=True, slots=True)
class Abort(Message):
    """Router -> decoder: the client gave up on this request (or on one of its `n` choices:
    one that met a stop string)."""

    TYPE: ClassVar[int] = 13
    BOUNDS: ClassVar[dict[str, Bounds]] = {"index": (-1, None)}
    request_id: str
    index: int = -1  # -1: every choice


@register
@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    """Ask a node to finish and exit."""

    TYPE: ClassVar[int] = 12
