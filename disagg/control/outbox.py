"""A control connection's outgoing queue: senders never wait on the peer (X5c).

`put` appends a finished frame and returns at once; one writer thread per connection moves the
queue into the socket. A peer that stops reading is cut off rather than waited for: when the
queue would hold more than `max_bytes`, or the socket has taken no byte for `deadline_s` while
frames wait, the outbox breaks, shuts the socket down (the connection's reader then sees it
end, the way it sees a peer that left) and refuses every later frame with the reason. So an
engine thread reporting tokens, a heartbeat thread or the front door's event loop costs one
append per message, whoever is at the other end.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections import deque

from disagg.errors import PeerClosedError

SEND_DEADLINE_S = 10.0  # frames waiting, and not one byte taken for this long: cut off
MAX_QUEUED_BYTES = 32 << 20  # far above any control backlog (a Hello is a few KiB)
CLOSE_LINGER_S = 1.0  # close() lets queued frames (a last Reject, a Shutdown) go this long


class Outbox:
    """The bounded queue of one socket, and the thread that writes it."""

    def __init__(self, sock: socket.socket, peer: str, *, deadline_s: float = SEND_DEADLINE_S,
                 max_bytes: int = MAX_QUEUED_BYTES) -> None:
        self._sock = sock
        self._peer = peer
        self._deadline_s = deadline_s
        self._max_bytes = max_bytes
        self._frames: deque[memoryview] = deque()
        self._queued = 0  # bytes not yet taken by the socket
        self._cond = threading.Condition()
        self._ended = False  # close() asked the writer to stop
        self.broken: str | None = None  # why the peer was cut off, once it was
        self._thread = threading.Thread(target=self._write, daemon=True,
                                        name=f"outbox {peer}")
        self._thread.start()

    def put(self, frame: bytes) -> None:
        """Queue one frame; `PeerClosedError` if the peer was cut off or is over its bound."""
        with self._cond:
            if self.broken is not None:
                raise PeerClosedError(self.broken)
            if self._ended:
                raise PeerClosedError(f"channel to {self._peer} is closed")
            if self._queued + len(frame) > self._max_bytes:
                self._break(f"{self._peer} does not read: {self._queued} bytes queued, "
                            f"bound {self._max_bytes}")
                raise PeerClosedError(self.broken or "")
            self._frames.append(memoryview(frame))
            self._queued += len(frame)
            self._cond.notify()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the queue to empty; whether it did."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._frames and self.broken is None and not self._ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return not self._frames and self.broken is None

    def close(self, linger_s: float = CLOSE_LINGER_S) -> None:
        """Let what is queued go for up to `linger_s` (a last Reject or Shutdown), then stop
        the writer. The caller closes the socket."""
        self.flush(linger_s)
        with self._cond:
            self._ended = True
            self._frames.clear()
            self._queued = 0
            self._cond.notify_all()

    def _break(self, reason: str) -> None:
        """Cut the peer off (lock held): the reader wakes to a closed stream."""
        if self.broken is None:
            self.broken = reason
            with contextlib.suppress(OSError):  # already disconnected
                self._sock.shutdown(socket.SHUT_RDWR)
        self._frames.clear()
        self._queued = 0
        self._cond.notify_all()

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._frames and not self._ended and self.broken is None:
                    self._cond.wait()
                if self._ended or self.broken is not None:
                    return
                frame = self._frames[0]
            reason = self._send_some(frame)
            with self._cond:
                if reason is not None:
                    self._break(reason)
                    return
                if self._frames and self._frames[0] is frame:
                    self._frames.popleft()
                    self._queued -= len(frame)
                self._cond.notify_all()  # close() may be waiting for the queue to empty

    def _send_some(self, frame: memoryview) -> str | None:
        """Write one frame; the reason to cut the peer off, or None once it is sent."""
        poller = select.poll()
        try:
            poller.register(self._sock, select.POLLOUT)
        except ValueError:  # the socket was closed under us
            return f"channel to {self._peer} is closed"
        sent, last_progress = 0, time.monotonic()
        while sent < len(frame):
            try:
                # Never a blocking send: a full socket buffer waits in poll, against the
                # deadline, not in the kernel for as long as the peer likes.
                count = self._sock.send(frame[sent:], socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except BlockingIOError:
                count = 0
            except OSError as error:
                return f"{self._peer}: send failed: {error}"
            if count:
                sent += count
                last_progress = time.monotonic()
                continue
            left = last_progress + self._deadline_s - time.monotonic()
            if left <= 0:
                return (f"{self._peer} does not read: no byte taken for "
                        f"{self._deadline_s:g} s")
            with self._cond:
                if self._ended:
                    return None  # close() gave up on the rest
            poller.poll(min(left, 0.25) * 1e3)  # wake now and then to notice close()
        return None
