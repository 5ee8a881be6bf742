"""Typed, versioned control messages between router, decoders and prefillers (S2).

Control only: KV pages and context travel as RDMA writes, never here. A frame is a fixed
header (magic, protocol version, message type, payload length) and a JSON payload whose fields
are checked against the message's declared types on decode, so a malformed, truncated or
foreign frame is a `ProtocolError` naming the problem, never a half-built object. No pickle.
States and failure causes travel as the values of `RequestState` and `FailureCause`; a value
outside the enum is a protocol error too.
"""

from __future__ import annotations

import base64
import enum
import json
import math
import struct
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar

from disagg.engine.request import FailureCause, RequestState
from disagg.errors import InvalidMessage, ProtocolError

PROTOCOL_VERSION = 3  # 3: the handshake proof (HelloProof), KVRequest.nonce; the channel preface
MAGIC = b"DG"
HEADER = struct.Struct("!2sBBI")  # magic, version, type (| TAGGED), payload length
TAGGED = 0x80  # set in the type byte when an HMAC tag follows the payload
MAX_PAYLOAD = 64 << 20


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every message: subclasses set `TYPE` and declare fields with plain types."""

    TYPE: ClassVar[int] = 0


# Handshake (decoder -> prefiller, prefiller -> decoder).

@dataclass(frozen=True, slots=True)
class Hello(Message):
    """A decoder introduces itself: what it runs, where its KV and context buffers are."""

    TYPE: ClassVar[int] = 1
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


@dataclass(frozen=True, slots=True)
class HelloAck(Message):
    """The prefiller accepts: here is its fabric address."""

    TYPE: ClassVar[int] = 2
    node_id: str
    engine_address: bytes
    tp: int = 1  # the prefiller's sharding: the decoder needs it to count writes (S6b)
    replicated_kv: bool = False


@dataclass(frozen=True, slots=True)
class HelloProof(Message):
    """The decoder echoes the nonce the prefiller wrote into its proof slot after Hello: it owns
    the memory its Hello named. The prefiller takes no request before this (S5)."""

    TYPE: ClassVar[int] = 8
    nonce: int


@dataclass(frozen=True, slots=True)
class Reject(Message):
    """The sender refuses the connection or a message, and says why; it may then close."""

    TYPE: ClassVar[int] = 3
    reason: str


# Requests between messengers.

@dataclass(frozen=True, slots=True)
class KVRequest(Message):
    """Decoder -> prefiller: prefill these tokens and write their KV into my pages (S2a)."""

    TYPE: ClassVar[int] = 4
    request_id: str
    imm: int  # carried by every write of this request; the decoder counts it (S4c)
    prompt_token_ids: list[int]  # the whole prompt; the prefiller computes all but the last
    dst_page_ids: list[int]  # one per page of the prefilled tokens, the held ones included
    context_slot: int
    # Prompt tokens whose KV the decoder holds already (whole pages from its prefix cache): the
    # prefiller writes only the pages after them, and the checksum covers only those.
    num_cached_tokens: int = 0
    attempt: int = 1  # a retry (2, ...) is computed afresh: the KV sent before was wrong or lost
    nonce: int = 0  # random, 64-bit: packed next to the KV checksum, which the decoder checks


@dataclass(frozen=True, slots=True)
class KVFailed(Message):
    """Prefiller -> decoder: this request's KV will not (all) arrive.

    Sent only once the prefiller has no write of the request in flight. `writes_posted` is how
    many of its writes completed at the sender: once the decoder has counted that many arrivals,
    no write of the request can still land, and its pages may be reused (the counted fence).
    -1 means the prefiller does not know the request.
    """

    TYPE: ClassVar[int] = 5
    request_id: str
    cause: FailureCause
    reason: str
    writes_posted: int = -1


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    """Decoder -> prefiller: drop this request (its writes may still be in flight)."""

    TYPE: ClassVar[int] = 6
    request_id: str


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Either direction, every second or so: "I am alive" (peer liveness, issue 8)."""

    TYPE: ClassVar[int] = 7


# Router <-> decoder.

@dataclass(frozen=True, slots=True)
class Submit(Message):
    """Router -> decoder: serve this prompt."""

    TYPE: ClassVar[int] = 10
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = -1  # -1: unseeded
    ignore_eos: bool = False  # generate max_tokens whatever the model says (load generators)


@dataclass(frozen=True, slots=True)
class RequestEvent(Message):
    """Decoder -> router: a request changed state or produced tokens."""

    TYPE: ClassVar[int] = 11
    request_id: str
    state: RequestState
    token_ids: list[int] = field(default_factory=list)
    kv_writes_received: int = 0  # while waiting for KV: writes landed so far
    kv_writes: int = 0  # once decoding: writes the request's KV took (pages x layers + 1)
    kv_bytes: int = 0  # ... and their bytes
    kv_wait_ms: float = 0.0  # ... and the time from asking a prefiller to the counter firing
    cause: FailureCause | None = None  # why it failed, was retried or aborted
    detail: str = ""
    num_draft_tokens: int = 0  # speculative decoding so far: drafts verified (issue 6)
    num_accepted_tokens: int = 0  # ... and accepted
    num_cached_tokens: int = 0  # prompt tokens found in the decoder's prefix cache


@dataclass(frozen=True, slots=True)
class Status(Message):
    """Decoder -> router, on connect and on every change: whether it takes new requests (a
    decoder with prefillers but none alive does not, until one is back)."""

    TYPE: ClassVar[int] = 9
    accepting: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Abort(Message):
    """Router -> decoder: the client gave up on this request."""

    TYPE: ClassVar[int] = 13
    request_id: str


@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    """Ask a node to finish and exit."""

    TYPE: ClassVar[int] = 12


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, HelloAck, HelloProof, Reject, KVRequest, KVFailed, Cancel,
                              Heartbeat, Submit, RequestEvent, Status, Abort, Shutdown)
}
# Numeric bounds, checked on decode after the types: (lowest, highest) inclusive, None for no
# bound; for a list, every element. A value outside is a ProtocolError naming the field, so a
# hostile or broken peer's message fails alone, never deep inside the node that took it.
Bounds = tuple[float | None, float | None]
POSITIVE, NATURAL, U32, U64 = (1, None), (0, None), (0, 2**32 - 1), (0, 2**64 - 1)
BOUNDS: dict[int, dict[str, Bounds]] = {
    Hello.TYPE: {"page_size": POSITIVE, "num_layers": POSITIVE, "num_kv_heads": POSITIVE,
                 "head_dim": POSITIVE, "context_slot_nbytes": POSITIVE, "tp": POSITIVE},
    HelloAck.TYPE: {"tp": POSITIVE},
    HelloProof.TYPE: {"nonce": U64},
    KVRequest.TYPE: {"imm": U32, "prompt_token_ids": NATURAL, "dst_page_ids": NATURAL,
                     "context_slot": NATURAL, "num_cached_tokens": NATURAL, "attempt": POSITIVE,
                     "nonce": U64},
    KVFailed.TYPE: {"writes_posted": (-1, None)},
    Submit.TYPE: {"prompt_token_ids": NATURAL, "max_tokens": POSITIVE, "temperature": NATURAL,
                  "top_p": (0, 1), "top_k": (-1, None), "seed": (-1, 2**63 - 1)},
    RequestEvent.TYPE: {"token_ids": NATURAL, "kv_writes_received": NATURAL,
                        "kv_writes": NATURAL, "kv_bytes": NATURAL, "kv_wait_ms": NATURAL,
                        "num_draft_tokens": NATURAL, "num_accepted_tokens": NATURAL,
                        "num_cached_tokens": NATURAL},
}
_JSON_TYPES = {"str": str, "int": int, "float": (int, float), "bytes": str, "bool": bool,
               "list[int]": list, "list[bytes]": list}
_ENUMS: dict[str, type[enum.Enum]] = {"RequestState": RequestState,
                                      "FailureCause": FailureCause}


def encode(message: Message, tagged: bool = False) -> bytes:
    """A whole frame: header plus JSON payload (bytes fields in base64). With `tagged`, the
    header announces an authentication tag, which the caller appends."""
    payload = {}
    for f in fields(message):
        value = getattr(message, f.name)
        if f.type == "bytes":
            value = base64.b64encode(value).decode()
        elif f.type == "list[bytes]":
            value = [base64.b64encode(item).decode() for item in value]
        elif isinstance(value, enum.Enum):
            value = value.value
        payload[f.name] = value
    body = json.dumps(payload, separators=(",", ":")).encode()
    type_byte = message.TYPE | (TAGGED if tagged else 0)
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, type_byte, len(body)) + body


def decode_header(header: bytes) -> tuple[type[Message], int, bool]:
    """Message class, payload length and whether a tag follows; refuses foreign frames."""
    if len(header) != HEADER.size:
        raise ProtocolError(f"truncated header: {len(header)} of {HEADER.size} bytes")
    magic, version, type_byte, length = HEADER.unpack(header)
    type_id, tagged = type_byte & ~TAGGED, bool(type_byte & TAGGED)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a disagg control frame")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, this node speaks {PROTOCOL_VERSION}")
    if type_id not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {type_id}")
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {length} bytes exceeds the {MAX_PAYLOAD} byte limit")
    return MESSAGE_TYPES[type_id], length, tagged


def decode_payload(cls: type[Message], body: bytes) -> Message:
    """Build `cls` from a JSON payload, checking every field's presence and type."""
    try:
        payload = json.loads(body)  # NaN and Infinity parse, to be refused by field below
    except (ValueError, RecursionError) as error:
        # ValueError: not UTF-8, not JSON, or an integer past Python's digit limit;
        # RecursionError: nesting deeper than the parser's stack (a hostile payload).
        raise InvalidMessage(f"{cls.__name__}: payload is not JSON ({error})") from None
    if not isinstance(payload, dict):
        raise InvalidMessage(f"{cls.__name__}: payload is not an object")
    request_id = payload.get("request_id")
    try:
        return _build(cls, payload)
    except ProtocolError as error:
        raise InvalidMessage(str(error), request_id if isinstance(request_id, str) else None
                             ) from None


def _build(cls: type[Message], payload: dict[str, Any]) -> Message:
    declared = {f.name: f for f in fields(cls)}
    unknown = set(payload) - set(declared)
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    values: dict[str, Any] = {}
    for name, f in declared.items():
        if name not in payload:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise ProtocolError(f"{cls.__name__}: missing field {name!r}")
        values[name] = _check_field(cls.__name__, name, f.type, payload[name])
    for name, (low, high) in BOUNDS.get(cls.TYPE, {}).items():
        _check_bounds(cls.__name__, name, values.get(name), low, high)
    try:
        return cls(**values)
    except TypeError as error:
        raise ProtocolError(f"{cls.__name__}: {error}") from None


def decode(frame: bytes) -> Message:
    """Decode one whole frame (header and payload)."""
    cls, length, _ = decode_header(frame[:HEADER.size])
    body = frame[HEADER.size:]
    if len(body) != length:
        raise ProtocolError(f"{cls.__name__}: payload of {len(body)} bytes, header says {length}")
    return decode_payload(cls, body)


def _check_field(message: str, name: str, type_name: str, value: Any) -> Any:
    optional = type_name.endswith(" | None")
    if optional and value is None:
        return None
    type_name = type_name.removesuffix(" | None")
    if type_name in _ENUMS:
        try:
            return _ENUMS[type_name](value)
        except ValueError:
            raise ProtocolError(f"{message}.{name}: {value!r} is not a {type_name}") from None
    expected = _JSON_TYPES[type_name]
    bad = not isinstance(value, expected) or (isinstance(value, bool) and type_name != "bool")
    if type_name == "list[int]" and not bad:
        bad = not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if type_name == "list[bytes]" and not bad:
        bad = not all(isinstance(v, str) for v in value)
    if bad:
        raise ProtocolError(f"{message}.{name}: expected {type_name}, got {type(value).__name__}")
    if type_name == "bytes":
        return _b64(message, name, value)
    if type_name == "list[bytes]":
        return [_b64(message, name, item) for item in value]
    if type_name == "float" and not math.isfinite(value):
        raise ProtocolError(f"{message}.{name}: {value} is not a finite number")
    return float(value) if type_name == "float" else value


def _check_bounds(message: str, name: str, value: Any, low: float | None,  # noqa: ANN401
                  high: float | None) -> None:
    for item in value if isinstance(value, list) else [value]:
        if item is None:
            continue  # a default: it was not sent
        if (low is not None and item < low) or (high is not None and item > high):
            shown = item if isinstance(value, list) else value
            raise ProtocolError(f"{message}.{name}: {shown!r} is outside "
                                f"[{_bound(low)}, {_bound(high)}]")


def _bound(value: float | None) -> str:
    return "..." if value is None else str(value)


def _b64(message: str, name: str, value: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise ProtocolError(f"{message}.{name}: not base64") from None


def as_dict(message: Message) -> dict[str, Any]:
    """The message's fields (for logs and traces)."""
    return asdict(message)
