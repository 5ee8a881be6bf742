"""The router's choice of decoder: least loaded, or KV-aware (X2), over real control
connections to stand-in decoders that record what they were sent."""

from __future__ import annotations

import threading
import time

import pytest

from disagg.control.address import format_address, listen
from disagg.control.channel import Channel
from disagg.control.messages import Heartbeat, RequestEvent, Status, Submit
from disagg.engine.request import RequestState
from disagg.errors import PeerClosedError
from disagg.node.prefix_index import (
    PrefixIndex,
    RoutingConfig,
    RoutingPolicy,
    page_digests,
    pick_decoder,
)
import disagg.node.router as router_module
from disagg.node.router import Router


class FakeDecoder:
    """Accepts the router's connections (one at a time), records each Submit; `finish`
    answers one, `send` sends anything."""

    def __init__(self) -> None:
        self._server = listen("127.0.0.1:0")
        host, port = self._server.getsockname()[:2]
        self.address = format_address(host, port)
        self.submits: list[Submit] = []
        self.channel: Channel | None = None
        self.connections = 0
        self._accepted = threading.Event()  # the router's connect returns before our accept
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            self.channel = Channel(sock, "router")
            self.connections += 1
            self._accepted.set()
            while True:
                try:
                    message = self.channel.recv()
                except Exception:  # noqa: BLE001 - the router or the test closed it
                    break
                if isinstance(message, Submit):
                    self.submits.append(message)

    def send(self, message: object) -> None:
        assert self._accepted.wait(10) and self.channel is not None
        self.channel.send(message)  # type: ignore[arg-type]

    def finish(self, request_id: str, output: list[int]) -> None:
        assert self._accepted.wait(10) and self.channel is not None
        self.channel.send(RequestEvent(request_id, RequestState.RUNNING, output[:-1]))
        self.channel.send(RequestEvent(request_id, RequestState.FINISHED_LENGTH, output[-1:]))


def submit(router: Router, request_id: str, prompt: list[int]) -> int:
    return router.route(Submit(request_id, prompt, max_tokens=4))


def wait_for_terminal(router: Router, count: int) -> None:
    seen = 0
    while seen < count:
        seen += router.events.get(timeout=5).state.is_terminal()


@pytest.fixture
def decoders() -> list[FakeDecoder]:
    return [FakeDecoder() for _ in range(3)]


def test_a_follow_up_goes_where_its_prefix_went(decoders: list[FakeDecoder]) -> None:
    """Turn 2 of a conversation (turn 1 + answer + more) follows turn 1, though that decoder
    is busier than the others (within the margin); a stranger goes to the least loaded."""
    router = Router([d.address for d in decoders], RoutingConfig(load_margin=4, page_size=4))
    busy = submit(router, "busy", list(range(100, 120)))
    turn1 = list(range(1, 18))
    first = submit(router, "t1", turn1)
    assert first != busy  # no match anywhere: least loaded
    submit(router, "other", list(range(200, 220)))  # keeps another decoder busy
    decoders[first].finish("t1", [50, 51, 52, 53])
    wait_for_terminal(router, 1)
    strangers = iter(range(10))
    while router.in_flight[first] <= min(router.in_flight):  # make `first` the busiest
        submit(router, f"x{next(strangers)}", list(range(300, 320)))
    turn2 = turn1 + [50, 51, 52, 53] + [7, 8, 9]
    # Turn 1 and the answer but its last token (not computed): 20 tokens, five pages.
    assert router.index.matched_tokens(first, page_digests(turn2, 4)) == 20
    assert submit(router, "t2", turn2) == first
    router.close()


def test_a_decoder_loaded_past_the_margin_loses_its_prefix(decoders: list[FakeDecoder]) -> None:
    router = Router([d.address for d in decoders], RoutingConfig(load_margin=1, page_size=4))
    prompt = list(range(1, 30))
    first = submit(router, "a", prompt)
    assert submit(router, "b", prompt) == first  # 1 more in flight than the idle ones: within
    third = submit(router, "c", prompt)  # 2 more than the least loaded: past the margin
    assert third != first
    router.close()


def test_least_loaded_ignores_prefixes(decoders: list[FakeDecoder]) -> None:
    router = Router([d.address for d in decoders],
                    RoutingConfig(RoutingPolicy.LEAST_LOADED, page_size=4))
    prompt = list(range(1, 30))
    assert sorted(submit(router, f"r{i}", prompt) for i in range(3)) == [0, 1, 2]
    router.close()


def test_a_dead_decoder_is_forgotten(decoders: list[FakeDecoder]) -> None:
    router = Router([d.address for d in decoders], RoutingConfig(page_size=4))
    prompt = list(range(1, 30))
    first = submit(router, "a", prompt)
    deadline = time.monotonic() + 5
    while decoders[first].channel is None and time.monotonic() < deadline:
        time.sleep(0.01)
    decoders[first]._server.close()  # gone for good: no reconnection
    decoders[first].channel.close()  # type: ignore[union-attr]
    assert router.events.get(timeout=5).state is RequestState.FINISHED_FAILED
    assert router.index.matched_tokens(first, page_digests(prompt, 4)) == 0
    assert submit(router, "b", prompt) != first
    router.close()


def test_the_index_is_bounded_and_forgets_the_oldest_pages() -> None:
    index = PrefixIndex(1, page_size=2, capacity=3)
    old, new = page_digests([1, 2, 3, 4], 2), page_digests([5, 6, 7, 8], 2)
    index.add(0, old)
    index.add(0, new)
    assert index.matched_tokens(0, new) == 4
    assert index.matched_tokens(0, old) == 0  # its first page went first


def test_ties_go_to_the_least_loaded() -> None:
    assert pick_decoder([0, 1], load=[3, 1], matched=[16, 16], margin=8) == 1
    assert pick_decoder([0, 1], load=[3, 1], matched=[0, 0], margin=8) == 1


def test_an_unknown_policy_is_a_config_error() -> None:
    from disagg.errors import ConfigError

    with pytest.raises(ConfigError, match="round-robin"):
        RoutingConfig.parse("round-robin")
    assert RoutingConfig.parse("least-loaded").policy is RoutingPolicy.LEAST_LOADED



def wait_until(predicate, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


def test_a_decoder_that_refuses_requests_leaves_the_rotation_until_it_takes_them_again(
        decoders: list[FakeDecoder]) -> None:
    """`Status(False)` (a decoder whose prefillers are gone): nothing is routed there, and
    with every decoder refusing, submit fails (the front door's 503); `Status(True)` again:
    it is back."""
    router = Router([d.address for d in decoders[:2]], RoutingConfig(page_size=4))
    wait_until(lambda: decoders[0].channel is not None and decoders[1].channel is not None)
    decoders[0].send(Status(False, "no live prefiller"))
    wait_until(lambda: not router.accepting[0])
    assert {submit(router, f"r{i}", [i] * 9) for i in range(4)} == {1}
    decoders[1].send(Status(False, "no live prefiller"))
    wait_until(lambda: not router.accepting[1])
    with pytest.raises(PeerClosedError, match="no decoder is taking requests"):
        submit(router, "refused", [5] * 9)
    decoders[0].send(Status(True))
    wait_until(lambda: router.accepting[0])
    assert submit(router, "back", [6] * 9) == 0
    router.close()


def test_a_silent_decoder_leaves_the_rotation_until_its_heartbeats_resume(
        decoders: list[FakeDecoder], monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder that sent heartbeats and then fell silent (frozen) gets no new requests."""
    monkeypatch.setattr(router_module, "SILENCE_S", 0.3)
    router = Router([d.address for d in decoders[:2]], RoutingConfig(page_size=4))
    wait_until(lambda: decoders[0].channel is not None)
    decoders[0].send(Heartbeat())
    wait_until(lambda: router._beating[0])
    time.sleep(0.4)  # the silence itself is what is tested
    assert not router.takes_requests(0) and router.takes_requests(1)
    assert {submit(router, f"r{i}", [i] * 9) for i in range(3)} == {1}
    decoders[0].send(Heartbeat())
    wait_until(lambda: router.takes_requests(0))
    router.close()


def test_a_lost_decoder_is_reconnected_and_readmitted(decoders: list[FakeDecoder]) -> None:
    router = Router([decoders[0].address], RoutingConfig(page_size=4))
    wait_until(lambda: decoders[0].channel is not None)
    first = decoders[0].channel
    assert submit(router, "a", [1] * 9) == 0
    wait_until(lambda: len(decoders[0].submits) == 1)
    first.close()  # type: ignore[union-attr]  # the decoder went away (restarted, say)
    assert router.events.get(timeout=5).state is RequestState.FINISHED_FAILED  # "a" is lost
    wait_until(lambda: router.alive[0] and decoders[0].connections == 2)
    assert submit(router, "b", [2] * 9) == 0
    wait_until(lambda: [s.request_id for s in decoders[0].submits] == ["a", "b"])
    router.close()
