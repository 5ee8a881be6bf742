"""Which node ids the live peers of a node hold (X5d): one id, one live node.

A prefiller keys a decoder's requests and cancels by its node id, so a second decoder
started with the id of a live one would cancel the first one's transfers. The second is
refused at its handshake instead; an id whose holder has gone (closed, cut off, or silent past
`PEER_TIMEOUT_S`) can be claimed again, which is how a restarted decoder comes back.
"""

from __future__ import annotations

import threading

from disagg.control.channel import Channel
from disagg.control.liveness import is_silent


class NodeIdClaims:
    """Node id -> the connection that holds it; thread-safe (handshakes run side by side)."""

    def __init__(self) -> None:
        self._holders: dict[str, Channel] = {}
        self._lock = threading.Lock()

    def claim(self, node_id: str, channel: Channel) -> Channel | None:
        """Hold `node_id` for `channel`; the live holder instead, if another one has it."""
        with self._lock:
            holder = self._holders.get(node_id)
            if holder is not None and holder is not channel and _alive(holder):
                return holder
            self._holders[node_id] = channel
            return None

    def release(self, channel: Channel) -> None:
        """`channel` is done with whatever id it holds (a newer holder keeps its own)."""
        with self._lock:
            for node_id in [i for i, holder in self._holders.items() if holder is channel]:
                del self._holders[node_id]


def _alive(channel: Channel) -> bool:
    return not channel.closed and channel.cut_off is None and not is_silent(channel)
