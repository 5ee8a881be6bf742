"""The Chrome/Perfetto trace file of one process, made from its OpenTelemetry spans (X7a).

`PerfettoFile` is a span exporter: every span the process's `Tracer` ends becomes a complete
event ("X"), or an instant ("i") when the tracer marked it so, on its thread's track or on a
named one (one per request, say) so that overlapping spans never share a row. Counters are no
OpenTelemetry concept; the tracer hands them here directly. `shutdown()` writes
`{"traceEvents": [...]}`, which `trace_merge.py` merges across processes: timestamps are
wall-clock microseconds, so files from processes on one machine line up.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

# Span attributes the tracer sets for this file's sake; they are not an event's args.
INSTANT = "disagg.instant"
TRACK = "disagg.track"
SCOPE = "disagg.scope"
PROCESS_SCOPE = "process"  # SCOPE of a span in no request's trace (not exported over OTLP)
THREAD_ID = "thread.id"  # OpenTelemetry's semantic conventions name these two
THREAD_NAME = "thread.name"
HIDDEN = frozenset({INSTANT, TRACK, SCOPE, THREAD_ID, THREAD_NAME})
NAMED_TRACK_BASE = 2**30  # tids no real thread has (Linux caps them at 2**22)


def _us(ns: int) -> float:
    """Epoch ns as µs without the rounding of `ns / 1e3` (ns since 1970 exceed a float's 53
    bits; µs do not)."""
    return ns // 1000 + (ns % 1000) / 1e3


class PerfettoFile(SpanExporter):
    """Collects one process's spans as trace events and writes them on `shutdown()`."""

    def __init__(self, path: str, process_name: str, pid: int) -> None:
        self.path = path
        self.process_name = process_name
        self.pid = pid
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._track_names: dict[int, str] = {}  # tid -> thread or track name
        self._tracks: dict[str, int] = {}  # named track -> its tid
        self._written = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            attributes = dict(span.attributes or {})
            start_ns = span.start_time or 0
            args = {key: value for key, value in attributes.items() if key not in HIDDEN}
            track = attributes.get(TRACK)
            self.event(span.name, start_ns, span.end_time or start_ns, args,
                       bool(attributes.get(INSTANT)), str(track) if track is not None else None,
                       int(attributes.get(THREAD_ID, 0)), str(attributes.get(THREAD_NAME, "")))
        return SpanExportResult.SUCCESS

    def event(self, name: str, start_ns: int, end_ns: int, args: dict[str, Any],
              instant: bool, track: str | None, thread_id: int, thread_name: str) -> None:
        """One span as an event: what `export` makes of a span, and what the tracer writes
        here directly for a span no other destination takes (`Tracer`)."""
        start = _us(start_ns)
        if instant:
            event = {"name": name, "ph": "i", "s": "t", "ts": start, "args": args}
        else:
            event = {"name": name, "ph": "X", "ts": start,
                     "dur": _us(max(0, end_ns - start_ns)), "args": args}
        self._add(event, track, thread_id, thread_name)

    def counter(self, name: str, ts_us: float, values: dict[str, float], thread_id: int,
                thread_name: str) -> None:
        """Counter values at `ts_us`: Perfetto draws one series per key."""
        self._add({"name": name, "ph": "C", "ts": ts_us, "args": values}, None, thread_id,
                  thread_name)

    def _add(self, event: dict[str, Any], track: str | None, thread_id: int,
             thread_name: str) -> None:
        event["pid"] = self.pid
        with self._lock:
            if track is None:
                event["tid"] = thread_id
                self._track_names.setdefault(thread_id, thread_name)
            else:
                event["tid"] = self._tracks.setdefault(track, NAMED_TRACK_BASE + len(self._tracks))
                self._track_names[event["tid"]] = track
            self._events.append(event)

    def shutdown(self) -> None:
        """Write the file, once."""
        with self._lock:
            if self._written:
                return
            self._written = True
            meta = [{"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0,
                     "args": {"name": self.process_name}}]
            meta += [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid,
                      "args": {"name": name}} for tid, name in self._track_names.items()]
            events = [*meta, *self._events]
        with open(self.path, "w") as file:
            json.dump({"traceEvents": events}, file)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
