"""Control messages: round trips, and a clear ProtocolError for every kind of bad frame (S2)."""

from __future__ import annotations

import json
import re

import pytest

from disagg.errors import ProtocolError
from disagg.messages import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    Hello,
    KVRequest,
    Submit,
    decode,
    encode,
)


def frame(type_id: int, payload: object, version: int = PROTOCOL_VERSION,
          magic: bytes = MAGIC) -> bytes:
    body = json.dumps(payload).encode()
    return HEADER.pack(magic, version, type_id, len(body)) + body


def test_round_trip_keeps_every_field() -> None:
    """Encode then decode gives the same message, bytes fields included."""
    hello = Hello("d0", "tiny-abc", "float32", 16, "HND", 2, 4, 8, b"\x00addr", [b"kv0", b"kv1"],
                  b"ctx", 4096, tp=2, replicated_kv=True)
    request = KVRequest("r1", 7, [1, 2, 3], [9, 4], 2)
    assert decode(encode(hello)) == hello
    assert decode(encode(request)) == request


@pytest.mark.parametrize(("bad", "message"), [
    (frame(10, {"request_id": "r", "prompt_token_ids": [1], "max_tokens": 2}, version=9),
     "protocol version 9"),
    (frame(10, {}, magic=b"XX"), "bad magic"),
    (frame(99, {}), "unknown message type 99"),
    (frame(10, {"request_id": "r", "prompt_token_ids": [1]}), "missing field 'max_tokens'"),
    (frame(10, {"request_id": "r", "prompt_token_ids": ["a"], "max_tokens": 2}),
     "prompt_token_ids: expected list[int]"),
    (frame(10, {"request_id": "r", "prompt_token_ids": [1], "max_tokens": True}),
     "max_tokens: expected int"),
    (frame(10, {"request_id": "r", "prompt_token_ids": [1], "max_tokens": 2, "x": 1}),
     "unknown fields"),
    (frame(10, [1, 2]), "payload is not an object"),
    (HEADER.pack(MAGIC, PROTOCOL_VERSION, 10, 5) + b"{not", "payload of 4 bytes, header says 5"),
    (HEADER.pack(MAGIC, PROTOCOL_VERSION, 10, 4) + b"{no}", "not JSON"),
    (b"DG\x01", "truncated header"),
])
def test_bad_frames_are_refused_with_a_reason(bad: bytes, message: str) -> None:
    """Each malformed frame raises ProtocolError naming what is wrong."""
    with pytest.raises(ProtocolError, match=re.escape(message)):
        decode(bad)


def test_oversized_payload_is_refused_before_reading() -> None:
    """A header announcing a huge payload is refused from the header alone."""
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, 10, 1 << 30)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(header)


def test_bytes_fields_must_be_base64() -> None:
    """A descriptor that is not base64 is a protocol error, not garbage bytes."""
    good = json.loads(encode(Hello("d", "m", "f", 1, "NHD", 1, 1, 2, b"a", [b"b"], b"c", 1))[
        HEADER.size:])
    good["context_descriptor"] = "%%%"
    with pytest.raises(ProtocolError, match="not base64"):
        decode(frame(Hello.TYPE, good))


def test_defaults_may_be_omitted() -> None:
    """Optional fields (sampling parameters) take their defaults when absent."""
    submit = decode(frame(10, {"request_id": "r", "prompt_token_ids": [1], "max_tokens": 3}))
    assert submit == Submit("r", [1], 3)
