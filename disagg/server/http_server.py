"""The front door's HTTP server: uvicorn over h11, with the connection-level limits that
uvicorn lacks (X1, X5b).

uvicorn has no deadline for a request's headers (a client sending one byte every few seconds
holds its connection for ever), arms its keep-alive timer only after a first response, and
checks its concurrency limit only once a request's headers are in. `BoundedH11Protocol` adds,
per connection: a cap on open connections (one more is answered 503 with `Retry-After` and
closed at once), a deadline for each request's headers (408, closed), 431 for headers over
`max_header_bytes`, and keep-alive from the moment the connection opens.

`serve_http` prints `READY http://HOST:PORT` once the server accepts connections and serves
until SIGINT or SIGTERM, then closes the front door's client. `AccessLog` writes one line per
request to the `disagg.access` logger (client, method, path, status, milliseconds) once its
response has ended; `enable_access_log` sends that logger to stderr (`serve cluster|router`
do, unless `--no-access-log`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from disagg.control.address import format_address
from disagg.server.app import FrontDoor, build_app
from disagg.server.errors import RETRY_AFTER_S
from disagg.server.http_config import HTTPConfig

ACCESS_LOG = logging.getLogger("disagg.access")


def _error_response(status: int, reason: str, message: str, retry: bool = False) -> bytes:
    """A whole HTTP/1.1 error response with an OpenAI-shaped body, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"
                                 if status < 500 else "service_unavailable", "param": None,
                                 "code": None}}).encode()
    headers = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
               f"content-length: {len(body)}", "connection: close"]
    if retry:
        headers.append(f"retry-after: {RETRY_AFTER_S}")
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and a header deadline (`limits`)."""

    limits: ClassVar[HTTPConfig] = HTTPConfig()

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        over = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        if over:
            self._refuse(503, "Service Unavailable", f"more than {self.limits.max_connections} "
                         "connections are open; try again later", retry=True)
            return
        # The client must send a request's headers in time, and an idle one is let go as
        # uvicorn does between requests (it arms that timer only after a first response).
        self._arm_header_timer()
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # reading a request's line and headers
            if self._header_timer is None:
                self._arm_header_timer()  # the first byte of a next request on this connection
            # h11 bounds only headers it has not seen the end of; bound those it has, too.
            buffered = self.conn.trailing_data[0] + data
            end = buffered.find(b"\r\n\r\n")
            if (len(buffered) if end < 0 else end + 4) > self.limits.max_header_bytes:
                self._refuse(431, "Request Header Fields Too Large", "the request line and "
                             f"headers are larger than {self.limits.max_header_bytes} bytes")
                return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # the headers are in (or the connection failed)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                  self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        # Only a request still waiting for its headers is late; a served one is not.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._refuse(408, "Request Timeout", "the request headers did not arrive within "
                         f"{self.limits.header_timeout_s:g} s")

    def _refuse(self, status: int, reason: str, message: str, retry: bool = False) -> None:
        self._cancel_header_timer()
        self._unset_keepalive_if_required()
        if not self.transport.is_closing():
            self.transport.write(_error_response(status, reason, message, retry))
            self.transport.close()


class AccessLog:
    """ASGI middleware: one `ACCESS_LOG` line per HTTP request once its response has ended
    (a stream when its last chunk is sent), e.g. `127.0.0.1 POST /v1/completions 200 41.2 ms`.
    Costs one check per request while the logger is off. Requests the protocol refuses before
    they reach the app (408, 431, 503 over --max-connections) are not in it."""

    def __init__(self, app: Any) -> None:  # noqa: ANN401 - any ASGI app
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:  # noqa: ANN401
        if scope["type"] != "http" or not ACCESS_LOG.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets if the app fails before it answers

        async def send_and_note(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            client = (scope.get("client") or ("-",))[0]
            ACCESS_LOG.info("%s %s %s %d %.1f ms", client, scope["method"], scope["path"],
                            status, (time.perf_counter() - start) * 1e3)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is at each line (a test's capture, then the real one)."""

    @property
    def stream(self) -> Any:  # noqa: ANN401 - a text stream
        return sys.stderr

    @stream.setter
    def stream(self, _: object) -> None:
        pass


def enable_access_log(enabled: bool = True) -> None:
    """Send `ACCESS_LOG` to stderr as bare lines (on), or silence it (off)."""
    ACCESS_LOG.propagate = False
    ACCESS_LOG.setLevel(logging.INFO if enabled else logging.WARNING)
    if not any(isinstance(h, _StderrHandler) for h in ACCESS_LOG.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        ACCESS_LOG.addHandler(handler)


def http_server(door: FrontDoor, http: HTTPConfig) -> uvicorn.Server:
    """A uvicorn server of the API over `door`, under `http`'s limits (not started)."""
    protocol = type("BoundedH11", (BoundedH11Protocol,), {"limits": http})
    return uvicorn.Server(uvicorn.Config(
        AccessLog(build_app(door, http)), host=http.host, port=http.port, log_level="warning",
        lifespan="off", timeout_graceful_shutdown=5, http=protocol,
        timeout_keep_alive=http.keep_alive_timeout_s,  # type: ignore[arg-type] - float works
        h11_max_incomplete_event_size=http.max_header_bytes))


def serve_http(door: FrontDoor, http: HTTPConfig) -> None:
    """Run the API until SIGINT/SIGTERM (uvicorn's own handlers)."""
    server = http_server(door, http)

    async def main() -> None:
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            sys.stdout.write(f"READY http://{format_address(host, port)}\n")
            sys.stdout.flush()
        await serving

    # uvicorn stops on SIGINT or SIGTERM, then raises the signal again to the handler it found:
    # a KeyboardInterrupt for both, caught here, so the caller still stops its nodes cleanly.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        door.client.close()
        door.executor.shutdown(wait=False, cancel_futures=True)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt
