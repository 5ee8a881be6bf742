"""What a decoder tells the routers about the requests it serves (S2a, X5d, X6c): each event
goes to the connection that submitted the request (`request_owners.py`), a fork's as its
parent's with its choice index, and a request ends once each of its choices has.

A request of `n` choices ends with one terminal event per choice; one that ends before it
forked (its KV failed, say) sends all `n` at once. Only then is the request released from its
connection and counted. A router that stopped reading costs nothing here: sends go through
the connection's bounded outbox (X5c), and a closed one is logged and dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from disagg.control.channel import Channel
from disagg.control.messages import RequestEvent
from disagg.engine.request import Request, RequestState
from disagg.errors import PeerClosedError
from disagg.node.request_owners import RequestOwners

logger = logging.getLogger(__name__)


class RouterReports:
    """The decoder's side of the router connections: owners, open choices, sending."""

    def __init__(self, received_writes: Callable[[str], int],
                 on_end: Callable[[Request, RequestState], None]) -> None:
        self.owners = RequestOwners()
        self._received_writes = received_writes  # KV writes landed so far, for progress
        self._on_end = on_end  # a request ended (its last choice): count it, end its span
        self._choices_open: dict[str, int] = {}  # choices of a request whose end is unsent

    def opened(self, request_id: str, n: int) -> None:
        """`request_id` was admitted with `n` choices (its owner claimed it already)."""
        self._choices_open[request_id] = n

    def report(self, request: Request, state: RequestState, token_ids: list[int] | None = None,
               detail: str = "", **kv: Any) -> bool:
        """Tell the request's router; whether this ended one choice of a forked request in
        failure (its other choices must then stop: the request has failed)."""
        request_id = request.parent_id or request.request_id
        channel = self.owners.owner(request_id)
        if channel is None:  # released already, or its connection is gone
            self._choices_open.pop(request_id, None)
            return False
        received = self._received_writes(request_id)
        n = request.sampling_params.n
        unforked_end = state.is_terminal() and request.parent_id is None and n > 1
        for index in range(n) if unforked_end else [request.index]:
            self.send(channel, RequestEvent(request_id, state, token_ids or [],
                                            kv_writes_received=received, detail=detail,
                                            num_cached_tokens=request.num_cached_tokens,
                                            index=index, **kv))
        if not state.is_terminal():
            return False
        left = 0 if unforked_end else self._choices_open.get(request_id, 1) - 1
        self._choices_open[request_id] = left
        if left == 0:  # its last choice ended
            del self._choices_open[request_id]
            self.owners.release(request_id)
            self._on_end(request, state)
        return state is RequestState.FINISHED_FAILED and request.parent_id is not None

    def send(self, channel: Channel, message: Any) -> None:  # noqa: ANN401
        """Queue `message` to a router; one that is gone is logged, never raised."""
        try:
            channel.send(message)
        except PeerClosedError:
            logger.info("router %s is gone", channel.peer)
