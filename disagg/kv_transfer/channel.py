"""A control connection: framed messages over a stream socket, one per peer (S2).

Sending is thread-safe (a lock per channel); receiving belongs to one reader thread. A broken
or closed connection is a `PeerClosedError`; a bad frame is a `ProtocolError`, after which the
stream cannot be trusted and the channel is closed. With a cluster secret (the environment
variable DISAGG_CLUSTER_SECRET, or passed in), every frame carries an HMAC-SHA256 tag over its
header and payload, so a process without the secret can neither make a prefiller write nor a
decoder accept anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import threading
import time
from collections.abc import Callable

from disagg.errors import PeerClosedError, ProtocolError
from disagg.kv_transfer.messages import HEADER, Message, decode_header, decode_payload, encode

SECRET_ENV = "DISAGG_CLUSTER_SECRET"
TAG_SIZE = 32


def cluster_secret() -> bytes | None:
    """The shared cluster secret from the environment, if any."""
    value = os.environ.get(SECRET_ENV)
    return value.encode() if value else None


class Channel:
    """One end of a control connection."""

    def __init__(self, sock: socket.socket, peer: str = "peer",
                 secret: bytes | None = None) -> None:
        self.sock = sock
        self.peer = peer
        self.secret = cluster_secret() if secret is None else (secret or None)
        self.last_received = time.monotonic()  # for liveness checks
        self._send_lock = threading.Lock()
        self._closed = False
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Control messages are small and latency bound: do not wait to coalesce them.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @staticmethod
    def connect(address: str, timeout_s: float = 10.0, secret: bytes | None = None) -> Channel:
        """Connect to `host:port` or `[ipv6]:port`."""
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as error:
            raise PeerClosedError(f"cannot connect to {address}: {error}") from None
        sock.settimeout(None)
        return Channel(sock, address, secret)

    def send(self, message: Message) -> None:
        """Send one message; raises `PeerClosedError` if the connection is gone."""
        frame = encode(message, tagged=self.secret is not None)
        if self.secret is not None:
            frame += hmac.new(self.secret, frame, hashlib.sha256).digest()
        with self._send_lock:
            if self._closed:
                raise PeerClosedError(f"channel to {self.peer} is closed")
            try:
                self.sock.sendall(frame)
            except OSError as error:
                raise PeerClosedError(f"{self.peer}: send failed: {error}") from None

    def recv(self) -> Message:
        """Block for the next message."""
        header = self._read_exactly(HEADER.size)
        cls, length, tagged = decode_header(header)
        if tagged != (self.secret is not None):
            raise ProtocolError(f"{self.peer}: " + (
                "unauthenticated frame: this node requires the cluster secret" if self.secret
                else "signed frame: the peer uses a cluster secret this node does not have"))
        body = self._read_exactly(length)
        if self.secret is not None:
            tag = self._read_exactly(TAG_SIZE)
            expected = hmac.new(self.secret, header + body, hashlib.sha256).digest()
            if not hmac.compare_digest(tag, expected):
                raise ProtocolError(f"{self.peer}: bad authentication tag on "
                                    f"{cls.__name__} (wrong or missing cluster secret)")
        self.last_received = time.monotonic()
        return decode_payload(cls, body)

    def close(self) -> None:
        """Close the socket (idempotent); a blocked `recv` then fails with PeerClosedError."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError):  # already disconnected: nothing left to shut down
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    def _read_exactly(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except OSError as error:
                raise PeerClosedError(f"{self.peer}: receive failed: {error}") from None
            if not chunk:
                if left != n:
                    raise ProtocolError(f"{self.peer}: connection closed mid-frame "
                                        f"({n - left} of {n} bytes)")
                raise PeerClosedError(f"{self.peer} closed the connection")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)


def parse_address(address: str) -> tuple[str, int]:
    """"host:port" or "[ipv6]:port" -> (host, port), with an error naming a malformed address.

    An IPv6 host must be in brackets: in "::1:7000" nothing tells the port from the last
    group of the address, so it is refused rather than guessed.

    >>> parse_address("[::1]:7000")
    ('::1', 7000)
    """
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep or "]" in host:
            raise ValueError(f"address {address!r} is not [host]:port")
    else:
        host, sep, port = address.rpartition(":")
        if ":" in host:
            raise ValueError(f"address {address!r}: an IPv6 host must be in brackets, "
                             "as in [::1]:7000")
        if not sep:
            raise ValueError(f"address {address!r} is not host:port")
    # isdecimal, not isdigit: int() refuses some digits (superscripts) that isdigit accepts.
    if not host or not port.isdecimal() or int(port) > 65535:
        raise ValueError(f"address {address!r} is not host:port (port 0-65535)")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    """The "host:port" that `parse_address` reads back: an IPv6 host goes in brackets.

    >>> format_address("::1", 7000)
    '[::1]:7000'
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(address: str) -> socket.socket:
    """A listening socket on `host:port` or `[ipv6]:port` (port 0 picks a free one)."""
    host, port = parse_address(address)
    # create_server defaults to IPv4, where an IPv6 literal does not resolve.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, reuse_port=False)


def start_heartbeats(channels: Callable[[], list[Channel]], stop: threading.Event,
                     interval_s: float = 1.0) -> threading.Thread:
    """A thread that sends a Heartbeat on every channel each `interval_s` until `stop`.

    Its own thread, not the engine loop: a long forward step must not look like a dead node.
    """
    from disagg.kv_transfer.messages import Heartbeat

    def beat() -> None:
        while not stop.wait(interval_s):
            for channel in channels():
                with contextlib.suppress(PeerClosedError):  # its reader thread reports the loss
                    channel.send(Heartbeat())

    thread = threading.Thread(target=beat, daemon=True, name="heartbeats")
    thread.start()
    return thread
