"""Typed, versioned frames of the control plane (S2): the codec every message goes through.

Control only: KV pages and context travel as RDMA writes, never here. A frame is a fixed
header (magic, protocol version, message type, payload length) and a JSON payload whose fields
are checked against the message's declared types and bounds on decode, so a malformed,
truncated or foreign frame is a `ProtocolError` naming the problem, never a half-built object.
No pickle. States and failure causes travel as the values of `RequestState` and
`FailureCause`; a value outside the enum is a protocol error too.

A message class joins the protocol with `@register`: the router/node messages live in
`control/messages.py`, the messengers' own (handshake, KV requests) in
`kv_transfer/messages.py`, which this package never imports. A process decodes the types of the
modules it imported, so a front door refuses a KV message as an unknown type.
"""

from __future__ import annotations

import base64
import enum
import json
import math
import struct
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, TypeVar

from disagg.engine.request import FailureCause, RequestState
from disagg.errors import InvalidMessage, ProtocolError

# 4: Submit's logits processors, logprobs, n and guide, RequestEvent's logprobs and index;
# 3: the handshake proof (HelloProof), KVRequest.nonce; the channel preface
PROTOCOL_VERSION = 4
MAGIC = b"DG"
HEADER = struct.Struct("!2sBBI")  # magic, version, type (| TAGGED), payload length
TAGGED = 0x80  # set in the type byte when an HMAC tag follows the payload
MAX_PAYLOAD = 64 << 20

# Numeric bounds, checked on decode after the types: (lowest, highest) inclusive, None for no
# bound; for a list, every element. A value outside is a ProtocolError naming the field, so a
# hostile or broken peer's message fails alone, never deep inside the node that took it.
Bounds = tuple[float | None, float | None]
POSITIVE, NATURAL, U32, U64 = (1, None), (0, None), (0, 2**32 - 1), (0, 2**64 - 1)


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every message: subclasses set `TYPE`, declare fields with plain types and may
    bound numeric fields in `BOUNDS`."""

    TYPE: ClassVar[int] = 0
    BOUNDS: ClassVar[dict[str, Bounds]] = {}


MESSAGE_TYPES: dict[int, type[Message]] = {}
M = TypeVar("M", bound=Message)


def register(cls: type[M]) -> type[M]:
    """Make `cls` decodable; each type id names one class."""
    if not 0 < cls.TYPE < TAGGED:
        raise ValueError(f"{cls.__name__}: type id {cls.TYPE} outside 1..{TAGGED - 1}")
    other = MESSAGE_TYPES.setdefault(cls.TYPE, cls)
    if other is not cls:
        raise ValueError(f"{cls.__name__}: type id {cls.TYPE} is {other.__name__}'s")
    return cls


_JSON_TYPES = {"str": str, "int": int, "float": (int, float), "bytes": str, "bool": bool,
               "list[int]": list, "list[float]": list, "list[bytes]": list}
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
    for name, (low, high) in cls.BOUNDS.items():
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
    if type_name == "list[float]" and not bad:
        bad = not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        if not bad and not all(math.isfinite(v) for v in value):
            raise ProtocolError(f"{message}.{name}: not every number is finite")
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
    if type_name == "list[float]":
        return [float(v) for v in value]
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


