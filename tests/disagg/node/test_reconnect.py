"""A decoder takes a lost prefiller back (X4d): its connection cut, the decoder
fails or retries what was in flight, shakes hands again with backoff, and later requests are
served by it again, token-exact. Nodes in threads over the tcp provider."""

from __future__ import annotations

import time

import pytest

from disagg.control.channel import Channel
from disagg.control.messages import Status, Submit
from disagg.engine.request import FailureCause, RequestState
from tests.disagg.node.test_reliability import MAX_TOKENS, PROMPTS, REFERENCE, make_cluster

pytestmark = pytest.mark.fabric
__all__ = ["make_cluster"]  # the fixture, shared with the reliability tests


def serve_one(cluster: object, request_id: str, index: int) -> tuple[RequestState, list[int]]:
    cluster.router.route(Submit(request_id, PROMPTS[index], MAX_TOKENS))  # type: ignore[attr-defined]
    tokens: list[int] = []
    while True:
        event = cluster.router.events.get(timeout=30)  # type: ignore[attr-defined]
        assert event.request_id == request_id
        tokens += event.token_ids
        if event.state.is_terminal():
            return event.state, tokens


def test_a_prefiller_whose_connection_broke_is_taken_back(make_cluster: object) -> None:
    cluster = make_cluster()  # type: ignore[operator]
    prefiller, messenger = cluster.prefillers[0], cluster.decoder.messenger
    assert serve_one(cluster, "before", 0) == (RequestState.FINISHED_LENGTH, REFERENCE[0])
    first_channel = messenger.pool.link(0).channel
    for channel in list(prefiller._channels):  # as if the network dropped the connection
        channel.close()
    deadline = time.monotonic() + 10
    # Back at the decoder, and the router has heard the decoder's Status saying it takes
    # requests again (while no prefiller was alive it refused them).
    while (messenger.pool.is_current(0, first_channel) or not messenger.pool.link(0).alive
           or not cluster.router.accepting[0]):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the decoder never shook hands again"
        time.sleep(0.02)
    assert serve_one(cluster, "after", 1) == (RequestState.FINISHED_LENGTH, REFERENCE[1])
    assert len(prefiller._peers) == 1  # the old peer was dropped, the new one serves


def test_a_decoder_without_prefillers_refuses_work_until_one_is_back(
        make_cluster: object) -> None:
    """The prefiller stops for good: the decoder says it takes no requests (`Status` to the
    router, "no_prefiller" on /health) and the router sends it none; a new prefiller on the
    same address: the decoder shakes hands with it, and requests are served again."""
    import threading

    from disagg.errors import PeerClosedError
    from disagg.node.builder import build_node
    from disagg.node.node_config import NodeConfig, NodeRole
    from disagg.node.serve import node_state
    from tests.disagg.node.test_reliability import CACHE, SchedulerConfig

    cluster = make_cluster()  # type: ignore[operator]
    old = cluster.prefillers[0]
    address = old.address
    old.stop()
    old.close()  # its connections and its listening socket: unreachable now
    deadline = time.monotonic() + 10
    while cluster.router.accepting[0]:
        assert time.monotonic() < deadline, "the router was never told"
        time.sleep(0.02)
    assert node_state(cluster.decoder) == "no_prefiller"
    with pytest.raises(PeerClosedError, match="no decoder is taking requests"):
        cluster.router.route(Submit("refused", PROMPTS[0], MAX_TOKENS))
    # A request sent anyway fails at once, naming why (its cause used to be lost: the
    # decoder reported the state before the outcome that carried the cause).
    direct = Channel.connect(cluster.decoder.address)
    assert direct.recv() == Status(False, "no live prefiller")
    direct.send(Submit("direct", PROMPTS[0], MAX_TOKENS))
    event = direct.recv()
    assert (event.state, event.cause) == (RequestState.FINISHED_FAILED, FailureCause.NO_PREFILLER)
    direct.close()
    new = build_node(NodeConfig("tiny", CACHE, SchedulerConfig(
        chunk_size=5, max_num_batched_tokens=5, mode="prefill_only"),
        role=NodeRole.PREFILL, listen=address))
    cluster.prefillers[0] = new  # the fixture stops and checks it
    thread = threading.Thread(target=new.run, daemon=True)
    thread.start()
    cluster.threads.append(thread)
    while not cluster.router.accepting[0]:
        assert time.monotonic() < deadline + 10, "the decoder never took the new prefiller"
        time.sleep(0.02)
    assert node_state(cluster.decoder) == "ok"
    assert serve_one(cluster, "after", 2) == (RequestState.FINISHED_LENGTH, REFERENCE[2])
