"""A decoder's links to its prefillers, and bringing a lost one back (S2a, S2c, X4d).

`PrefillerLinks` is the decoder's side of every prefiller connection: the handshake at
start-up (a prefiller that refuses stops the node), one reader thread per connection that
turns its messages into the node's inbox records (`FromPrefiller`, `PrefillerGone`), the
check for prefillers silent too long, and the view `/health` shows. The engine thread decides
what a record means for the requests (`DecodeMessenger`); this file only keeps the links.

A prefiller that was lost (its connection broke, or it fell silent: frozen, restarted, cut
off) is tried again with doubling waits (`disagg.control.backoff`), from a thread of its own,
until a new handshake (`disagg.kv_transfer.handshake.shake_hands`, S5) succeeds or the node
stops; the engine thread then takes it back through its inbox (`PrefillerBack`). Its requests
were settled when it was lost (`disagg.kv_transfer.kv_recovery`), so a link comes back empty.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from disagg.control.backoff import Backoff
from disagg.control.channel import Channel
from disagg.control.liveness import PEER_TIMEOUT_S
from disagg.control.messages import Heartbeat, Reject
from disagg.errors import DisaggError, PeerClosedError, ProtocolError
from disagg.kv_transfer.decode_messenger import DecodeMessenger
from disagg.kv_transfer.handshake import shake_hands
from disagg.kv_transfer.messages import HelloAck, KVFailed
from disagg.node.decode_inbox import FromPrefiller, PrefillerGone
from transfer_core.errors import TransferError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefillerBack:
    """Prefiller `index` shook hands again: its new connection and answer."""

    index: int
    channel: Channel
    ack: HelloAck


class Reconnector:
    """Tries lost prefillers again, one thread each, until they are back or `stop` is set."""

    def __init__(self, addresses: list[str], connect: Callable[[str], tuple[Channel, HelloAck]],
                 back: Callable[[PrefillerBack], None], stop: threading.Event) -> None:
        self.addresses = addresses
        self._connect = connect
        self._back = back  # the node's inbox: the engine thread takes the prefiller back
        self._stop = stop
        self._trying: set[int] = set()
        self._lock = threading.Lock()

    def lost(self, index: int) -> None:
        """Prefiller `index` is gone: start trying to reach it again (once)."""
        with self._lock:
            if index in self._trying or self._stop.is_set():
                return
            self._trying.add(index)
        threading.Thread(target=self._retry, args=(index,), daemon=True,
                         name=f"reconnect-prefiller-{index}").start()

    def _retry(self, index: int) -> None:
        address, backoff = self.addresses[index], Backoff()
        while not self._stop.wait(backoff.next()):
            try:
                channel, ack = self._connect(address)
            except (DisaggError, TransferError, OSError) as error:
                logger.info("prefiller %s still unreachable (%s); next try in %g s", address,
                            error, backoff.wait_s)
                continue
            with self._lock:
                self._trying.discard(index)
            logger.info("prefiller %s is back", address)
            self._back(PrefillerBack(index, channel, ack))
            return


class PrefillerLinks:
    """A decoder's prefiller connections, in the order of `addresses` (the messenger's pool
    indices). `track` and `forget` keep the node's list of open channels (closed at its end);
    `put` is the node's inbox."""

    def __init__(self, addresses: list[str], messenger: DecodeMessenger, num_domains: int,
                 put: Callable[[object], None], stop: threading.Event,
                 track: Callable[[Channel], None], forget: Callable[[Channel], None]) -> None:
        self.addresses = list(addresses)
        self._messenger = messenger
        self._num_domains = num_domains
        self._put = put
        self._track, self._forget = track, forget
        for address in self.addresses:  # a prefiller that refuses us stops the node here
            self.use(*self.handshake(address))
        self._reconnector = Reconnector(self.addresses, self.handshake, put, stop)

    def handshake(self, address: str) -> tuple[Channel, HelloAck]:
        channel, ack = shake_hands(address, self._messenger.hello(), self._messenger.context,
                                   self._num_domains)
        self._track(channel)
        return channel, ack

    def use(self, channel: Channel, ack: HelloAck, index: int | None = None) -> None:
        """Send requests to a prefiller that shook hands (`index`: one that is back)."""
        index = self._messenger.add_prefiller(channel, ack, index)
        threading.Thread(target=self._read, args=(channel, index), daemon=True,
                         name=f"decode-prefiller-{index}").start()

    def _read(self, channel: Channel, index: int) -> None:
        reason = "its reader thread failed"  # kept if an exception escapes (it propagates)
        try:
            while True:
                try:
                    message = channel.recv()
                except (PeerClosedError, ProtocolError) as error:
                    reason = str(error)
                    return
                if isinstance(message, KVFailed):
                    self._put(FromPrefiller(message))
                elif isinstance(message, Heartbeat):
                    continue  # recv() already noted that the prefiller is alive
                elif isinstance(message, Reject):
                    logger.warning("prefiller %s rejected a message: %s", channel.peer,
                                   message.reason)
        finally:  # however it ends, the connection is closed and forgotten
            channel.close()
            self._forget(channel)
            self._put(PrefillerGone(index, reason, channel))

    def gone(self, index: int, reason: str, channel: Channel | None) -> None:
        """The engine thread's answer to `PrefillerGone`: settle the prefiller's requests
        (unless a newer connection replaced that one) and start trying to reach it again."""
        if channel is None or self._messenger.pool.is_current(index, channel):
            self._messenger.prefiller_gone(index, reason)
            self._reconnector.lost(index)

    def close_silent(self) -> None:
        """Declare a prefiller gone when it has been silent too long (heartbeats go from
        their own thread, `start_heartbeats`)."""
        pool = self._messenger.pool
        for index in pool.silent():
            pool.link(index).channel.close()  # its reader then reports it gone
            self._messenger.prefiller_gone(index, f"silent for {PEER_TIMEOUT_S:g} s")

    def view(self) -> dict[str, Any]:
        """Its prefillers, each alive or not as this decoder sees them (for `/health`, read
        from the metrics thread: a snapshot of plain flags)."""
        pool = self._messenger.pool
        return {"prefillers": [{"address": address, "alive": index < len(pool)
                                and pool.link(index).alive}
                               for index, address in enumerate(self.addresses)]}
