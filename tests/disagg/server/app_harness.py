"""The HTTP app in this process, in front of a scripted stand-in for the cluster's router.

`FakeRouter` offers what `ClusterClient` uses of `Router` (submit, abort, alive, events);
each submitted request gets the events its script returns (for each of its `n` choices, when
the script speaks for one), or none until the test sends them. The app runs under the front door's own HTTP server (`http_server.py`, uvicorn with its
limits) on a free port in a thread.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import uvicorn

from disagg.config import PRESETS
from disagg.control.messages import Abort, RequestEvent, Submit
from disagg.errors import PeerClosedError
from disagg.server.app import FrontDoor
from disagg.server.cluster_client import ClusterClient
from disagg.server.http_config import HTTPConfig
from disagg.server.http_server import http_server
from disagg.server.metrics import ServerMetrics

Script = Callable[[Submit], list[RequestEvent]]


class FakeRouter:
    def __init__(self, script: Script | None = None) -> None:
        self.script = script
        self.alive = [True]
        self.events: queue.Queue[RequestEvent] = queue.Queue()
        self.submitted: list[Submit] = []
        self.aborted: list[str] = []

    def route(self, message: Submit) -> int:
        if not any(self.alive):
            raise PeerClosedError("no decoder is alive")
        self.submitted.append(message)
        events = self.script(message) if self.script else []
        if message.n > 1 and all(event.index == 0 for event in events):
            # A script written for one choice: every fork of the request says the same.
            events = [replace(event, index=i) for event in events for i in range(message.n)]
        for event in events:
            self.events.put(event)
        return 0

    def abort(self, request_id: str, choice: int = -1) -> bool:
        self.aborted.append(Abort(request_id, choice).request_id)
        return True

    def close(self) -> None:
        pass


def make_door(router: FakeRouter, max_in_flight: int = 8, tokenizer=None,  # noqa: ANN001
              chat_template=None) -> FrontDoor:  # noqa: ANN001
    """The app's state for the tiny model in front of `router`."""
    client = ClusterClient(router, max_in_flight)  # type: ignore[arg-type]
    return FrontDoor("tiny", PRESETS["tiny"], tokenizer, chat_template, client,
                     ServerMetrics("tiny", waiting=lambda: client.num_waiting),
                     lambda: (True, {"status": "ok", "nodes": []}))


class _PromptServer(uvicorn.Server):
    """uvicorn's server, noticing `should_exit` within milliseconds: its own loop looks every
    100 ms, which made each of the hundreds of apps these tests start take a quarter second
    to stop. Its ticks and its shutdown (connections closed, tasks awaited) are uvicorn's."""

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):  # the Date header, then should_exit
            counter += 1
            await asyncio.sleep(0.005)


@contextmanager
def running_app(router: FakeRouter, max_in_flight: int = 8, tokenizer=None,  # noqa: ANN001
                chat_template=None, http: HTTPConfig | None = None,  # noqa: ANN001
                ) -> Iterator[tuple[str, FrontDoor]]:
    """(host:port, the app's state) while the app serves on 127.0.0.1 under `http`'s limits
    (its host and port are ignored)."""
    door = make_door(router, max_in_flight, tokenizer, chat_template)
    client = door.client
    fields = {k: getattr(http, k) for k in http.__dataclass_fields__} if http else {}
    server = _PromptServer(
        http_server(door, HTTPConfig(**{**fields, "host": "127.0.0.1", "port": 0})).config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}", door
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        client.close()
        door.executor.shutdown(wait=False, cancel_futures=True)


def post(address: str, path: str, body: dict | bytes) -> tuple[int, dict | str]:
    """POST a JSON body; (status, the decoded JSON or, for a stream, the raw text)."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, raw, {"Content-Type": "application/json"})
    reply = connection.getresponse()
    text = reply.read().decode()
    if reply.getheader("content-type", "").startswith("text/event-stream"):
        return reply.status, text
    return reply.status, json.loads(text)
