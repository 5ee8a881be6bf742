"""The router: sends each request to a decoder and collects its events (S2a, X2c).

Requests start at decoders; the router only picks which one: the least loaded, or (the
default) the one most likely to hold the prompt's prefix in its cache unless it is loaded past
the least-loaded one by a margin (`prefix_index.py`). One reader thread per decoder turns its
`RequestEvent`s into a single queue the caller drains. Only decoders that take requests are
picked: connected (a lost one is tried again with backoff, and re-admitted when it answers),
accepting (a decoder with no live prefiller says so in a `Status`), and not silent (one whose
heartbeats stopped, frozen or cut off, leaves the rotation until they resume).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from disagg.control.backoff import Backoff
from disagg.control.channel import Channel
from disagg.control.messages import (
    Abort,
    Heartbeat,
    Reject,
    RequestEvent,
    Shutdown,
    Status,
    Submit,
)
from disagg.engine.request import FailureCause, RequestState
from disagg.errors import PeerClosedError, ProtocolError, RequestError
from disagg.node.prefix_index import (
    PrefixIndex,
    RoutingConfig,
    RoutingPolicy,
    page_digests,
    pick_decoder,
)

logger = logging.getLogger(__name__)
SILENCE_S = 5.0  # a decoder that sent heartbeats and then nothing this long leaves the rotation


class Router:
    """Routing over decoder control connections."""

    def __init__(self, decoder_addresses: list[str],
                 routing: RoutingConfig | None = None) -> None:
        self.addresses = list(decoder_addresses)
        self.decoders = [Channel.connect(address) for address in decoder_addresses]
        self.in_flight = [0] * len(self.decoders)
        self.alive = [True] * len(self.decoders)  # connected
        self.accepting = [True] * len(self.decoders)  # as its last `Status` said
        self._beating = [False] * len(self.decoders)  # it sends heartbeats (ours all do)
        self._closed = threading.Event()
        self.events: queue.Queue[RequestEvent] = queue.Queue()
        self.routing = routing or RoutingConfig()
        self.index = PrefixIndex(len(self.decoders), self.routing.page_size)
        self._owner: dict[str, int] = {}
        self._choices_left: dict[str, int] = {}  # of requests in flight: choices not ended
        self._tokens: dict[str, list[int]] = {}  # prompt then outputs, of requests in flight
        self._lock = threading.Lock()
        for index, channel in enumerate(self.decoders):
            threading.Thread(target=self._read, args=(index, channel), daemon=True,
                             name=f"router-{index}").start()

    def route(self, message: Submit) -> int:
        """Send a request to the decoder the policy picks; returns its index. Never waits on
        the decoder (its channel queues, X5c). `RequestError` if the id is in flight."""
        digests = (page_digests(message.prompt_token_ids, self.index.page_size)
                   if self.routing.policy is RoutingPolicy.PREFIX else [])
        with self._lock:
            if message.request_id in self._owner:
                # Its events could not be told from the first one's (X5d).
                raise RequestError(f"request id {message.request_id!r} is already in flight")
            live = [i for i in range(len(self.decoders)) if self.takes_requests(i)]
            if not live:
                raise PeerClosedError("no decoder is alive" if not any(self.alive) else
                                      "no decoder is taking requests (no live prefiller, or "
                                      "silent)")
            if self.routing.policy is RoutingPolicy.PREFIX:
                matched = [self.index.matched_tokens(i, digests) for i in range(len(self.alive))]
                index = pick_decoder(live, self.in_flight, matched, self.routing.load_margin)
                # Routed there: the next request with this prefix should follow it.
                self.index.add(index, digests)
                self._tokens[message.request_id] = list(message.prompt_token_ids)
            else:
                index = min(live, key=self.in_flight.__getitem__)
            self.in_flight[index] += 1
            self._owner[message.request_id] = index
            self._choices_left[message.request_id] = message.n
        try:
            self.decoders[index].send(message)
        except PeerClosedError:
            self._decoder_died(index, "send failed")
        return index

    def takes_requests(self, index: int) -> bool:
        """Connected, accepting (its `Status`), and not silent: a decoder whose heartbeats
        stopped (frozen, or cut off) leaves the rotation until they resume."""
        silent = (self._beating[index]
                  and time.monotonic() - self.decoders[index].last_received > SILENCE_S)
        return self.alive[index] and self.accepting[index] and not silent

    def abort(self, request_id: str, choice: int = -1) -> bool:
        """Tell the request's decoder that the client gave up on it (on one `choice` of its
        `n`, -1: all); False if it is not in flight."""
        with self._lock:
            index = self._owner.get(request_id)
        if index is None:
            return False
        try:
            self.decoders[index].send(Abort(request_id, choice))
        except PeerClosedError:
            return False  # the decoder is dying; its requests fail through _decoder_died
        return True

    def _read(self, index: int, channel: Channel) -> None:
        while True:
            try:
                event = channel.recv()
            except (PeerClosedError, ProtocolError) as error:
                if not channel.closed:
                    self._decoder_died(index, str(error))
                return
            if isinstance(event, Status):
                if event.accepting != self.accepting[index]:
                    logger.warning("decoder %d %s", index, "takes requests again" if
                                   event.accepting else f"refuses requests: {event.reason}")
                self.accepting[index] = event.accepting
                continue
            if isinstance(event, Heartbeat):
                self._beating[index] = True
                continue
            if isinstance(event, Reject):  # a message of ours it refused (not a request)
                logger.warning("decoder %d refused a message: %s", index, event.reason)
                continue
            if not isinstance(event, RequestEvent):
                continue
            with self._lock:
                tokens = self._tokens.get(event.request_id)
                if tokens is not None and event.index == 0:  # choice 0's is what it caches
                    tokens += event.token_ids
                if event.state.is_terminal() and self._choice_ended(event):
                    if self._owner.pop(event.request_id, None) is not None:
                        self.in_flight[index] -= 1
                    self._tokens.pop(event.request_id, None)
                    if tokens is not None and event.state is not RequestState.FINISHED_FAILED:
                        # The answer's KV is computed but for its last token.
                        self.index.add(index, page_digests(tokens[:-1], self.index.page_size))
            self.events.put(event)

    def _choice_ended(self, event: RequestEvent) -> bool:
        """Count one choice's terminal event (lock held): whether the request has ended. A
        decoder ends each of a request's `n` choices with one (X6c); a failure ends them all
        (the decoder stops the others)."""
        request_id = event.request_id
        left = self._choices_left.get(request_id, 1) - 1
        if left > 0 and event.state is not RequestState.FINISHED_FAILED:
            self._choices_left[request_id] = left
            return False
        self._choices_left.pop(request_id, None)
        return True

    def _decoder_died(self, index: int, reason: str) -> None:
        """Its requests can no longer finish: each ends as failed, once; route elsewhere."""
        with self._lock:
            if not self.alive[index]:
                return
            self.alive[index] = False
            lost = [rid for rid, owner in self._owner.items() if owner == index]
            for request_id in lost:
                del self._owner[request_id]
                self._tokens.pop(request_id, None)
                self._choices_left.pop(request_id, None)
            self.in_flight[index] = 0
            self.index.forget(index)
        for request_id in lost:
            self.events.put(RequestEvent(request_id, RequestState.FINISHED_FAILED,
                                         cause=FailureCause.DECODER_DIED,
                                         detail=f"decoder {index} died: {reason}"))
        threading.Thread(target=self._reconnect, args=(index,), daemon=True,
                         name=f"router-reconnect-{index}").start()

    def _reconnect(self, index: int) -> None:
        """Try a lost decoder again, with `Backoff`'s doubling waits, until it answers
        (restarted, or reachable again) or the router closes; then route to it again."""
        backoff = Backoff()
        while not self._closed.wait(wait := backoff.next()):
            try:
                channel = Channel.connect(self.addresses[index], timeout_s=wait)
            except PeerClosedError:
                continue
            with self._lock:
                if self._closed.is_set():
                    channel.close()
                    return
                self.decoders[index] = channel
                self.alive[index], self.accepting[index], self._beating[index] = True, True, False
            logger.warning("decoder %d (%s) is back", index, self.addresses[index])
            threading.Thread(target=self._read, args=(index, channel), daemon=True,
                             name=f"router-{index}").start()
            return

    def shutdown(self) -> None:
        """Ask every decoder to exit, then close the connections."""
        for channel in self.decoders:
            try:
                channel.send(Shutdown())
            except PeerClosedError:
                pass  # already gone
        self.close()

    def close(self) -> None:
        """Close the connections (the decoders keep running) and stop reconnecting."""
        self._closed.set()
        with self._lock:
            channels = list(self.decoders)
        for channel in channels:
            channel.close()
