"""A control channel's defences (S2, S5): with a secret, per-connection nonces and
per-direction sequence numbers inside every tag, so no frame replays, on its own connection or
another, or reflects; a small size limit before the first good frame; a deadline on the
accepting side's handshake and on every frame once started, but none between frames. Real tcp
on loopback, with a `Tap` on the server's socket playing the eavesdropper."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from disagg.control.address import format_address, listen
from disagg.control.channel import MAX_UNTRUSTED_PAYLOAD, PREFACE, PREFACE_MAGIC, Channel
from disagg.control.framing import HEADER, MAGIC, PROTOCOL_VERSION, TAGGED
from disagg.control.messages import Abort, Heartbeat, Reject, Shutdown
from disagg.errors import PeerClosedError, ProtocolError
from disagg.kv_transfer.messages import Cancel

SECRET = b"s3cret"


class Tap:
    """A socket that records what its channel received and sent (what an eavesdropper on the
    wire sees), delegating everything else."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.received, self.sent = sock, bytearray(), bytearray()

    def recv_into(self, buffer: memoryview, nbytes: int, flags: int = 0) -> int:
        count = self.sock.recv_into(buffer, nbytes, flags)
        self.received += buffer[:count]
        return count

    def send(self, data: memoryview, flags: int = 0) -> int:  # what the channel's outbox uses
        count = self.sock.send(data, flags)
        self.sent += data[:count]
        return count

    def __getattr__(self, name: str) -> object:
        return getattr(self.sock, name)


@dataclass
class Pair:
    server: Channel  # the accepting end, over `tap`
    client: Channel  # opened by Channel.connect
    tap: Tap
    listener: socket.socket

    def stranger(self, secret: bytes, **options: float) -> tuple[socket.socket, Channel]:
        """A raw socket connected to the same listener, and the server's channel for it."""
        raw = socket.create_connection(self.listener.getsockname()[:2], timeout=5)
        return raw, Channel(self.listener.accept()[0], "stranger", secret, **options)


@pytest.fixture
def make_pair() -> Iterator[Callable[..., Pair]]:
    """make_pair(secret, **server options): a channel pair over real tcp, both ends open."""
    made: list[tuple[Pair, socket.socket, Channel]] = []

    def make(secret: bytes, **options: float) -> Pair:
        listener = listen("127.0.0.1:0")
        address = format_address(*listener.getsockname()[:2])
        clients: list[Channel] = []
        opener = threading.Thread(target=lambda: clients.append(
            Channel.connect(address, timeout_s=5.0, secret=secret)))
        opener.start()
        tap = Tap(listener.accept()[0])
        server = Channel(tap, "client", secret, **options)  # type: ignore[arg-type]
        server.send(Heartbeat())  # with a secret, sends the server's nonce first
        opener.join(timeout=10)
        [client] = clients
        assert isinstance(client.recv(), Heartbeat)
        made.append(Pair(server, client, tap, listener))
        return made[-1]

    yield make
    for pair in made:
        for closable in (pair.server, pair.client, pair.listener):
            closable.close()


@pytest.mark.parametrize("secret", [SECRET, b""], ids=["secret", "no-secret"])
def test_messages_round_trip_and_the_opening_heartbeat_is_not_one(
        make_pair: Callable[..., Pair], secret: bytes) -> None:
    """Both ways, in order; the Heartbeat connect() sends first is the handshake, not a
    message (with and without a secret: development on loopback works as before)."""
    pair = make_pair(secret)
    pair.client.send(Cancel("r1"))
    pair.server.send(Shutdown())
    pair.client.send(Abort("r2"))
    assert [pair.server.recv(), pair.server.recv()] == [Cancel("r1"), Abort("r2")]
    assert isinstance(pair.client.recv(), Shutdown)


def test_a_replayed_frame_fails_on_its_own_connection(make_pair: Callable[..., Pair]) -> None:
    """A captured signed Shutdown sent again fails its tag (the sequence number moved on)."""
    pair = make_pair(SECRET)
    pair.client.send(Heartbeat())
    assert isinstance(pair.server.recv(), Heartbeat)
    start = len(pair.tap.received)
    pair.client.send(Shutdown())
    assert isinstance(pair.server.recv(), Shutdown)
    pair.client.sock.sendall(pair.tap.received[start:])
    with pytest.raises(ProtocolError, match="bad authentication tag on Shutdown"):
        pair.server.recv()


def test_a_replayed_connection_fails_on_another(make_pair: Callable[..., Pair]) -> None:
    """Everything a client sent (its nonce, opening Heartbeat and a Shutdown), replayed on a
    new connection, fails at the first frame: the server's nonce is new."""
    pair = make_pair(SECRET)
    pair.client.send(Shutdown())
    assert isinstance(pair.server.recv(), Shutdown)
    raw, server = pair.stranger(SECRET)
    with raw, contextlib.closing(server):
        raw.sendall(pair.tap.received)
        with pytest.raises(ProtocolError, match="bad authentication tag on Heartbeat"):
            server.recv()


def test_a_reflected_frame_fails(make_pair: Callable[..., Pair]) -> None:
    """The server's own signed frames sent back to it fail: the direction is in the key."""
    pair = make_pair(SECRET)
    assert pair.server.flush(5.0)  # the opening Heartbeat is recorded before we mark the start
    start = len(pair.tap.sent)
    pair.server.send(Shutdown())
    assert isinstance(pair.client.recv(), Shutdown)
    assert pair.server.flush(5.0)  # the tap has recorded the whole frame
    pair.client.sock.sendall(pair.tap.sent[start:])
    with pytest.raises(ProtocolError, match="bad authentication tag on Shutdown"):
        pair.server.recv()


@pytest.mark.parametrize("secret", [SECRET, b""], ids=["secret", "no-secret"])
def test_a_large_frame_before_authentication_is_refused_unread(
        make_pair: Callable[..., Pair], secret: bytes) -> None:
    """A first frame announcing more than the small limit is refused from its header alone
    (no 64 MiB buffered for a stranger); once trusted, a peer may send large frames."""
    pair = make_pair(secret)
    raw, server = pair.stranger(secret)
    nonce = PREFACE.pack(PREFACE_MAGIC, PROTOCOL_VERSION, bytes(16)) if secret else b""
    type_byte = Reject.TYPE | (TAGGED if secret else 0)
    with raw, contextlib.closing(server):
        raw.sendall(nonce + HEADER.pack(MAGIC, PROTOCOL_VERSION, type_byte, 60 << 20))
        with pytest.raises(ProtocolError, match="before authentication"):
            server.recv()  # the body never comes: without the limit this would block
    big = Reject("x" * (2 * MAX_UNTRUSTED_PAYLOAD))
    pair.client.send(big)
    assert pair.server.recv() == big


@pytest.mark.parametrize("sent", [b"", HEADER.pack(MAGIC, PROTOCOL_VERSION, Heartbeat.TYPE, 2)],
                         ids=["silent", "trickle"])
def test_a_silent_or_slow_handshake_is_cut(make_pair: Callable[..., Pair], sent: bytes) -> None:
    """An accepted connection that does not complete its first frame in time is refused,
    whether it sends nothing or trickles bytes (the deadline is for the whole handshake)."""
    raw, server = make_pair(b"").stranger(b"", handshake_timeout_s=0.5)

    def trickle() -> None:
        with contextlib.suppress(OSError):
            for byte in sent + b"{}":
                raw.sendall(bytes([byte]))
                time.sleep(0.1)

    threading.Thread(target=trickle, daemon=True).start()
    start = time.monotonic()
    with raw, contextlib.closing(server):
        with pytest.raises(ProtocolError, match="handshake timed out"):
            server.recv()
        assert time.monotonic() - start < 5


def test_idle_between_frames_is_fine_but_a_stalled_frame_is_cut(
        make_pair: Callable[..., Pair]) -> None:
    """After the handshake a peer may stay silent (routers send no heartbeats), but a frame,
    once started, must complete in time."""
    pair = make_pair(b"", handshake_timeout_s=0.3, frame_timeout_s=0.3)
    threading.Timer(0.8, pair.client.send, args=(Cancel("late"),)).start()
    assert pair.server.recv() == Cancel("late")  # idle past both timeouts
    pair.client.sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, Cancel.TYPE, 50)[:5])
    with pytest.raises(ProtocolError, match="frame timed out"):
        pair.server.recv()


def test_deeply_nested_json_is_a_protocol_error(make_pair: Callable[..., Pair]) -> None:
    """A payload nested past the parser's recursion limit is a ProtocolError naming it, not a
    RecursionError escaping the reader's checks."""
    pair = make_pair(b"")
    body = b"[" * 100_000 + b"]" * 100_000
    pair.client.sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, Cancel.TYPE, len(body)) + body)
    with pytest.raises(ProtocolError, match="Cancel: payload is not JSON"):
        pair.server.recv()


@pytest.mark.parametrize(("client_secret", "server_secret", "server_error", "client_error"), [
    (b"", SECRET, "unauthenticated frame", "signed frame"),
    (SECRET, b"", "signed frame", "unauthenticated frame")], ids=["client", "server"])
def test_a_secret_on_one_side_only_is_named(client_secret: bytes, server_secret: bytes,
                                           server_error: str, client_error: str) -> None:
    """A node with the secret and one without refuse each other, each saying why."""
    listener = listen("127.0.0.1:0")
    errors: dict[str, Exception] = {}

    def serve() -> None:
        channel = Channel(listener.accept()[0], "client", server_secret)
        with contextlib.closing(channel):
            try:
                channel.recv()
            except ProtocolError as error:  # a node's reader answers with a Reject
                errors["server"] = error
                with contextlib.suppress(PeerClosedError):
                    channel.send(Reject(str(error)))

    thread = threading.Thread(target=serve)
    thread.start()
    with pytest.raises(ProtocolError, match=client_error):
        Channel.connect(format_address(*listener.getsockname()[:2]), 5.0, client_secret).recv()
    thread.join(timeout=10)
    listener.close()
    assert server_error in str(errors["server"])
