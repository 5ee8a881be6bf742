"""What a prefill node and a decode node share: a typed inbox, a stop flag, an orderly close.

Reader threads and transfer callbacks never touch the engine: they put typed items in the
node's `Inbox` (`Wake`, or the node's own message records), and the engine thread drains it and
dispatches on the item's type. `close()` releases connections first (so no new work arrives
while the fabric drains), then the messenger, the transfer engine and the tracer. One accept
loop serves both nodes (S2): at most `MAX_CONNECTIONS` live connections, each read by its own
thread, which closes and forgets its channel however it ends; running out of descriptors
(EMFILE) pauses accepting, never ends it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from disagg.control.address import format_address, listen
from disagg.control.channel import Channel
from disagg.control.peer_process import peer_is_process
from disagg.engine.batch import TokenEvent
from disagg.utils.trace import Tracer
from transfer_core.transport import Transport

logger = logging.getLogger(__name__)
MAX_CONNECTIONS = 256  # live accepted connections per node: each holds a reader thread
ACCEPT_BACKOFF_S = 0.1  # after a failed accept (out of descriptors): wait, then retry


@dataclass(frozen=True, slots=True)
class Wake:
    """Something happened off the engine thread (a counter fired, a transfer ended): look."""


class Inbox:
    """What the engine thread has to act on, in arrival order."""

    def __init__(self) -> None:
        self._items: queue.Queue[object] = queue.Queue()

    def put(self, item: object) -> None:
        """Queue one item (any thread)."""
        self._items.put(item)

    def wake(self) -> None:
        """Ring the engine thread (the messengers' `wake` hook)."""
        self._items.put(Wake())

    def fail(self, error: BaseException) -> None:
        """Fail the node from another thread: `drain` raises `error` on the engine thread
        (a TP rank died, say: the node cannot step without it)."""
        self._items.put(error)

    def drain(self, handle: Callable[[Any], None], block: bool) -> None:
        """Hand every queued item to `handle`; with `block`, wait briefly (10 ms) for the
        first one."""
        while True:
            try:
                item = self._items.get(timeout=0.01) if block else self._items.get_nowait()
            except queue.Empty:
                return
            block = False
            if isinstance(item, BaseException):
                raise item
            handle(item)


class NodeBase:
    """Shutdown shared by `PrefillNode` and `DecodeNode` (subclasses set the attributes)."""

    _stop: threading.Event
    _server: socket.socket
    _channels: list[Channel]
    messenger: Any
    transfer: Transport
    tracer: Tracer
    engine: LLMEngine
    inbox: Inbox
    address: str

    def _listen(self, address: str) -> None:
        """Open the control socket; `address` is then the one peers reach us at."""
        self._server = listen(address)
        host, port = self._server.getsockname()[:2]
        self.address = format_address(host, port)

    def _start_accepting(self, serve: Callable[[Channel], None], kind: str,
                         max_connections: int = MAX_CONNECTIONS) -> threading.Thread:
        """Accept connections until `close()`, each served by `serve(channel)` in its own
        thread; `kind` names the peers in logs and channel names ("decoder", "router").
        Past `max_connections` live ones, a new connection is closed at once."""
        slots = threading.BoundedSemaphore(max_connections)
        thread = threading.Thread(target=self._accept_loop, args=(serve, kind, slots),
                                  daemon=True, name=f"{kind}-accept")
        thread.start()
        return thread

    def _accept_loop(self, serve: Callable[[Channel], None], kind: str,
                     slots: threading.BoundedSemaphore) -> None:
        last_error = 0
        while True:
            try:
                sock, peer = self._server.accept()
            except OSError as error:
                if self._stop.is_set() or self._server.fileno() < 0:
                    return  # close() shut the server socket: we are shutting down
                # Out of descriptors (EMFILE, ENFILE) or an aborted connection: readers that
                # end free descriptors, so wait a little and accept again.
                if error.errno != last_error:
                    logger.warning("accepting %s connections failed: %s; retrying", kind, error)
                last_error = error.errno or 0
                time.sleep(ACCEPT_BACKOFF_S)
                continue
            last_error = 0
            name = format_address(peer[0], peer[1])
            if not slots.acquire(blocking=False):
                logger.warning("refusing %s %s: at the limit of live connections", kind, name)
                sock.close()
                continue
            try:
                channel = Channel(sock, f"{kind} {name}")
            except (OSError, RuntimeError) as error:  # it died after accept; or no thread left
                logger.info("dropping %s %s: %s", kind, name, error)
                sock.close()
                slots.release()
                continue
            self._channels.append(channel)
            try:
                threading.Thread(target=self._serve_connection, args=(serve, channel, slots),
                                 daemon=True, name=f"{kind}-{peer[1]}").start()
            except RuntimeError as error:  # no thread to spare: as if over the cap
                logger.warning("dropping %s %s: %s", kind, name, error)
                channel.close()
                self._forget(channel)
                slots.release()

    def _serve_connection(self, serve: Callable[[Channel], None], channel: Channel,
                          slots: threading.BoundedSemaphore) -> None:
        """One reader thread: whatever ends it (the peer leaving, bad input, a bug, which
        still propagates), its channel is closed and forgotten and its slot freed."""
        try:
            serve(channel)
        finally:
            channel.close()
            self._forget(channel)
            slots.release()

    @staticmethod
    def _shutdown_refusal(channel: Channel) -> str | None:
        """Why `channel` may not shut this node down, or None if it may (X5d): with the
        cluster secret any peer that has it may; without one, only this process's parent."""
        if channel.secret is not None or peer_is_process(channel.sock, os.getppid()):
            return None
        return ("Shutdown refused: this node has no cluster secret and takes Shutdown only "
                "from the process that started it (or stop it with SIGTERM)")

    def _forget(self, channel: Channel) -> None:
        """Drop a channel that has ended from `_channels` (so a peer that left costs nothing)."""
        with contextlib.suppress(ValueError):  # never added, or forgotten already
            self._channels.remove(channel)

    def _traced_step(self) -> list[TokenEvent]:
        """One engine step, recorded as a `step` span when a batch ran."""
        start, num_steps = time.time(), self.engine.num_steps
        events = self.engine.step()
        batch = self.engine.last_batch
        if self.engine.num_steps != num_steps and batch is not None:
            self.tracer.complete("step", start, time.time(), num_tokens=batch.num_tokens,
                                 num_seqs=len(batch.chunks))
        return events

    @property
    def rank_pids(self) -> list[int]:
        """The pids of this node's TP ranks 1..N-1 (rank 0 is this process); [] at TP 1."""
        ranks = self.engine.runner.ranks
        return [] if ranks is None else list(ranks.pids)

    def peer_view(self) -> dict[str, Any]:
        """What this node's `/health` adds about its peers as it sees them (none here)."""
        return {}

    def health_state(self) -> str:
        """What `/health` says while the node runs: "ok" (200), or why not (503)."""
        return "ok"

    def wind_down(self, timeout_s: float = 5.0) -> None:
        """After a Shutdown, before `check_clean`: end what is still in flight (a no-op for a
        node whose work all ends with its clients)."""

    def stop(self) -> None:
        """Ask `run` to return."""
        self._stop.set()

    def close(self) -> None:
        """Close connections, the messenger and the fabric."""
        self._stop.set()
        with contextlib.suppress(OSError):  # shutdown wakes the accept loop; close may not
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        for channel in list(self._channels):  # readers forget theirs as they end
            channel.close()
        self.messenger.close()
        self.transfer.close()  # deregisters every rank's KV before the ranks unmap it
        self.engine.close()
        self.tracer.close()
