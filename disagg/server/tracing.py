"""The front door's span of each HTTP request, where a request's trace starts (X7a).

A pure ASGI middleware, so that a streamed answer's span lasts until its last byte: it opens
a server span (continuing the client's trace when it sends a W3C `traceparent` header), makes
it current while the route runs (the route's `Submit` carries it to a decoder,
`cluster_client.py`), and records the status code sent; a 5xx marks it failed. The span is
named by the route that matched (`POST /v1/completions`), never by the raw path, which any
client can make up. With tracing off, a client's context still goes on to the decoders.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from opentelemetry import trace

from disagg.utils.trace import Tracer

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
TRACED_PREFIX = "/v1/"  # the API's calls; health checks and scrapes would bury them
MAX_TRACEPARENT = 128  # version 00 is 55 characters; a longer header is ignored unread


class TracingMiddleware:
    """Wraps an ASGI app: one span per `/v1/` HTTP request."""

    def __init__(self, app: ASGIApp, tracer: Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(TRACED_PREFIX):
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "")
        with self.tracer.server_span(method, _traceparent(scope), **{
                "http.request.method": method}) as span:
            if span is None:  # tracing off: the client's context is current all the same
                await self.app(scope, receive, send)
                return

            async def send_recording(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        span.set_status(trace.StatusCode.ERROR)
                await send(message)

            try:
                await self.app(scope, receive, send_recording)
            finally:
                route = getattr(scope.get("route"), "path", None)  # FastAPI's match
                if route is not None:
                    span.update_name(f"{method} {route}")
                    span.set_attribute("http.route", route)


def _traceparent(scope: Scope) -> str | None:
    """The client's `traceparent` header, if it sent a plausible one (ASGI gives bytes)."""
    for name, value in scope.get("headers", []):
        if name == b"traceparent" and len(value) <= MAX_TRACEPARENT:
            return value.decode("latin-1")
    return None
