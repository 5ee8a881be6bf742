"""The misbehaving peers of `load_http.py` (X5c, X5d): control connections to decoders that
break the rules a router keeps, each recording what the decoder did about it.

- `StalledRouter` submits long requests and then never reads. Control frames go out through a
  bounded outbox with a no-progress deadline (X5c), so the decoder cuts such a peer off only
  once its backlog outgrows the kernel's socket buffers; whether and when that happened is
  watched from outside the socket (its TCP state turns CLOSE_WAIT when the decoder closes it),
  so that watching never reads and never unstalls it.
- `LeavingRouter` submits long requests and disconnects mid-decode: nothing may decode for
  nobody, so the decoder aborts them when the connection ends (X5d).
- `CollidingRouter` sends an Abort and a Submit for ids that are in flight from the front
  door (X5d): ids belong to the connection that submitted them, so the Abort is refused with
  a Reject, the Submit fails on the intruder's own connection (invalid_request), and the
  front door's requests finish untouched (the caller checks their tokens).
Nothing here starts or signals a process.
"""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path

from disagg.control.channel import Channel
from disagg.control.messages import Abort, Reject, RequestEvent, Submit
from disagg.errors import PeerClosedError, ProtocolError

TCP_CLOSE_WAIT = "08"  # /proc/net/tcp's state code: the peer closed its side
WATCH_PERIOD_S = 0.2


def tcp_state(local_port: int) -> str | None:
    """The kernel's state code for our loopback socket on `local_port` (None: not found)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == local_port:
                return fields[3]
    return None


class StalledRouter:
    """Submits `count` long requests to one decoder, then never reads again; a thread
    watches (without reading) for the decoder closing the connection."""

    def __init__(self, address: str, secret: bytes, prompt: list[int], count: int = 8,
                 max_tokens: int = 400) -> None:
        self.address = address
        self.channel = Channel.connect(address, secret=secret)
        self.local_port = self.channel.sock.getsockname()[1]
        self.submitted_at = time.monotonic()
        self.cut_off_after_s: float | None = None
        self._stop = threading.Event()
        for i in range(count):
            self.channel.send(Submit(f"stalled-{i}", prompt, max_tokens))
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_PERIOD_S):
            if tcp_state(self.local_port) == TCP_CLOSE_WAIT:
                self.cut_off_after_s = round(time.monotonic() - self.submitted_at, 2)
                return

    def close(self) -> dict[str, object]:
        """Stop watching and hang up; what was seen of the decoder's reaction."""
        self._stop.set()
        held_s = round(time.monotonic() - self.submitted_at, 1)
        self.channel.close()
        return {"decoder": self.address, "cut_off": self.cut_off_after_s is not None,
                "cut_off_after_s": self.cut_off_after_s, "held_unread_s": held_s}


class LeavingRouter:
    """Submits `count` long requests, stays `stay_s`, and disconnects without a word; then
    probes whether the decoder let go of them."""

    def __init__(self, address: str, secret: bytes, prompt: list[int], count: int = 2,
                 max_tokens: int = 3000, stay_s: float = 0.5) -> None:
        self.address, self.secret, self.prompt = address, secret, prompt
        self.ids = [f"leaving-{i}" for i in range(count)]
        channel = Channel.connect(address, secret=secret)
        for request_id in self.ids:
            channel.send(Submit(request_id, prompt, max_tokens))
        time.sleep(stay_s)
        channel.close()
        self.left_at = time.monotonic()

    def probe(self, after_s: float = 1.0, timeout_s: float = 30.0) -> dict[str, int]:
        """`after_s` past the leave, submit each of its ids again from a new connection (a
        1-token request). Ids belong to a connection (X5d): one still in flight from the gone
        router fails here as invalid_request; one the decoder aborted is free and finishes.
        Its `max_tokens` keeps a request it did not abort decoding far past `after_s`."""
        time.sleep(max(0.0, self.left_at + after_s - time.monotonic()))
        channel = Channel.connect(self.address, secret=self.secret)
        outcome: collections.Counter[str] = collections.Counter()
        try:
            for request_id in self.ids:
                channel.send(Submit(request_id, self.prompt, 1))
            channel.sock.settimeout(timeout_s)
            ended: set[str] = set()
            while len(ended) < len(self.ids):
                message = channel.recv()
                if isinstance(message, RequestEvent) and message.state.is_terminal():
                    ended.add(message.request_id)
                    in_flight = message.cause is not None and message.cause.value == \
                        "invalid_request"
                    outcome["still_in_flight" if in_flight else "released"] += 1
                elif isinstance(message, Reject):
                    outcome["rejected"] += 1
                    break
        except (PeerClosedError, ProtocolError, OSError) as error:
            outcome[f"probe_failed:{type(error).__name__}"] += 1
        finally:
            channel.close()
        return dict(outcome)


class CollidingRouter:
    """A second control connection to every decoder that aborts and submits the front door's
    in-flight ids; tallies how each decoder answered."""

    def __init__(self, addresses: list[str], secret: bytes, prompt: list[int]) -> None:
        self.prompt = prompt
        self.channels = [Channel.connect(a, secret=secret) for a in addresses]
        self.aborts_sent = 0
        self.submits_sent = 0
        self.rejects = 0
        self.events: collections.Counter[str] = collections.Counter()  # state[:cause]
        self._lock = threading.Lock()
        for channel in self.channels:
            threading.Thread(target=self._read, args=(channel,), daemon=True).start()

    def collide(self, request_id: str) -> None:
        """Abort `request_id` on every decoder, then submit it there (a 2-token request).
        The decoder holding the front door's copy must refuse both; on the others the id is
        free, so the Submit is the intruder's own (legitimate) request."""
        for channel in self.channels:
            try:
                channel.send(Abort(request_id))
                channel.send(Submit(request_id, self.prompt, 2))
            except PeerClosedError:
                continue  # that decoder is down (a fault of the run): nothing to collide with
            with self._lock:
                self.aborts_sent += 1
                self.submits_sent += 1

    def _read(self, channel: Channel) -> None:
        while True:
            try:
                message = channel.recv()
            except (PeerClosedError, ProtocolError):
                return
            with self._lock:
                if isinstance(message, Reject):
                    self.rejects += 1
                elif isinstance(message, RequestEvent) and message.state.is_terminal():
                    cause = message.cause.value if message.cause is not None else None
                    self.events[f"{message.state.value}:{cause}" if cause else
                                message.state.value] += 1

    def close(self) -> dict[str, object]:
        for channel in self.channels:
            channel.close()
        with self._lock:
            return {"aborts_sent": self.aborts_sent, "submits_sent": self.submits_sent,
                    "rejects": self.rejects, "terminal_events": dict(self.events)}
