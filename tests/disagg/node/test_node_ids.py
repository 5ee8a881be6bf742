"""One node id, one live node (X5d): a second decoder with a live decoder's id is refused at
its handshake and the first one's requests go on; once the first is gone its id can be
claimed again. A prefiller and a decoder in threads, over tcp and libfabric."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from disagg.control import liveness
from disagg.control.channel import Channel
from disagg.control.messages import Heartbeat, Reject
from disagg.kv_transfer.messages import HelloAck
from disagg.errors import PeerMismatchError
from disagg.node.node_ids import NodeIdClaims
from tests.disagg.node.running_nodes import running
from tests.disagg.node.test_disagg_nodes import (  # noqa: F401 - pair is a fixture
    Pair,
    make_decode,
    make_prefill,
    pair,
    serve,
    wait_until,
)


def test_a_second_decoder_with_a_live_id_is_refused_and_the_first_serves_on(
        pair: Pair) -> None:
    with pytest.raises(PeerMismatchError, match="'decode-0' is held by a live decoder"):
        make_decode(pair.prefill, node_id="decode-0")
    assert len(serve(pair.router, [5, 6, 7, 8, 9])) == 4


def test_the_id_of_a_decoder_that_left_can_be_claimed_again() -> None:
    prefill = make_prefill()
    first = make_decode(prefill, node_id="decode-7")
    first.close()  # its connection to the prefiller ends with it
    wait_until(lambda: not prefill._node_ids._holders, "the prefiller saw decode-7 leave")
    again = make_decode(prefill, node_id="decode-7")
    with running(prefill, again) as router:
        assert len(serve(router, [5, 6, 7, 8, 9])) == 4


def test_a_refused_handshake_frees_its_id_before_the_refusal_arrives() -> None:
    """A decoder told why it was refused may come straight back under its id: the prefiller
    frees the id before it sends the reason, not after (a reconnect that raced the release
    was refused as a duplicate)."""
    prefill = make_prefill()
    decode = make_decode(prefill, node_id="decode-3")
    hello = dataclasses.replace(decode.messenger.hello(), node_id="decode-8")
    channel = Channel.connect(prefill.address)
    try:
        channel.send(hello)
        assert isinstance(channel.recv(), HelloAck)
        assert "decode-8" in prefill._node_ids._holders
        channel.send(Heartbeat())  # not the HelloProof the handshake waits for
        assert isinstance(channel.recv(), Reject)
        assert "decode-8" not in prefill._node_ids._holders
    finally:
        channel.close()
        decode.close()
        prefill.close()


def test_an_id_whose_holder_is_closed_or_silent_is_free_before_its_release(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder's reader may not have released the id yet when its successor shakes hands
    (a restarted decoder): a holder that is closed, or silent too long, does not count."""
    pairs = [socket.socketpair() for _ in range(3)]
    old, new, newer = (Channel(ours, f"decoder {i}", b"") for i, (ours, _) in enumerate(pairs))
    claims = NodeIdClaims()
    assert claims.claim("decode-0", old) is None
    assert claims.claim("decode-0", new) is old  # live: refused
    old.close()
    assert claims.claim("decode-0", new) is None
    monkeypatch.setattr(liveness, "PEER_TIMEOUT_S", 0.0)  # `new` has been silent too long
    assert claims.claim("decode-0", newer) is None
    for channel in (new, newer):
        channel.close()
    for _, theirs in pairs:
        theirs.close()
