"""What a prefill node and a decode node share: a stop flag, and an orderly shutdown.

Both listen for control connections, keep their channels, and own a messenger, a transfer
engine and a tracer; `close()` releases them in that order (connections first, so no new work
arrives while the fabric drains).
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from disagg.channel import Channel
from disagg.trace import Tracer
from transfer_core.engine import TransferEngine


class NodeBase:
    """Shutdown shared by `PrefillNode` and `DecodeNode` (subclasses set the attributes)."""

    _stop: threading.Event
    _server: socket.socket
    _channels: list[Channel]
    messenger: Any
    transfer: TransferEngine
    tracer: Tracer

    def stop(self) -> None:
        """Ask `run` to return."""
        self._stop.set()

    def close(self) -> None:
        """Close connections, the messenger and the fabric."""
        self._stop.set()
        self._server.close()
        for channel in self._channels:
            channel.close()
        self.messenger.close()
        self.transfer.close()
        self.tracer.close()
