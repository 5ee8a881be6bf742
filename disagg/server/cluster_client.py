"""The front door's handle on the cluster: `Router` events turned into one asyncio stream per
request (S2a), with admission control.

The router reads every decoder's `RequestEvent`s into one thread-safe queue. A dispatcher
thread hands each event to the asyncio queue of its request, on the server's event loop. A
request that its caller stops reading (a client that went away, a stop string) is aborted in
the cluster, so nothing keeps generating for nobody. At most `max_in_flight` requests are in
the cluster at once; one more is refused (HTTP 429) rather than queued without bound.
Request ids are random (uuid4), so they are unique across front doors and restarts (X5d).
Each `Submit` carries the current span's context (the HTTP request's, `tracing.py`), so the
decoder's spans join its trace (X7a); `route` and `first_token` are recorded in it here.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator

from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import RequestState, SamplingParams
from disagg.errors import PeerClosedError
from disagg.node.router import Router
from disagg.node.wire_sampling import submit_fields
from disagg.server.errors import Overloaded, Unavailable
from disagg.utils.trace import Tracer, traceparent_of


class RequestStream:
    """The events of one submitted request, until a terminal one."""

    def __init__(self, client: ClusterClient, request_id: str, n: int = 1) -> None:
        self.client = client
        self.request_id = request_id
        self.choices_left = n  # each of the `n` choices ends with a terminal event
        self.queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.received = False  # any event yet: the decoder has taken it
        self.received_tokens = False
        self.finished = False

    async def events(self) -> AsyncIterator[RequestEvent]:
        try:
            while not self.finished:
                event = await self.queue.get()
                if event.token_ids and not self.received_tokens:
                    self.received_tokens = True
                    self.client.tracer.instant("first_token", request_id=self.request_id)
                self.received = True
                if event.state.is_terminal():
                    self.choices_left -= 1
                    # A failure ends them all (the decoder stops the others); an abort may
                    # be of one choice (`abort_choice`).
                    self.finished = (self.choices_left == 0
                                     or event.state is RequestState.FINISHED_FAILED)
                yield event
        finally:
            self.close()

    def abort_choice(self, index: int) -> None:
        """Stop one of the request's choices in the cluster (it met a stop string); its
        terminal event still comes."""
        if not self.finished:
            self.client.router.abort(self.request_id, index)

    def close(self) -> None:
        """Stop listening; a request not finished yet is aborted in the cluster."""
        self.client.release(self.request_id)
        if not self.finished:
            self.finished = True
            self.client.router.abort(self.request_id)


class ClusterClient:
    """Submit requests to the decoders behind a `Router` and stream their events."""

    def __init__(self, router: Router, max_in_flight: int = 256,
                 tracer: Tracer | None = None) -> None:
        self.router = router
        self.tracer = tracer or Tracer()
        self.max_in_flight = max_in_flight
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._dispatch, name="front-door-events",
                                        daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests submitted that no decoder has answered yet."""
        with self._lock:
            return sum(not stream.received for stream in self._streams.values())

    def open(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Admit and submit one request now (event loop thread): `Overloaded` past the
        in-flight limit, `Unavailable` with no live decoder. Iterate the stream it returns;
        leaving it unfinished (or `close()`) aborts the request in the cluster."""
        request_id = uuid.uuid4().hex  # also the response's id: chatcmpl-<this>
        stream = RequestStream(self, request_id, params.n)
        with self._lock:
            if len(self._streams) >= self.max_in_flight:
                raise Overloaded(f"{self.max_in_flight} requests are in flight; try again later")
            self._streams[request_id] = stream
        started = time.time()
        try:
            decoder = self.router.route(Submit(request_id, prompt_token_ids,
                                               traceparent=traceparent_of(),
                                               **submit_fields(params)))
            self.tracer.complete("route", started, time.time(), request_id=request_id,
                                 decoder=decoder)
        except PeerClosedError as error:
            self.release(request_id)
            raise Unavailable(f"no decoder can take the request: {error}") from None
        return stream

    def release(self, request_id: str) -> None:
        """Stop dispatching `request_id`'s events (its stream is done with them)."""
        with self._lock:
            self._streams.pop(request_id, None)

    def _dispatch(self) -> None:
        while not self._stopped.is_set():
            event = self.router.events.get()
            with self._lock:
                stream = self._streams.get(event.request_id)
            if stream is None:
                continue  # a request whose caller left: its abort is on the way
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, event)
            except RuntimeError:
                continue  # that event loop closed: the server is stopping

    def close(self) -> None:
        """Stop dispatching and close the router's connections (the decoders keep running)."""
        self._stopped.set()
        # Wakes the dispatcher now, not at a next poll: no stream has this id.
        self.router.events.put(RequestEvent("", RequestState.FINISHED_ABORTED))
        self._thread.join(timeout=5)
        self.router.close()
