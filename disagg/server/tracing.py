"""The front door's span of each HTTP request, where a request's trace starts (X7a).

A pure ASGI middleware, so that a streamed answer's span lasts until its last byte: it opens
a server span (continuing the client's trace when it sends a W3C `traceparent` header), makes
it current while the route runs (the route's `Submit` carries it to a decoder,
`cluster_client.py`), and records the status code sent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from disagg.utils.trace import Tracer

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
TRACED_PREFIX = "/v1/"  # the API's calls; health checks and scrapes would bury them


class TracingMiddleware:
    """Wraps an ASGI app: one span per `/v1/` HTTP request."""

    def __init__(self, app: ASGIApp, tracer: Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.tracer.enabled or not path.startswith(
                TRACED_PREFIX):
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "")
        with self.tracer.server_span(f"{method} {path}", _traceparent(scope), **{
                "http.request.method": method, "url.path": path}) as span:

            async def send_recording(message: Message) -> None:
                if message["type"] == "http.response.start" and span is not None:
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            await self.app(scope, receive, send_recording)


def _traceparent(scope: Scope) -> str | None:
    """The client's `traceparent` header, if it sent one (ASGI gives headers as bytes)."""
    for name, value in scope.get("headers", []):
        if name == b"traceparent":
            return value.decode("latin-1")
    return None
