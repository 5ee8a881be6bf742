"""The front door's HTTP span (X7a), on a bare ASGI app: named by the matched route, the
status recorded (a 5xx failed), the client's context continued, and handed on to the
decoders even when the front door records nothing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from disagg.server.tracing import TracingMiddleware
from disagg.utils.trace import Tracer, traceparent_of

CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _call(tracer: Tracer, path: str, status: int = 200,
          headers: list[tuple[bytes, bytes]] | None = None) -> list[str]:
    """Run one request through the middleware; returns the traceparent the app saw."""
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:  # noqa: ANN401
        scope["route"] = SimpleNamespace(path="/v1/things/{id}")  # as FastAPI records its match
        seen.append(traceparent_of())
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(_: dict[str, Any]) -> None:
        pass

    scope = {"type": "http", "method": "GET", "path": path, "headers": headers or []}
    asyncio.run(TracingMiddleware(app, tracer)(scope, None, send))
    return seen


def test_the_span_is_named_by_the_route_and_fails_on_a_5xx() -> None:
    exporter = InMemorySpanExporter()
    tracer = Tracer(process_name="front-door", exporters=[exporter])
    [inside] = _call(tracer, "/v1/things/whatever-a-client-made-up", status=503,
                     headers=[(b"traceparent", CLIENT.encode())])
    [span] = exporter.get_finished_spans()
    assert span.name == "GET /v1/things/{id}"
    assert span.attributes["http.response.status_code"] == 503
    assert span.status.status_code is StatusCode.ERROR
    assert f"{span.context.trace_id:032x}" == CLIENT.split("-")[1]
    assert inside.split("-")[2] == f"{span.context.span_id:016x}"  # Submit would carry this


def test_without_tracing_the_clients_context_still_goes_on() -> None:
    assert _call(Tracer(), "/v1/completions", headers=[(b"traceparent", CLIENT.encode())]) == [
        CLIENT]
    assert _call(Tracer(), "/v1/completions", headers=[(b"traceparent", b"x" * 4000)]) == [""]


def test_health_checks_are_not_traced() -> None:
    exporter = InMemorySpanExporter()
    _call(Tracer(process_name="front-door", exporters=[exporter]), "/health")
    assert exporter.get_finished_spans() == ()
