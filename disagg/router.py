"""The router: sends each request to the least-loaded decoder and collects its events (S2a).

Requests start at decoders; the router only picks which one. One reader thread per decoder
turns its `RequestEvent`s into a single queue the caller drains.
"""

from __future__ import annotations

import queue
import threading

from disagg.channel import Channel
from disagg.errors import PeerClosedError, ProtocolError
from disagg.messages import Abort, RequestEvent, Shutdown, Submit


class Router:
    """Least-loaded routing over decoder control connections."""

    def __init__(self, decoder_addresses: list[str]) -> None:
        self.decoders = [Channel.connect(address) for address in decoder_addresses]
        self.in_flight = [0] * len(self.decoders)
        self.events: queue.Queue[RequestEvent] = queue.Queue()
        self._owner: dict[str, int] = {}
        self._lock = threading.Lock()
        for index, channel in enumerate(self.decoders):
            threading.Thread(target=self._read, args=(index, channel), daemon=True,
                             name=f"router-{index}").start()

    def submit(self, message: Submit) -> int:
        """Send a request to the decoder with the fewest in flight; returns its index."""
        with self._lock:
            index = min(range(len(self.decoders)), key=self.in_flight.__getitem__)
            self.in_flight[index] += 1
            self._owner[message.request_id] = index
        self.decoders[index].send(message)
        return index

    def abort(self, request_id: str) -> bool:
        """Tell the request's decoder that the client gave up; False if it is not in flight."""
        with self._lock:
            index = self._owner.get(request_id)
        if index is None:
            return False
        self.decoders[index].send(Abort(request_id))
        return True

    def _read(self, index: int, channel: Channel) -> None:
        while True:
            try:
                event = channel.recv()
            except (PeerClosedError, ProtocolError) as error:
                self.events.put(RequestEvent("", "decoder_gone", detail=f"decoder {index}: "
                                             f"{error}"))
                return
            if not isinstance(event, RequestEvent):
                continue
            if isinstance(event, RequestEvent) and event.state == "decoder_gone":
                continue
            if event.state.startswith("finished") or event.state == "failed":
                with self._lock:
                    if self._owner.pop(event.request_id, None) is not None:
                        self.in_flight[index] -= 1
            self.events.put(event)

    def shutdown(self) -> None:
        """Ask every decoder to exit, then close the connections."""
        for channel in self.decoders:
            try:
                channel.send(Shutdown())
            except PeerClosedError:
                pass  # already gone
        self.close()

    def close(self) -> None:
        """Close the connections (the decoders keep running)."""
        for channel in self.decoders:
            channel.close()
