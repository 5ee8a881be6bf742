"""A control connection's outgoing queue (X5c): a sender never waits on its peer, a peer that
stops reading is cut off with the reason, and a last frame still goes out on close."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from disagg.control.channel import Channel
from disagg.control.messages import Heartbeat, Reject
from disagg.control.outbox import Outbox
from disagg.errors import PeerClosedError


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    yield ours, theirs
    ours.close()
    theirs.close()


def test_a_peer_that_never_reads_is_cut_off_and_the_sender_goes_on(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """Frames far beyond the socket buffer, to a peer that reads nothing: every send returns,
    the channel breaks within its deadline, and our reader hears why."""
    ours, _ = pair
    channel = Channel(ours, "mute peer", b"", send_deadline_s=0.3)
    errors: list[PeerClosedError] = []

    def flood() -> None:
        try:
            while True:
                channel.send(Reject("x" * 50_000))
        except PeerClosedError as error:
            errors.append(error)

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    sender.join(timeout=30)
    assert not sender.is_alive(), "a send waited on a peer that does not read"
    assert "does not read" in str(errors[0])
    assert channel.cut_off is not None and not channel.closed
    with pytest.raises(PeerClosedError, match="does not read"):
        channel.recv()
    channel.close()


def test_a_backlog_over_the_bound_cuts_the_peer_off(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """Beyond `max_bytes` queued the peer is cut off at once, whatever the deadline."""
    ours, _ = pair
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    outbox = Outbox(ours, "slow peer", deadline_s=3600, max_bytes=1 << 20)
    with pytest.raises(PeerClosedError, match="bytes queued"):
        for _ in range(1000):
            outbox.put(bytes(64 << 10))
    with pytest.raises(PeerClosedError, match="bytes queued"):
        outbox.put(b"x")  # and it stays cut off
    outbox.close()


def test_a_frame_sent_just_before_close_still_arrives(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """send(Reject) then close(): the peer still reads the whole Reject, though it is larger
    than the socket takes at once (close lets the queue drain first)."""
    ours, theirs = pair
    sender = Channel(ours, "peer", b"")
    receiver = Channel(theirs, "peer", b"")
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(receiver.recv()))
    reader.start()
    sender.send(Heartbeat())  # the opening frame: large ones are taken after it
    sender.send(Reject("last words " + "y" * (4 << 20)))
    sender.close()
    reader.join(timeout=30)
    assert isinstance(got[0], Reject) and got[0].reason.startswith("last words")
    receiver.close()
