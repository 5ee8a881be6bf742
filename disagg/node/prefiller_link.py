"""Bringing a decoder's lost prefiller back (S2a, X4d).

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

from disagg.control.backoff import Backoff
from disagg.control.channel import Channel
from disagg.errors import DisaggError
from disagg.kv_transfer.messages import HelloAck
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
