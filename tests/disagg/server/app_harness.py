"""The HTTP app in this process, in front of a scripted stand-in for the cluster's router.

`FakeRouter` offers what `ClusterClient` uses of `Router` (submit, abort, alive, events);
each submitted request gets the events its script returns, or none until the test sends
them. The app runs under uvicorn on a free port in a thread.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn

from disagg.config import PRESETS
from disagg.control.messages import Abort, RequestEvent, Submit
from disagg.errors import PeerClosedError
from disagg.server.app import FrontDoor, build_app
from disagg.server.cluster_client import ClusterClient
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
        for event in self.script(message) if self.script else []:
            self.events.put(event)
        return 0

    def abort(self, request_id: str) -> bool:
        self.aborted.append(Abort(request_id).request_id)
        return True

    def close(self) -> None:
        pass


@contextmanager
def running_app(router: FakeRouter, max_in_flight: int = 8, tokenizer=None,  # noqa: ANN001
                chat_template=None) -> Iterator[tuple[str, FrontDoor]]:  # noqa: ANN001
    """(base URL, the app's state) while the app serves on 127.0.0.1."""
    client = ClusterClient(router, max_in_flight)  # type: ignore[arg-type]
    door = FrontDoor("tiny", PRESETS["tiny"], tokenizer, chat_template, client,
                     ServerMetrics("tiny", waiting=lambda: client.num_waiting),
                     lambda: (True, {"status": "ok", "nodes": []}))
    server = uvicorn.Server(uvicorn.Config(build_app(door), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
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
