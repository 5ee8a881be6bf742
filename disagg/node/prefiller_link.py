"""A decoder's links to its prefillers: the handshake, and bringing a lost one back (S2a, S5).

The handshake: Hello, then the prefiller's HelloAck (or a Reject naming what does not match),
then `HelloProof`, the nonce the prefiller wrote into our proof slot (we own the memory our
Hello named, S5). A prefiller that was lost (its connection broke, or it fell silent: frozen,
restarted, cut off) is tried again with doubling waits (`disagg.control.backoff`), from a
thread of its own, until a new handshake succeeds or the node stops; the engine thread then
takes it back through its inbox (`PrefillerBack`). Its requests were settled when it was lost
(quarantined, then retried elsewhere or failed, as issue 8 decided), so a link comes back
empty.
"""

from __future__ import annotations

import logging
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass

from disagg.control.backoff import Backoff
from disagg.control.channel import Channel
from disagg.control.messages import Reject
from disagg.errors import DisaggError, PeerClosedError, PeerMismatchError, ProtocolError
from disagg.kv_transfer.context_slot import read_proof
from disagg.kv_transfer.decode_messenger import DecodeMessenger
from disagg.kv_transfer.messages import HelloAck
from transfer_core.engine import TransferEngine
from transfer_core.errors import TransferError

logger = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 10.0  # for the prefiller's answer: a frozen one must not hold us


@dataclass(frozen=True, slots=True)
class PrefillerBack:
    """Prefiller `index` shook hands again: its new connection and answer."""

    index: int
    channel: Channel
    ack: HelloAck


def handshake(address: str, messenger: DecodeMessenger, transfer: TransferEngine,
              timeout_s: float = HANDSHAKE_TIMEOUT_S) -> tuple[Channel, HelloAck]:
    """Connect to the prefiller at `address` and shake hands; the channel is closed on any
    failure (`PeerMismatchError` when it refuses us, naming why)."""
    channel = Channel.connect(address, timeout_s)
    try:
        channel.send(messenger.hello())
        if not select.select([channel.sock], [], [], timeout_s)[0]:
            raise PeerClosedError(f"prefiller {address} did not answer the handshake in "
                                  f"{timeout_s:g} s")
        reply = channel.recv()
        if isinstance(reply, Reject):
            raise PeerMismatchError(f"prefiller {address} refused this decoder: {reply.reason}")
        if not isinstance(reply, HelloAck):
            raise ProtocolError(f"prefiller {address} answered {type(reply).__name__}")
        channel.send(read_proof(messenger.context, transfer.num_domains))
    except BaseException:
        channel.close()
        raise
    return channel, reply


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
