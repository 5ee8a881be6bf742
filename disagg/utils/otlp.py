"""Spans to an OTLP/HTTP collector (Jaeger, Tempo, an OpenTelemetry Collector), X7a.

Only requests' spans go: a process's own spans (engine steps, counter bumps) stay in its
Perfetto file. They are batched off the serving threads, and a collector that is down costs
dropped spans and a log line, never a request. The exporter is the `otel` extra.
"""

from __future__ import annotations

import importlib.util
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from disagg.errors import ConfigError
from disagg.utils.perfetto import PROCESS_SCOPE, SCOPE

TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for spans
EXPORTER_PACKAGE = "opentelemetry.exporter.otlp.proto.http"
MISSING_EXPORTER = "--otlp-endpoint needs the OTLP exporter: pip install 'disagg[otel]'"


def traces_url(endpoint: str) -> str:
    """`http://host:4318` -> `http://host:4318/v1/traces`; a URL with a path is kept."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--otlp-endpoint {endpoint!r}: expected http(s)://host:port")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + TRACES_PATH


class RequestSpansOnly(SpanProcessor):
    """Hands `inner` the spans that belong to a request's trace."""

    def __init__(self, inner: SpanProcessor) -> None:
        self._inner = inner

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._inner.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if (span.attributes or {}).get(SCOPE) != PROCESS_SCOPE:
            self._inner.on_end(span)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


def check_otlp_endpoint(endpoint: str) -> None:
    """`ConfigError` unless spans can go to `endpoint`: a URL, and the exporter installed
    (checked without importing it, before a node loads its model)."""
    traces_url(endpoint)
    try:
        found = importlib.util.find_spec(EXPORTER_PACKAGE) is not None
    except ModuleNotFoundError:  # a parent package is missing: find_spec imports parents
        found = False
    if not found:
        raise ConfigError(MISSING_EXPORTER)


def otlp_processor(endpoint: str) -> SpanProcessor:
    """A batching processor exporting requests' spans to `endpoint` over OTLP/HTTP."""
    url = traces_url(endpoint)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigError(MISSING_EXPORTER) from None
    return RequestSpansOnly(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=5)))
