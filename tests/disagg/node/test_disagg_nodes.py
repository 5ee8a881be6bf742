"""Prefill and decode nodes in one process (threads), over the real tcp provider (S2, S3, S4).

Faster than spawning processes, so the fault cases and the streaming check run in the inner
loop: a mismatched peer at handshake, pages outside the decoder's region, malformed and
truncated frames, an unknown request id. After each, both nodes still serve a request and end
clean (no page, request, transfer context or armed counter left).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from disagg.config import CacheConfig, SchedulerConfig
from disagg.control.channel import Channel
from disagg.control.framing import HEADER, MAGIC, PROTOCOL_VERSION
from disagg.control.messages import Heartbeat, Message, Reject, Status, Submit
from disagg.engine.request import RequestState
from disagg.errors import PeerMismatchError
from disagg.kv_transfer.handshake import read_proof
from disagg.kv_transfer.messages import Cancel, HelloAck, KVFailed, KVRequest
from disagg.node.builder import build_node
from disagg.node.decode_node import DecodeNode
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.prefill_node import PrefillNode
from disagg.node.router import Router
from disagg.utils.trace import Tracer
from tests.disagg.node.running_nodes import running

pytestmark = pytest.mark.fabric

CACHE = CacheConfig(page_size=4, num_pages=256)


@dataclass
class Pair:
    prefill: PrefillNode
    decode: DecodeNode
    router: Router


def start(node: PrefillNode | DecodeNode) -> threading.Thread:
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    return thread


def recording_tracer(node_id: str) -> Tracer:
    """A tracer that records every span (in memory), so that `check_clean` sees a request
    span left open on any path these tests drive (X7a)."""
    return Tracer(process_name=node_id, exporters=[InMemorySpanExporter()])


def make_prefill(model: str = "tiny", cache: CacheConfig = CACHE,
                 chunk_size: int = 8) -> PrefillNode:
    node = build_node(NodeConfig(model, cache, SchedulerConfig(
        chunk_size=chunk_size, max_num_batched_tokens=chunk_size, mode="prefill_only"),
        role=NodeRole.PREFILL), recording_tracer("prefill-0"))
    assert isinstance(node, PrefillNode)
    return node


def make_decode(prefill: PrefillNode, model: str = "tiny", cache: CacheConfig = CACHE,
                node_id: str = "decode-0") -> DecodeNode:
    node = build_node(NodeConfig(model, cache, SchedulerConfig(chunk_size=8,
                                                               max_num_batched_tokens=8),
                                 role=NodeRole.DECODE, node_id=node_id,
                                 prefillers=(prefill.address,)), recording_tracer(node_id))
    assert isinstance(node, DecodeNode)
    return node


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A prefiller and a decoder (tiny model) in threads, and a router to the decoder."""
    prefill = make_prefill()
    decode = make_decode(prefill)
    with running(prefill, decode) as router:
        yield Pair(prefill, decode, router)


def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    """Poll `predicate` until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.005)


def serve(router: Router, prompt: list[int], request_id: str = "ok", max_tokens: int = 4
          ) -> list[int]:
    """Send one request and wait for its tokens."""
    router.route(Submit(request_id, prompt, max_tokens))
    tokens: list[int] = []
    while True:
        event = router.events.get(timeout=30)
        assert event.request_id == request_id, event
        tokens += event.token_ids
        if event.state.is_terminal():
            assert event.state is not RequestState.FINISHED_FAILED, event.detail
            return tokens


def test_a_request_round_trips(pair: Pair) -> None:
    """A 10-token prompt is prefilled remotely and decoded; both sides end clean."""
    assert len(serve(pair.router, list(range(1, 11)))) == 4


def test_decoder_connection_is_warm_after_handshake(pair: Pair) -> None:
    """Before any request the prefiller has posted one zero-byte write per domain to the
    decoder: the connection tcp would otherwise open in a first request's KV writes. (Plus
    the ownership proof: one 8-byte write per decoder endpoint, S5.)"""
    stats = pair.prefill.transfer.stats()
    proofs = pair.decode.transfer.num_domains
    assert sum(s.writes_posted for s in stats) == len(stats) + proofs
    assert sum(s.writes_completed for s in stats) == len(stats) + proofs
    assert pair.decode.transfer.stats()[0].imms_received == 0  # it counted nothing


def test_mismatched_decoder_is_refused_by_name(pair: Pair) -> None:
    """A decoder with another page size is refused at handshake, naming the field but not
    the prefiller's value; the prefiller keeps serving the good decoder."""
    with pytest.raises(PeerMismatchError, match="page_size: decoder has 8, not what") as error:
        make_decode(pair.prefill, cache=replace(CACHE, page_size=8), node_id="bad")
    assert "4" not in str(error.value).split("page_size")[1]  # the expected value stays home
    assert len(serve(pair.router, [5, 6, 7, 8, 9])) == 4


def next_reply(channel: Channel) -> Message:
    """The next frame that is not a Heartbeat: a node sends one every second or so, and on a
    loaded machine one can come before the answer a test waits for."""
    while isinstance(message := channel.recv(), Heartbeat):
        pass
    return message


def rogue_channel(pair: Pair) -> Channel:
    """A second connection that shakes hands with the decoder's own (valid) descriptors, and
    proves it owns them (it shares the decoder's process, so it reads its proof slot)."""
    channel = Channel.connect(pair.prefill.address)
    channel.send(replace(pair.decode.messenger.hello(), node_id="rogue"))
    assert isinstance(next_reply(channel), HelloAck)
    channel.send(read_proof(pair.decode.messenger.context, pair.decode.transfer.num_domains))
    return channel


def test_pages_outside_the_decoder_region_are_refused(pair: Pair) -> None:
    """A request naming page ids past the decoder's region fails with a reason; no write."""
    channel = rogue_channel(pair)
    channel.send(KVRequest("evil", 12345, 12346, [1, 2, 3, 4, 5, 6], [3, 10**6], 0))
    answer = next_reply(channel)
    assert isinstance(answer, KVFailed)
    assert "outside the decoder's region of 256 pages" in answer.reason
    channel.send(Cancel("never-heard-of-it"))  # an unknown request id is ignored
    channel.close()
    assert len(serve(pair.router, [1, 2, 3, 4, 5, 6])) == 4


def test_malformed_frame_is_rejected_and_connection_closed(pair: Pair) -> None:
    """Garbage after the handshake gets a Reject with the reason, then the prefiller hangs up."""
    channel = rogue_channel(pair)
    channel.sock.sendall(b"XX" + bytes(HEADER.size))
    answer = next_reply(channel)
    assert isinstance(answer, Reject) and "bad magic" in answer.reason
    channel.close()
    assert len(serve(pair.router, [9, 8, 7])) == 4


def test_truncated_frame_from_a_vanishing_peer(pair: Pair) -> None:
    """A peer that dies mid-frame costs the prefiller nothing."""
    channel = rogue_channel(pair)
    assert len(pair.prefill._channels) == 2  # the decoder's and the rogue's
    channel.sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, KVRequest.TYPE, 500) + b"{")
    channel.close()
    wait_until(lambda: len(pair.prefill._channels) == 1,
               "the prefiller's reader ended the vanished peer's connection")
    assert len(serve(pair.router, [4, 4, 4, 4])) == 4


def test_layer_zero_is_posted_before_the_last_layer_runs() -> None:
    """Streaming is real (S3): in one chunk of a 4-layer model, layer 0's page writes are
    posted before the last layer's attention starts, and every layer is posted in order."""
    prefill = make_prefill("small", CacheConfig(page_size=16, num_pages=64), 256)
    last_layer_starts: list[float] = []
    prefill.engine.model.layers[-1].self_attn.register_forward_pre_hook(
        lambda *_: last_layer_starts.append(time.perf_counter()))
    decode = make_decode(prefill, "small", CacheConfig(page_size=16, num_pages=64))
    threads = [start(prefill), start(decode)]
    router = Router([decode.address])
    try:
        assert len(serve(router, list(range(3, 203)))) == 4
        # The decoder's counter fired; the prefiller frees the request on its next poll.
        wait_until(lambda: prefill.messenger.recent, "the prefiller ended the transfer")
        transfer_record = prefill.messenger.recent[-1]
        posts = transfer_record.layer_post_times
        assert [layer for layer, _ in posts] == [0, 1, 2, 3]
        assert len(last_layer_starts) == 1  # one chunk, one forward on the prefiller
        assert posts[0][1] < last_layer_starts[0]
    finally:
        router.close()
        for node in (decode, prefill):
            node.stop()
        for thread in threads:
            thread.join(timeout=10)
        decode.close()
        prefill.close()


def test_a_submit_no_decoder_can_take_fails_alone_and_the_connection_goes_on(
        pair: Pair) -> None:
    """max_tokens 0 and a NaN temperature (JSON the old decoder accepted, then crashed on):
    each such Submit ends FINISHED_FAILED (invalid_request) naming the field, and the same
    router connection then serves a good request."""
    channel = Channel.connect(pair.decode.address)
    assert next_reply(channel) == Status(True)
    body = b'{"request_id": "nan", "prompt_token_ids": [1, 2], "max_tokens": 2, ' \
           b'"temperature": NaN}'
    # The raw frame goes after the first one is answered: sends are queued (X5c), so a raw
    # write could overtake it.
    sends = (lambda: channel.send(Submit("zero", [1, 2, 3], 0)),
             lambda: channel.sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, Submit.TYPE,
                                                      len(body)) + body))
    for send, (request_id, words) in zip(sends, (
            ("zero", "Submit.max_tokens: 0 is outside"),
            ("nan", "Submit.temperature: nan is not a finite number")), strict=True):
        send()
        event = next_reply(channel)
        assert (event.request_id, event.state) == (request_id, RequestState.FINISHED_FAILED)
        assert words in event.detail
    channel.send(Submit("good", [4, 5, 6], 3))
    tokens = []
    while not (event := next_reply(channel)).state.is_terminal():
        tokens += event.token_ids
    assert (event.state, len(tokens + event.token_ids)) == (RequestState.FINISHED_LENGTH, 3)
    channel.close()
