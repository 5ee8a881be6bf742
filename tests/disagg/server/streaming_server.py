"""A front door in its own process, over a router that streams a token to every request every
few milliseconds until it is aborted: for tests that read the server's log (its stderr).

Run as `python -m tests.disagg.server.streaming_server`. It prints `READY http://HOST:PORT`
(from `serve_http`), then `SUBMIT <id>` and `ABORT <id>` as the router sees them.
"""

from __future__ import annotations

import sys
import threading
import time

from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import RequestState
from disagg.server.app import FrontDoor
from disagg.server.http_config import HTTPConfig
from disagg.server.http_server import serve_http
from tests.disagg.server.app_harness import FakeRouter, make_door

TOKEN_INTERVAL_S = 0.02
MAX_TOKENS = 100_000


class StreamingRouter(FakeRouter):
    """Every routed request gets one token per `TOKEN_INTERVAL_S` until aborted."""

    def __init__(self) -> None:
        super().__init__()
        self._active: dict[str, int] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._tick, daemon=True).start()

    def route(self, message: Submit) -> int:
        with self._lock:
            self._active[message.request_id] = 0
        _say(f"SUBMIT {message.request_id}")
        return 0

    def abort(self, request_id: str) -> bool:
        with self._lock:
            self._active.pop(request_id, None)
        _say(f"ABORT {request_id}")
        return True

    def _tick(self) -> None:
        while True:
            time.sleep(TOKEN_INTERVAL_S)
            with self._lock:
                for request_id, count in list(self._active.items()):
                    self._active[request_id] = count + 1
                    done = count + 1 >= MAX_TOKENS
                    state = RequestState.FINISHED_LENGTH if done else RequestState.RUNNING
                    self.events.put(RequestEvent(request_id, state, [5]))
                    if done:
                        del self._active[request_id]


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    door: FrontDoor = make_door(StreamingRouter(), max_in_flight=1024)
    serve_http(door, HTTPConfig(port=0))


if __name__ == "__main__":
    main()
