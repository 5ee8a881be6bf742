"""The prefillers a decoder uses: which are alive, which to ask next, and bringing one back
(S2a, S6b, X4d).

Each prefiller that shook hands is a `PrefillerLink`: its control channel, how many writes one
page of one layer costs from it (its sharding against ours, S6b: both sides plan with the same
function, so both count the same), whether it is alive, and the requests it was asked for and
has not answered. A new request goes to the least loaded live one. A lost prefiller keeps its
index; when it shakes hands again it takes that index back, with a fresh link. While the
decoder has prefillers but none alive it refuses new requests (`accepting`).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.control.channel import Channel
from disagg.control.framing import Message
from disagg.control.liveness import is_silent
from disagg.errors import PeerClosedError
from disagg.kv_transfer.messages import HelloAck
from disagg.kv_transfer.transfer_plan import writes_per_page
from disagg.model.page_geometry import PageGeometry
from disagg.model.sharding import Sharding


@dataclass
class PrefillerLink:
    """One prefiller as this decoder uses it."""

    channel: Channel
    writes_per_page: int  # per page per layer, from its sharding to ours (S6b)
    alive: bool = True
    load: int = 0  # requests asked of it and not settled


class PrefillerPool:
    """The decoder's prefillers, by index (the order of `--prefillers`)."""

    def __init__(self, ours: Sharding, geometry: PageGeometry) -> None:
        self._ours = ours
        self._geometry = geometry
        self._links: list[PrefillerLink] = []

    def add(self, channel: Channel, ack: HelloAck, index: int | None = None) -> int:
        """Use a prefiller whose handshake succeeded; returns its index. With `index`, a lost
        one is back (its requests were all settled when it was lost): it takes requests again."""
        theirs = Sharding(ack.tp, self._ours.num_kv_heads, ack.replicated_kv)
        link = PrefillerLink(channel, writes_per_page(theirs, self._ours, self._geometry))
        if index is None:
            self._links.append(link)
            return len(self._links) - 1
        if self._links[index].alive:
            raise ValueError(f"prefiller {index} is still in use")
        self._links[index] = link
        return index

    def __len__(self) -> int:
        """Prefillers this decoder was given, alive or not."""
        return len(self._links)

    @property
    def accepting(self) -> bool:
        """Whether new requests can be served: no prefillers at all (a mixed node), or one
        alive."""
        return not self._links or any(link.alive for link in self._links)

    def any_alive(self) -> bool:
        """Whether some prefiller is alive."""
        return any(link.alive for link in self._links)

    def choose(self) -> int | None:
        """The least loaded live prefiller, None when none is alive."""
        live = [i for i, link in enumerate(self._links) if link.alive]
        return min(live, key=lambda i: self._links[i].load) if live else None

    def link(self, index: int) -> PrefillerLink:
        """Prefiller `index`'s link."""
        return self._links[index]

    def take(self, index: int) -> None:
        """Prefiller `index` was asked for one more request."""
        self._links[index].load += 1

    def release(self, index: int) -> None:
        """One of prefiller `index`'s requests was settled."""
        self._links[index].load -= 1

    def send(self, index: int, message: Message) -> bool:
        """Send to prefiller `index`; False if its connection is gone."""
        try:
            self._links[index].channel.send(message)
        except PeerClosedError:
            return False
        return True

    def mark_gone(self, index: int) -> bool:
        """Prefiller `index` is lost; False if it was lost already."""
        if not self._links[index].alive:
            return False
        self._links[index].alive = False
        return True

    def is_current(self, index: int, channel: Channel) -> bool:
        """Whether `channel` is prefiller `index`'s connection (not one a newer replaced)."""
        return self._links[index].channel is channel

    def live_channels(self) -> list[Channel]:
        """The connections of the live prefillers (they get our heartbeats)."""
        return [link.channel for link in self._links if link.alive]

    def silent(self) -> list[int]:
        """The live prefillers silent longer than the peer timeout."""
        return [index for index, link in enumerate(self._links)
                if link.alive and is_silent(link.channel)]
