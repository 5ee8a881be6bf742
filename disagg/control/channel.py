"""A control connection: framed messages over a stream socket, one per peer (S2).

Sending is thread-safe and never waits on the peer: frames go through the channel's bounded
`Outbox` (X5c), which cuts off a peer that stops reading. Receiving belongs to one reader
thread. A broken or closed connection is a `PeerClosedError`; a bad frame is a
`ProtocolError`, after which the stream cannot be trusted and the channel is closed.

NOTE on authentication. With a cluster secret (the environment variable DISAGG_CLUSTER_SECRET,
or passed in), each side first sends a preface with a fresh random nonce; every frame then
carries an HMAC-SHA256 tag keyed by the secret, both nonces and the direction, over a
per-direction sequence number, the header and the payload. A frame replayed on this or another
connection, reflected back, reordered or dropped fails its tag. Until a channel has received
its first good frame it refuses headers announcing more than 64 KiB before reading their body,
and the accepting side closes a connection whose preface and first frame take over a few
seconds; `connect` sends a Heartbeat at once so an idle router still completes its handshake.
Without a secret frames are sent as they are, for development on loopback only.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import select
import socket
import struct
import threading
import time

from disagg.control.address import parse_address
from disagg.control.framing import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    Message,
    decode_header,
    decode_payload,
    encode,
)
from disagg.control.messages import Heartbeat
from disagg.control import outbox
from disagg.control.secret import TAG_SIZE, cluster_secret, derive_keys, frame_tag
from disagg.errors import PeerClosedError, ProtocolError

NONCE_SIZE = 16
PREFACE = struct.Struct(f"!2sB{NONCE_SIZE}s")  # magic, protocol version, this side's nonce
PREFACE_MAGIC = b"DC"
HANDSHAKE_TIMEOUT_S = 5.0  # accepting side: preface and first frame within this of accept
FRAME_TIMEOUT_S = 10.0  # a frame, once its first byte arrived, completes within this
MAX_UNTRUSTED_PAYLOAD = 64 << 10  # before the first good frame (a Hello is a few KiB)
_SIGNED_FRAME = "signed frame: the peer uses a cluster secret this node does not have"
_UNSIGNED_FRAME = "unauthenticated frame: this node requires the cluster secret"


class Channel:
    """One end of a control connection; built on an accepted socket unless `accepted=False`
    (what `connect` passes)."""

    def __init__(self, sock: socket.socket, peer: str = "peer", secret: bytes | None = None,
                 *, accepted: bool = True, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 frame_timeout_s: float = FRAME_TIMEOUT_S,
                 send_deadline_s: float | None = None) -> None:
        self.sock = sock
        self.peer = peer
        self.secret = cluster_secret() if secret is None else (secret or None)
        self.last_received = time.monotonic()  # for liveness checks
        self._send_lock = threading.Lock()
        self._handshake_lock = threading.Lock()
        self._closed = False
        self._accepted = accepted
        self._frame_timeout_s = frame_timeout_s
        # Only the accepting side bounds its handshake: it is the one strangers connect to.
        self._handshake_deadline = time.monotonic() + handshake_timeout_s if accepted else None
        self._nonce = os.urandom(NONCE_SIZE)
        self._keys: tuple[bytes, bytes] | None = None  # (send, receive), once nonces are known
        self._sent = self._received = 0  # per-direction frame counters, inside every tag
        self._trusted = False  # a good frame arrived: large frames and idle waits are fine
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Control messages are small and latency bound: do not wait to coalesce them.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._outbox = outbox.Outbox(sock, peer, deadline_s=outbox.SEND_DEADLINE_S
                                     if send_deadline_s is None else send_deadline_s)

    @staticmethod
    def connect(address: str, timeout_s: float = 10.0, secret: bytes | None = None) -> Channel:
        """Connect to `host:port` or `[ipv6]:port` and open the channel: exchange nonces (with
        a secret) and send the opening Heartbeat."""
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as error:
            raise PeerClosedError(f"cannot connect to {address}: {error}") from None
        sock.settimeout(None)
        channel = Channel(sock, address, secret, accepted=False)
        try:
            channel._establish(time.monotonic() + timeout_s)
            channel.send(Heartbeat())
            # Opened means the opening frames are on the wire, not only queued.
            if not channel.flush(timeout_s):
                raise PeerClosedError(f"{address}: the opening frames did not go out")
        except (PeerClosedError, ProtocolError):
            channel.close()
            raise
        return channel

    def send(self, message: Message) -> None:
        """Queue one message for the peer; raises `PeerClosedError` if the connection is gone
        or the peer was cut off for not reading. It never waits for the peer."""
        try:
            self._ensure_keys()
        except ProtocolError as error:
            raise PeerClosedError(str(error)) from None
        frame = encode(message, tagged=self.secret is not None)
        with self._send_lock:
            if self._closed:
                raise PeerClosedError(f"channel to {self.peer} is closed")
            if self._keys is not None:
                frame += frame_tag(self._keys[0], self._sent, frame)
                self._sent += 1
            self._outbox.put(frame)

    def recv(self) -> Message:
        """Block for the next message (the connecting side's opening Heartbeat is not one)."""
        self._ensure_keys()
        while True:
            opening = not self._trusted
            message = self._recv_frame()
            if not (opening and self._accepted and isinstance(message, Heartbeat)):
                return message

    def close(self) -> None:
        """Close the socket (idempotent) once what is queued went out (a last Reject or
        Shutdown; at most `CLOSE_LINGER_S`); a blocked `recv` then fails with PeerClosedError."""
        if self._closed:
            return
        self._outbox.close()
        with contextlib.suppress(OSError):  # already disconnected: nothing left to shut down
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            self.sock.close()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until every queued frame is on the wire; whether it is."""
        return self._outbox.flush(timeout_s)

    @property
    def closed(self) -> bool:
        """Whether `close` was called (not whether the peer left or was cut off)."""
        return self._closed

    @property
    def cut_off(self) -> str | None:
        """Why the peer was disconnected for not reading (X5c), if it was."""
        return self._outbox.broken

    def _ensure_keys(self) -> None:
        if self.secret is not None and self._keys is None:  # an accepted channel's first use
            self._establish(self._handshake_deadline or time.monotonic() + self._frame_timeout_s)

    def _establish(self, deadline: float) -> None:
        """Send our nonce, read the peer's, derive this connection's keys; closes on failure."""
        with self._handshake_lock:
            if self._keys is not None or self.secret is None:
                return
            try:
                self._send_raw(PREFACE.pack(PREFACE_MAGIC, PROTOCOL_VERSION, self._nonce))
                peer_nonce = self._read_preface(deadline)
            except (PeerClosedError, ProtocolError):
                self.close()
                raise
            self._keys = derive_keys(self.secret, self._accepted, self._nonce, peer_nonce)

    def _send_raw(self, data: bytes) -> None:
        with self._send_lock:
            self._outbox.put(data)

    def _read_preface(self, deadline: float) -> bytes:
        magic = self._read_exactly(2, deadline)
        if magic == MAGIC:  # a frame, not a preface: the peer has no secret
            raise ProtocolError(f"{self.peer}: {_UNSIGNED_FRAME}")
        if magic != PREFACE_MAGIC:
            raise ProtocolError(f"{self.peer}: bad magic {magic!r}: not a disagg control "
                                "connection")
        _, version, nonce = PREFACE.unpack(magic + self._read_exactly(PREFACE.size - 2,
                                                                      deadline))
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"{self.peer}: protocol version {version}, this node speaks "
                                f"{PROTOCOL_VERSION}")
        return nonce

    def _recv_frame(self) -> Message:
        # Between frames a trusted peer may stay silent (routers send no heartbeats); a frame
        # once started must complete, so a slow sender cannot hold this thread.
        handshake = None if self._trusted else self._handshake_deadline
        first = self._read_exactly(1, handshake)
        deadline = time.monotonic() + self._frame_timeout_s
        if handshake is not None:
            deadline = min(deadline, handshake)
        header = first + self._read_exactly(HEADER.size - 1, deadline)
        if header[:2] == PREFACE_MAGIC and self.secret is None:
            raise ProtocolError(f"{self.peer}: {_SIGNED_FRAME}")
        cls, length, tagged = decode_header(header)
        if tagged != (self.secret is not None):
            raise ProtocolError(f"{self.peer}: " + (
                _UNSIGNED_FRAME if self.secret else _SIGNED_FRAME))
        if not self._trusted and length > MAX_UNTRUSTED_PAYLOAD:
            raise ProtocolError(f"{self.peer}: {cls.__name__} of {length} bytes before "
                                f"authentication (limit {MAX_UNTRUSTED_PAYLOAD})")
        body = self._read_exactly(length, deadline)
        if self._keys is not None:
            tag = self._read_exactly(TAG_SIZE, deadline)
            expected = frame_tag(self._keys[1], self._received, header + body)
            if not hmac.compare_digest(tag, expected):
                raise ProtocolError(f"{self.peer}: bad authentication tag on {cls.__name__} "
                                    "(wrong cluster secret, or a replayed frame)")
            self._received += 1
        message = decode_payload(cls, body)
        self._trusted = True
        self.last_received = time.monotonic()
        return message

    def _read_exactly(self, n: int, deadline: float | None) -> bytes:
        """`n` bytes; with a `deadline` (time.monotonic), a `ProtocolError` once it passes."""
        buffer = bytearray(n)
        view, got = memoryview(buffer), 0
        # With a deadline, never block in recv: poll, not a socket timeout, which would apply
        # to the outbox writer's sends too.
        flags = 0 if deadline is None else socket.MSG_DONTWAIT
        while got < n:
            try:
                count = self.sock.recv_into(view[got:], min(n - got, 1 << 20), flags)
            except BlockingIOError:
                assert deadline is not None, "a blocking socket never raises it"
                self._wait_readable(deadline, got, n)
                continue
            except OSError as error:
                raise PeerClosedError(f"{self.peer}: receive failed: {error}") from None
            if not count:
                if self._outbox.broken is not None:  # we cut the peer off: say why
                    raise PeerClosedError(self._outbox.broken)
                if got:
                    raise ProtocolError(f"{self.peer}: connection closed mid-frame "
                                        f"({got} of {n} bytes)")
                raise PeerClosedError(f"{self.peer} closed the connection")
            got += count
        return bytes(buffer)

    def _wait_readable(self, deadline: float, got: int, n: int) -> None:
        poll = select.poll()
        try:
            poll.register(self.sock, select.POLLIN)
        except ValueError:  # closed under us: no descriptor left
            raise PeerClosedError(f"channel to {self.peer} is closed") from None
        left_ms = (deadline - time.monotonic()) * 1e3
        if left_ms <= 0 or not poll.poll(left_ms):
            stage = "frame" if self._trusted else "handshake"
            raise ProtocolError(f"{self.peer}: {stage} timed out ({got} of {n} bytes "
                                "arrived)")


