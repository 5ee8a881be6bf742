"""Spans of a process, OpenTelemetry's, with the W3C trace context between processes (X7a).

One `Tracer` per process (a node, the front door, `generate`). What it records are
OpenTelemetry spans on a provider of its own, and they go to up to three places: the process's
Perfetto file (`--trace`, `perfetto.py`), an OTLP collector (`--otlp-endpoint`, `otlp.py`),
and any exporter a test hands it. So the Perfetto view and a trace in Jaeger or Tempo are made
of the same spans.

Spans come in two scopes. A request's spans have a parent: the W3C `traceparent` that the
control messages carry (`Submit`, `KVRequest`) or a span this process opened for the request
(`open`); they form one trace from the front door through a decoder to a prefiller. The
process's own spans (an engine step, a layer's counter bump) have none; they are in the
Perfetto file, not exported over OTLP (a trace per engine step would bury the requests).

Spans are recorded after the fact from `time.time()` seconds, as the nodes measure them, or
held open while a request lives (`open`/`end`). A process's own span that only the Perfetto
file takes (no exporter or processor was handed in; OTLP never takes them) skips the SDK and is
written there directly: the SDK's span costs about 100 us on a busy node, and a prefiller
records two a layer. A disabled tracer (no destination) costs a function call, and `open`
hands the incoming context on, so the prefiller's spans still join the front door's trace
through a decoder that records nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from enum import Enum
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from disagg.utils.perfetto import (
    INSTANT,
    PROCESS_SCOPE,
    SCOPE,
    THREAD_ID,
    THREAD_NAME,
    TRACK,
    PerfettoFile,
)

PROPAGATOR = TraceContextTextMapPropagator()


def context_of(traceparent: str | None) -> otel_context.Context | None:
    """The context a W3C `traceparent` names; None (no parent) for "" or a malformed one."""
    if not traceparent:
        return None
    ctx = PROPAGATOR.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent_of(ctx: otel_context.Context | None = None) -> str:
    """The W3C `traceparent` of `ctx` (default: the current context), "" without a span."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=ctx)
    return carrier.get("traceparent", "")


def _attributes(args: dict[str, Any]) -> dict[str, Any]:
    """Span attributes from keyword args: None left out, enums by value, others as text."""
    out: dict[str, Any] = {}
    for key, value in args.items():
        if value is None:
            continue
        if isinstance(value, Enum):
            value = value.value
        out[key] = value if isinstance(value, str | bool | int | float) else str(value)
    return out


def _ns(seconds: float) -> int:
    """Whole microseconds, as ns: a float of epoch seconds holds no finer (about 0.2 µs)."""
    return round(seconds * 1e6) * 1000


class Tracer:
    """Records spans to the destinations it was given; with none, records nothing."""

    def __init__(self, path: str | None = None, process_name: str = "disagg", *,
                 otlp_endpoint: str | None = None,
                 exporters: Sequence[SpanExporter] = (),
                 processors: Sequence[SpanProcessor] = ()) -> None:
        self.path = path
        self.process_name = process_name
        self.pid = os.getpid()
        self._open: dict[str, trace.Span] = {}  # spans held while their request lives
        self._lock = threading.Lock()
        self._perfetto: PerfettoFile | None = None
        self._provider: TracerProvider | None = None
        self._otel: trace.Tracer | None = None
        # Where process spans go without the SDK: the Perfetto file, when nothing else of
        # the caller's would see them.
        self._direct: PerfettoFile | None = None
        if path is None and otlp_endpoint is None and not exporters and not processors:
            return
        # Closed by its owner (`close`), not at exit: by then a Perfetto file's directory may
        # be gone (the demo's temporary one).
        self._provider = TracerProvider(resource=Resource.create({
            SERVICE_NAME: "disagg", SERVICE_INSTANCE_ID: process_name, "process.pid": self.pid}),
            shutdown_on_exit=False)
        if path is not None:
            self._perfetto = PerfettoFile(path, process_name, self.pid)
            self._provider.add_span_processor(SimpleSpanProcessor(self._perfetto))
            if not exporters and not processors:
                self._direct = self._perfetto
        for exporter in exporters:  # each sees every span, as it ends
            self._provider.add_span_processor(SimpleSpanProcessor(exporter))
        for processor in processors:
            self._provider.add_span_processor(processor)
        if otlp_endpoint is not None:
            from disagg.utils.otlp import otlp_processor  # its exporter is the otel extra

            self._provider.add_span_processor(otlp_processor(otlp_endpoint))
        self._otel = self._provider.get_tracer("disagg")

    @property
    def enabled(self) -> bool:
        """Whether spans are being recorded."""
        return self._otel is not None

    @property
    def num_open(self) -> int:
        """Spans opened and not ended yet (a request still alive here, or one leaked)."""
        with self._lock:
            return len(self._open)

    def complete(self, name: str, start_s: float, end_s: float, *, track: str | None = None,
                 parent: str | None = None, **args: Any) -> None:
        """A span from `start_s` to `end_s` (`time.time()` seconds), in the trace of
        `parent` (a traceparent) if given, else of the current context, if any."""
        if (otel := self._otel) is not None:  # read once: `close` may run on another thread
            if not self._wrote_directly(name, start_s, max(start_s, end_s), False, track,
                                        parent, args):
                span = self._start(otel, name, start_s, track, parent, args)
                span.end(end_time=_ns(max(start_s, end_s)))

    def instant(self, name: str, *, at_s: float | None = None, track: str | None = None,
                parent: str | None = None, **args: Any) -> None:
        """A point in time: `at_s` (`time.time()` seconds), or now."""
        if (otel := self._otel) is not None:
            at = time.time() if at_s is None else at_s
            if not self._wrote_directly(name, at, at, True, track, parent, args):
                span = self._start(otel, name, at, track, parent, {**args, INSTANT: True})
                span.end(end_time=_ns(at))

    def _wrote_directly(self, name: str, start_s: float, end_s: float, instant: bool,
                        track: str | None, parent: str | None, args: dict[str, Any]) -> bool:
        """A process span (no parent, no current request span) only the Perfetto file takes:
        written there as the SDK's span would be; False for any other."""
        direct = self._direct
        if direct is None or parent is not None or (
                trace.get_current_span().get_span_context().is_valid):
            return False
        direct.event(name, _ns(start_s), _ns(end_s), _attributes(args), instant, track,
                     threading.get_native_id(), threading.current_thread().name)
        return True

    def counter(self, name: str, *, at_s: float | None = None, **values: float) -> None:
        """Counter values at `at_s` (or now), for the Perfetto file (one series per key)."""
        if self._perfetto is not None:
            at = time.time() if at_s is None else at_s
            self._perfetto.counter(name, at * 1e6, values, threading.get_native_id(),
                                   threading.current_thread().name)

    def open(self, key: str, name: str, *, parent: str | None = None,
             start_s: float | None = None, track: str | None = None, **args: Any) -> str:
        """Start a span held under `key` until `end(key)`, in `parent`'s trace (a new one
        without); returns its traceparent, for the messages and spans that follow from it.
        Disabled: returns `parent` (if well-formed), so the trace goes on past this process."""
        if (otel := self._otel) is None:  # handed on as the propagator writes it: well-formed
            return traceparent_of(ctx) if (ctx := context_of(parent)) is not None else ""
        span = self._start(otel, name, time.time() if start_s is None else start_s, track,
                           parent, args, scoped=True)
        with self._lock:
            replaced = self._open.pop(key, None)
            self._open[key] = span
        if replaced is not None:  # the same key twice: the first one ends here
            replaced.set_attribute("disagg.replaced", True)
            replaced.end()
        return traceparent_of(trace.set_span_in_context(span))

    def end(self, key: str, *, end_s: float | None = None, failed: bool = False,
            **args: Any) -> None:
        """End the span opened under `key` (nothing if there is none), with `args` added;
        `failed` gives it the error status a tracing backend shows."""
        with self._lock:
            span = self._open.pop(key, None)
        if span is not None:
            span.set_attributes(_attributes(args))
            if failed:
                span.set_status(trace.StatusCode.ERROR)
            span.end(end_time=_ns(time.time() if end_s is None else end_s))

    @contextlib.contextmanager
    def server_span(self, name: str, traceparent: str | None = None,
                    **args: Any) -> Iterator[trace.Span | None]:
        """A span around serving one call (an HTTP request), current while it runs so that
        what it starts joins it; continues the caller's trace if it sent a traceparent.
        Disabled: no span (None), but the caller's context is current all the same, so the
        trace goes on past this process."""
        if (otel := self._otel) is None:
            span, ctx = None, context_of(traceparent)
        else:
            span = self._start(otel, name, time.time(), None, traceparent, args, scoped=True,
                               kind=trace.SpanKind.SERVER)
            ctx = trace.set_span_in_context(span)
        token = None if ctx is None else otel_context.attach(ctx)
        try:
            yield span
        finally:
            if token is not None:
                otel_context.detach(token)
            if span is not None:
                span.end()

    @staticmethod
    def _start(otel: trace.Tracer, name: str, start_s: float, track: str | None,
               parent: str | None, args: dict[str, Any], scoped: bool = False,
               kind: trace.SpanKind = trace.SpanKind.INTERNAL) -> trace.Span:
        ctx = context_of(parent) if parent else None
        in_request = scoped or ctx is not None or (
            parent is None and trace.get_current_span().get_span_context().is_valid)
        attributes = _attributes(args)
        attributes[THREAD_ID] = threading.get_native_id()
        attributes[THREAD_NAME] = threading.current_thread().name
        if track is not None:
            attributes[TRACK] = track
        if not in_request:
            attributes[SCOPE] = PROCESS_SCOPE
        if ctx is None and parent is not None:
            ctx = otel_context.Context()  # a traceparent that names nothing: a new trace
        return otel.start_span(name, context=ctx, kind=kind, attributes=attributes,
                                     start_time=_ns(start_s))

    def close(self) -> None:
        """End what is still open (marked unfinished), flush every destination, write the
        Perfetto file (if enabled). Once: the tracer records nothing after."""
        with self._lock:
            left, self._open = list(self._open.values()), {}
            provider, self._provider, self._otel = self._provider, None, None
        for span in left:
            span.set_attribute("disagg.unfinished", True)
            span.end()
        if provider is not None:
            provider.shutdown()


def trace_path(template: str | None, node_id: str) -> str | None:
    """`--trace` value for one node: a directory gets `<node_id>.json`; `{node_id}` is filled."""
    if template is None:
        return None
    if os.path.isdir(template):
        return os.path.join(template, f"{node_id}.json")
    return template.replace("{node_id}", node_id)
