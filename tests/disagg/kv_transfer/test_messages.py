"""Control messages: round trips, and a clear ProtocolError for every kind of bad frame (S2)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.control.framing import HEADER, MAGIC, PROTOCOL_VERSION, decode, encode
from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import FailureCause, RequestState
from disagg.errors import InvalidMessage, ProtocolError
from disagg.kv_transfer.messages import Hello, KVFailed, KVRequest


def frame(type_id: int, payload: object, version: int = PROTOCOL_VERSION,
          magic: bytes = MAGIC) -> bytes:
    body = json.dumps(payload).encode()
    return HEADER.pack(magic, version, type_id, len(body)) + body


def test_round_trip_keeps_every_field() -> None:
    """Encode then decode gives the same message, bytes fields included."""
    hello = Hello("d0", "tiny-abc", "float32", 16, "HND", 2, 4, 8, b"\x00addr", [b"kv0", b"kv1"],
                  b"ctx", 4096, tp=2, replicated_kv=True)
    request = KVRequest("r1", 7, 8, [1, 2, 3], [9, 4], 2)
    assert decode(encode(hello)) == hello
    assert decode(encode(request)) == request


def test_states_and_causes_travel_as_enums() -> None:
    """On the wire a state or cause is its enum value; it decodes to the enum member."""
    event = RequestEvent("r1", RequestState.FINISHED_FAILED, cause=FailureCause.DEADLINE,
                         detail="no KV in 5 s")
    frame_bytes = encode(event)
    assert b'"state":"finished_failed"' in frame_bytes
    assert decode(frame_bytes) == event
    assert decode(encode(KVFailed("r1", FailureCause.WRITE_FAILED, "EIO", 3))).cause is \
        FailureCause.WRITE_FAILED


@pytest.mark.parametrize(("payload", "message"), [
    ({"request_id": "r", "state": "failed"}, "RequestEvent.state: 'failed' is not a RequestState"),
    ({"request_id": "r", "state": "running", "cause": "gremlins"},
     "RequestEvent.cause: 'gremlins' is not a FailureCause"),
    ({"request_id": "r", "state": 3}, "RequestEvent.state: 3 is not a RequestState"),
])
def test_unknown_state_or_cause_is_refused(payload: dict[str, object], message: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(message)):
        decode(frame(RequestEvent.TYPE, payload))


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


def test_hello_carries_the_kv_memory_path() -> None:
    """The decoder's KV memory path round trips; an older decoder's Hello, without it, reads
    as "" (unknown); a non-string path is refused."""
    hello = Hello("d", "m", "f", 1, "NHD", 1, 1, 2, b"a", [b"b"], b"c", 1,
                  kv_memory_path="staged")
    assert decode(encode(hello)).kv_memory_path == "staged"
    payload = json.loads(encode(hello)[HEADER.size:])
    del payload["kv_memory_path"]
    assert decode(frame(Hello.TYPE, payload)).kv_memory_path == ""
    payload["kv_memory_path"] = 1
    with pytest.raises(ProtocolError, match="kv_memory_path: expected str"):
        decode(frame(Hello.TYPE, payload))


def test_defaults_may_be_omitted() -> None:
    """Optional fields (sampling parameters) take their defaults when absent."""
    submit = decode(frame(10, {"request_id": "r", "prompt_token_ids": [1], "max_tokens": 3}))
    assert submit == Submit("r", [1], 3)


VALID_FRAMES = [
    encode(Hello("d0", "m", "float32", 16, "HND", 2, 4, 8, b"addr", [b"kv"], b"ctx", 64, 2)),
    encode(KVRequest("r1", 7, 8, [1, 2, 3], [9, 4], 2)),
    encode(Submit("r", [5, 6], 3, 0.5, 0.9, 4, 1)),
]


@settings(max_examples=600, deadline=None)
@given(data=st.binary(max_size=300))
def test_fuzz_random_bytes_only_raise_protocol_errors(data: bytes) -> None:
    """Arbitrary bytes never crash the decoder: a message or a ProtocolError, nothing else."""
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=600, deadline=None)
@given(frame=st.sampled_from(VALID_FRAMES), position=st.integers(0, 10_000),
       byte=st.integers(0, 255), cut=st.integers(0, 10_000))
def test_fuzz_mutated_frames_only_raise_protocol_errors(frame: bytes, position: int, byte: int,
                                                        cut: int) -> None:
    """A valid frame with one byte changed, or cut short, decodes or fails cleanly."""
    mutated = bytearray(frame)
    mutated[position % len(mutated)] = byte
    for candidate in (bytes(mutated), frame[: cut % len(frame)]):
        try:
            decode(candidate)
        except ProtocolError:
            pass


SUBMIT = {"request_id": "r1", "prompt_token_ids": [1, 2], "max_tokens": 4}


@pytest.mark.parametrize(("kind", "payload", "field"), [
    (Submit, {**SUBMIT, "max_tokens": 0}, "Submit.max_tokens"),
    (Submit, {**SUBMIT, "seed": 2**70}, "Submit.seed"),
    (Submit, {**SUBMIT, "temperature": -1.0}, "Submit.temperature"),
    (Submit, {**SUBMIT, "top_p": 1.5}, "Submit.top_p"),
    (Submit, {**SUBMIT, "prompt_token_ids": [1, -2]}, "Submit.prompt_token_ids"),
    (KVRequest, {"request_id": "r1", "imm": 2**32, "tail_imm": 6, "prompt_token_ids": [1, 2],
                 "dst_page_ids": [0], "context_slot": 0}, "KVRequest.imm"),
    (KVRequest, {"request_id": "r1", "imm": 5, "tail_imm": -1, "prompt_token_ids": [1, 2],
                 "dst_page_ids": [0], "context_slot": 0}, "KVRequest.tail_imm"),
    (KVRequest, {"request_id": "r1", "imm": 5, "tail_imm": 6, "prompt_token_ids": [1, 2],
                 "dst_page_ids": [-1], "context_slot": 0}, "KVRequest.dst_page_ids"),
    (KVRequest, {"request_id": "r1", "imm": 5, "tail_imm": 6, "prompt_token_ids": [1, 2],
                 "dst_page_ids": [0], "context_slot": 0, "attempt": 0}, "KVRequest.attempt"),
    (RequestEvent, {"request_id": "r1", "state": "running", "kv_bytes": -5},
     "RequestEvent.kv_bytes"),
])
def test_values_out_of_range_are_refused_naming_the_field(kind: type, payload: dict,
                                                          field: str) -> None:
    """Each of these used to be decoded, then crash the node that took it (max_tokens 0,
    seed 2**70) or corrupt its books; now the message alone is refused, with its request id."""
    with pytest.raises(InvalidMessage, match=re.escape(field) + ".* is outside") as error:
        decode(frame(kind.TYPE, payload))
    assert error.value.request_id == "r1"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_json_constants_that_are_no_numbers_are_refused(constant: str) -> None:
    """Python's json reads them (the old decoder then crashed on a NaN temperature)."""
    body = json.dumps(SUBMIT)[:-1].encode() + f', "temperature": {constant}}}'.encode()
    with pytest.raises(InvalidMessage, match="Submit.temperature: .* is not a finite number"):
        decode(HEADER.pack(MAGIC, PROTOCOL_VERSION, Submit.TYPE, len(body)) + body)
