"""What a decoder's reader threads put in its inbox, as typed records the engine thread
dispatches on (S2c, X4d, X5d): a router's message, a router connection's end, a prefiller's
`KVFailed`, a prefiller connection's end."""

from __future__ import annotations

from dataclasses import dataclass

from disagg.control.channel import Channel
from disagg.control.messages import Abort, Shutdown, Submit
from disagg.kv_transfer.messages import KVFailed


@dataclass(frozen=True, slots=True)
class FromRouter:
    """A router's message, and the connection to answer on."""

    channel: Channel
    message: Submit | Abort | Shutdown


@dataclass(frozen=True, slots=True)
class RouterGone:
    """A router connection ended: its requests have no one to report to."""

    channel: Channel
    reason: str


@dataclass(frozen=True, slots=True)
class FromPrefiller:
    """A prefiller gave up on a request (`KVFailed`)."""

    message: KVFailed


@dataclass(frozen=True, slots=True)
class PrefillerGone:
    """The connection to prefiller `index` broke."""

    index: int
    reason: str
    channel: Channel | None = None  # which connection (a newer one may have replaced it)
