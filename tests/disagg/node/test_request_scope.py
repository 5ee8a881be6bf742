"""Requests belong to the router connection that submitted them (X5d), and no connection can
hold the decoder (X5c): a colliding id fails on its own connection only, only the submitter
aborts, a connection that ends has its requests aborted, and one that stops reading is cut off
while the decoder serves everyone else. A prefiller and a decoder in threads, over tcp and
libfabric; the fixture checks at the end that no request, page or counter is left."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from disagg.control import outbox
from disagg.control.channel import Channel
from disagg.control.messages import Abort, Heartbeat, Reject, RequestEvent, Status, Submit
from disagg.engine.request import FailureCause, RequestState
from disagg.errors import RequestError
from tests.disagg.node.running_nodes import running
from tests.disagg.node.test_disagg_nodes import Pair, make_decode, make_prefill, serve, wait_until


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    # A short send deadline, so the test of a peer that stops reading is short too.
    monkeypatch.setattr(outbox, "SEND_DEADLINE_S", 1.0)
    prefill = make_prefill()
    decode = make_decode(prefill)
    with running(prefill, decode) as router:
        yield Pair(prefill, decode, router)


def open_router(pair: Pair) -> Channel:
    channel = Channel.connect(pair.decode.address)
    assert channel.recv() == Status(True)  # what a decoder tells every router first
    return channel


def next_event(channel: Channel, timeout_s: float = 15.0) -> RequestEvent | Reject:
    """The next event or Reject (past the heartbeats); one that never comes fails the test."""
    deadline = time.monotonic() + timeout_s
    while not isinstance(message := channel.recv(), RequestEvent | Reject):
        assert time.monotonic() < deadline, f"no event or Reject within {timeout_s:g} s"
    return message


def finish(pair: Pair, request_id: str, tokens: list[int]) -> RequestEvent:
    while True:
        event = pair.router.events.get(timeout=30)
        assert event.request_id == request_id, event
        tokens += event.token_ids
        if event.state.is_terminal():
            return event


def started(pair: Pair, request_id: str, max_tokens: int) -> list[int]:
    """Route a request and wait until it decodes; its tokens so far."""
    pair.router.route(Submit(request_id, list(range(1, 11)), max_tokens))
    tokens: list[int] = []
    while not tokens:
        event = pair.router.events.get(timeout=30)
        assert not event.state.is_terminal(), event
        tokens += event.token_ids
    return tokens


def aborted(pair: Pair) -> float:
    return pair.decode.metrics.value("requests_total",
                                     state=RequestState.FINISHED_ABORTED.value)


def test_an_id_in_flight_from_another_connection_fails_there_alone(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The intruder's Submit ends FINISHED_FAILED (invalid_request) on its own connection;
    the first request finishes with all its tokens."""
    pace_steps(pair, monkeypatch, 0.01)  # 48 tokens last 0.5 s: still in flight when it lands
    tokens = started(pair, "dup", 48)
    other = open_router(pair)
    other.send(Submit("dup", [3, 4, 5], 4))
    event = next_event(other)
    assert isinstance(event, RequestEvent)
    assert (event.request_id, event.state, event.cause) == (
        "dup", RequestState.FINISHED_FAILED, FailureCause.INVALID_REQUEST)
    assert "another connection" in event.detail
    other.close()
    last = finish(pair, "dup", tokens)
    assert (last.state, len(tokens)) == (RequestState.FINISHED_LENGTH, 48)


def test_an_id_twice_on_one_connection_is_a_reject_and_the_first_goes_on() -> None:
    """The router refuses to send it at all; a raw connection that does gets a Reject (an
    event for that id would end its own first request)."""
    prefill = make_prefill()
    decode = make_decode(prefill)
    with running(prefill, decode) as router:
        router.route(Submit("twice", [1, 2, 3], 4))
        with pytest.raises(RequestError, match="'twice' is already in flight"):
            router.route(Submit("twice", [1, 2, 3], 4))
        raw = Channel.connect(decode.address)
        assert raw.recv() == Status(True)
        raw.send(Submit("mine", [1, 2, 3], 24))
        raw.send(Submit("mine", [1, 2, 3], 24))
        states, reject = [], None
        while not states or not states[-1].is_terminal():
            message = next_event(raw)
            if isinstance(message, Reject):
                reject = message
            else:
                states.append(message.state)
        assert reject is not None and "'mine' is already in flight" in reject.reason
        assert states[-1] is RequestState.FINISHED_LENGTH
        raw.close()
        while not router.events.get(timeout=30).state.is_terminal():
            pass


def test_only_the_submitter_can_abort(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another connection's Abort of a request in flight is refused there and changes
    nothing."""
    pace_steps(pair, monkeypatch, 0.01)  # 48 tokens last 0.5 s: still in flight when it lands
    tokens = started(pair, "victim", 48)
    other = open_router(pair)
    other.send(Abort("victim"))
    reply = next_event(other)
    assert isinstance(reply, Reject) and "'victim'" in reply.reason
    other.close()
    last = finish(pair, "victim", tokens)
    assert (last.state, len(tokens)) == (RequestState.FINISHED_LENGTH, 48)
    assert aborted(pair) == 0


def test_a_router_that_leaves_has_its_requests_aborted(pair: Pair) -> None:
    """Long requests of a connection that closes mid-decode are aborted, not decoded for
    nobody; the decoder then has nothing left (the fixture checks its pages)."""
    leaving = open_router(pair)
    for i in range(4):
        leaving.send(Submit(f"gone-{i}", [1, 2, 3, 4], 200))
    while not next_event(leaving).token_ids:
        pass  # decoding
    leaving.close()
    wait_until(lambda: aborted(pair) == 4, "the leaving router's 4 requests aborted")
    wait_until(lambda: not pair.decode.engine.has_unfinished(), "nothing left to decode")


def test_a_router_that_stops_reading_is_cut_off_and_others_are_served(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that submits and never reads: the decoder's engine thread never waits on
    it (the good router's request is served), the connection is cut off at its send deadline
    and its requests are aborted."""
    small_kernel_buffers(monkeypatch)  # else the kernel takes megabytes before a send stalls
    monkeypatch.setattr(outbox, "SEND_DEADLINE_S", 0.3)
    pace_steps(pair, monkeypatch, 0.002)  # 480 tokens then take > 0.9 s: past the deadline
    mute = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    mute.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = pair.decode.address.rsplit(":", 1)
    mute.connect((host, int(port)))
    stalled = Channel(mute, "mute", b"", accepted=False)
    stalled.send(Heartbeat())
    for i in range(2):
        stalled.send(Submit(f"mute-{i}", [1, 2, 3, 4], 480))
    assert serve(pair.router, [5, 6, 7], "served", 8)
    wait_until(lambda: aborted(pair) == 2, "the mute router cut off and its requests aborted",
               timeout_s=30)
    mute.settimeout(10)
    while mute.recv(1 << 16):
        pass  # what the kernel had taken, then the end: the decoder closed it
    stalled.close()


def pace_steps(pair: Pair, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Make each of the decoder's engine steps last at least `seconds`: the tiny model decodes
    hundreds of tokens faster than a send deadline runs out, and a request that has finished
    before its connection is cut off has nothing left to abort."""
    step = pair.decode.engine.step

    def paced() -> list[object]:
        started = time.monotonic()
        events = step()
        time.sleep(max(0.0, seconds - (time.monotonic() - started)))
        return events

    monkeypatch.setattr(pair.decode.engine, "step", paced)


def small_kernel_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every outbox made from now on writes into an 8 KiB kernel send buffer."""
    made = outbox.Outbox.__init__

    def with_small_buffer(self: outbox.Outbox, sock: socket.socket, *args: object,
                          **kwargs: object) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        made(self, sock, *args, **kwargs)

    monkeypatch.setattr(outbox.Outbox, "__init__", with_small_buffer)
