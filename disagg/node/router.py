"""The router: sends each request to a decoder and collects its events (S2a, X2c).

Requests start at decoders; the router only picks which one: the least loaded, or (the
default) the one most likely to hold the prompt's prefix in its cache unless it is loaded past
the least-loaded one by a margin (`prefix_index.py`). One reader thread per decoder turns its
`RequestEvent`s into a single queue the caller drains.
"""

from __future__ import annotations

import queue
import threading

from disagg.engine.request import FailureCause, RequestState
from disagg.errors import PeerClosedError, ProtocolError
from disagg.kv_transfer.channel import Channel
from disagg.kv_transfer.messages import Abort, RequestEvent, Shutdown, Submit
from disagg.node.prefix_index import (
    PrefixIndex,
    RoutingConfig,
    RoutingPolicy,
    block_digests,
    pick_decoder,
)


class Router:
    """Routing over decoder control connections."""

    def __init__(self, decoder_addresses: list[str],
                 routing: RoutingConfig | None = None) -> None:
        self.decoders = [Channel.connect(address) for address in decoder_addresses]
        self.in_flight = [0] * len(self.decoders)
        self.alive = [True] * len(self.decoders)
        self.events: queue.Queue[RequestEvent] = queue.Queue()
        self.routing = routing or RoutingConfig()
        self.index = PrefixIndex(len(self.decoders), self.routing.block_size)
        self._owner: dict[str, int] = {}
        self._tokens: dict[str, list[int]] = {}  # prompt then outputs, of requests in flight
        self._lock = threading.Lock()
        for index, channel in enumerate(self.decoders):
            threading.Thread(target=self._read, args=(index, channel), daemon=True,
                             name=f"router-{index}").start()

    def submit(self, message: Submit) -> int:
        """Send a request to the decoder the policy picks; returns its index."""
        digests = (block_digests(message.prompt_token_ids, self.index.block_size)
                   if self.routing.policy is RoutingPolicy.PREFIX else [])
        with self._lock:
            live = [i for i, alive in enumerate(self.alive) if alive]
            if not live:
                raise PeerClosedError("no decoder is alive")
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
        try:
            self.decoders[index].send(message)
        except PeerClosedError:
            self._decoder_died(index, "send failed")
        return index

    def abort(self, request_id: str) -> bool:
        """Tell the request's decoder that the client gave up; False if it is not in flight."""
        with self._lock:
            index = self._owner.get(request_id)
        if index is None:
            return False
        try:
            self.decoders[index].send(Abort(request_id))
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
            if not isinstance(event, RequestEvent):
                continue
            with self._lock:
                tokens = self._tokens.get(event.request_id)
                if tokens is not None:
                    tokens += event.token_ids
                if event.state.is_terminal():
                    if self._owner.pop(event.request_id, None) is not None:
                        self.in_flight[index] -= 1
                    self._tokens.pop(event.request_id, None)
                    if tokens is not None and event.state is not RequestState.FINISHED_FAILED:
                        # The answer's KV is computed but for its last token.
                        self.index.add(index, block_digests(tokens[:-1], self.index.block_size))
            self.events.put(event)

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
            self.in_flight[index] = 0
            self.index.forget(index)
        for request_id in lost:
            self.events.put(RequestEvent(request_id, RequestState.FINISHED_FAILED,
                                         cause=FailureCause.DECODER_DIED,
                                         detail=f"decoder {index} died: {reason}"))

    def shutdown(self) -> None:
        """Ask every decoder to exit, then close the connections."""
        for channel in self.decoders:
            try:
                channel.send(Shutdown())
            except PeerClosedError:
                pass  # already gone
        self.close()

    def close(self) -> None:
        """Close the connections (the decoders keep running)."""
        for channel in self.decoders:
            channel.close()
