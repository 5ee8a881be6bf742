"""Which router connection submitted each request a decoder has in flight (X5d).

A request belongs to the connection that submitted it: its events go there alone, only it can
abort the request, the same id from another connection is a collision refused to that
connection, and when a connection ends every request it owns is aborted (nothing decodes for
nobody). The decoder's engine thread is the only caller, so there is no lock.
"""

from __future__ import annotations

from enum import Enum

from disagg.control.channel import Channel


class Claim(Enum):
    """What `RequestOwners.claim` made of a submitted id."""

    NEW = "new"  # recorded: the request is this connection's now
    SAME_CONNECTION = "same_connection"  # this connection has it in flight already
    OTHER_CONNECTION = "other_connection"  # another connection's request has that id


class RequestOwners:
    """Request id -> the router connection that submitted it, while the request is in flight."""

    def __init__(self) -> None:
        self._owners: dict[str, Channel] = {}

    def claim(self, request_id: str, channel: Channel) -> Claim:
        """Record `channel` as the owner of a new `request_id`, or say whose it is."""
        owner = self._owners.get(request_id)
        if owner is None:
            self._owners[request_id] = channel
            return Claim.NEW
        return Claim.SAME_CONNECTION if owner is channel else Claim.OTHER_CONNECTION

    def owner(self, request_id: str) -> Channel | None:
        """The connection that hears about `request_id`, or None if it is not in flight."""
        return self._owners.get(request_id)

    def owns(self, channel: Channel, request_id: str) -> bool:
        """Whether `channel` submitted `request_id` (only it may abort the request)."""
        return self._owners.get(request_id) is channel

    def owned_by(self, channel: Channel) -> list[str]:
        """Every request id `channel` has in flight, oldest first."""
        return [rid for rid, owner in self._owners.items() if owner is channel]

    def release(self, request_id: str) -> None:
        """`request_id` ended (or was never admitted): its id is free again."""
        self._owners.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._owners
