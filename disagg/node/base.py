"""What a prefill node and a decode node share: a stop flag, and an orderly shutdown.

Both listen for control connections, keep their channels, and own a messenger, a transfer
engine and a tracer; `close()` releases them in that order (connections first, so no new work
arrives while the fabric drains).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Any

from disagg.engine.llm_engine import LLMEngine, TokenEvent
from disagg.kv_transfer.channel import Channel
from disagg.utils.trace import Tracer
from transfer_core.engine import TransferEngine


class NodeBase:
    """Shutdown shared by `PrefillNode` and `DecodeNode` (subclasses set the attributes)."""

    _stop: threading.Event
    _server: socket.socket
    _channels: list[Channel]
    messenger: Any
    transfer: TransferEngine
    tracer: Tracer
    engine: LLMEngine
    inbox: queue.Queue[tuple[str, Any]]

    def _handle(self, kind: str, item: Any) -> None:
        """Act on one inbox entry (subclasses)."""
        raise NotImplementedError

    def _drain_inbox(self, block: bool) -> None:
        """Handle everything queued; with `block`, wait briefly (10 ms) for the first entry."""
        while True:
            try:
                kind, item = self.inbox.get(timeout=0.01) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            self._handle(kind, item)

    def _traced_step(self) -> list[TokenEvent]:
        """One engine step, recorded as a `step` span when a batch ran."""
        start, num_steps = time.time(), self.engine.num_steps
        events = self.engine.step()
        batch = self.engine.last_batch
        if self.engine.num_steps != num_steps and batch is not None:
            self.tracer.complete("step", start, time.time(), num_tokens=batch.num_tokens,
                                 num_seqs=len(batch.chunks))
        return events

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
