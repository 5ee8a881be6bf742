"""Chrome/Perfetto trace events, one file per process, on one wall clock (for S3 and S1 views).

Each node can record complete events (a span: request queueing, prefill, transfer tail, a
decode step), instant events (a layer's writes posted) and counters. Timestamps are
`time.time()` in microseconds, so files from processes on one machine line up when merged
(`trace_merge.py`). An event lands on its thread's track, or on a named `track` (one per
request, say) so that overlapping spans never share a row. A disabled tracer (no path) costs a
function call and nothing else.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class Tracer:
    """Collects events in memory and writes `{"traceEvents": [...]}` on `close()`."""

    def __init__(self, path: str | None = None, process_name: str = "disagg") -> None:
        self.path = path
        self.process_name = process_name
        self.pid = os.getpid()
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._track_names: dict[int, str] = {}  # tid -> thread or track name
        self._tracks: dict[str, int] = {}  # named track -> its tid

    @property
    def enabled(self) -> bool:
        """Whether events are being recorded."""
        return self.path is not None

    def complete(self, name: str, start_s: float, end_s: float, *, track: str | None = None,
                 **args: Any) -> None:
        """A span from `start_s` to `end_s` (`time.time()` seconds)."""
        if self.path is not None:
            self._add({"name": name, "ph": "X", "ts": start_s * 1e6,
                       "dur": max(0.0, end_s - start_s) * 1e6, "args": args}, track)

    def instant(self, name: str, *, at_s: float | None = None, track: str | None = None,
                **args: Any) -> None:
        """A point in time: `at_s` (`time.time()` seconds), or now."""
        if self.path is not None:
            ts = (time.time() if at_s is None else at_s) * 1e6
            self._add({"name": name, "ph": "i", "s": "t", "ts": ts, "args": args}, track)

    def counter(self, name: str, *, at_s: float | None = None, **values: float) -> None:
        """Counter values at `at_s` (or now): Perfetto draws one series per keyword."""
        if self.path is not None:
            ts = (time.time() if at_s is None else at_s) * 1e6
            self._add({"name": name, "ph": "C", "ts": ts, "args": values}, None)

    def _add(self, event: dict[str, Any], track: str | None) -> None:
        event["pid"] = self.pid
        with self._lock:
            if track is None:
                event["tid"] = threading.get_native_id()
                self._track_names.setdefault(event["tid"], threading.current_thread().name)
            else:
                # A named track gets a tid no real thread has (Linux caps them at 2**22).
                event["tid"] = self._tracks.setdefault(track, 2**30 + len(self._tracks))
                self._track_names[event["tid"]] = track
            self._events.append(event)

    def close(self) -> None:
        """Write the file (if enabled)."""
        if self.path is None:
            return
        meta = [{"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0,
                 "args": {"name": self.process_name}}]
        with self._lock:
            meta += [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid,
                      "args": {"name": name}} for tid, name in self._track_names.items()]
            events = [*meta, *self._events]
        with open(self.path, "w") as file:
            json.dump({"traceEvents": events}, file)


def trace_path(template: str | None, node_id: str) -> str | None:
    """`--trace` value for one node: a directory gets `<node_id>.json`; `{node_id}` is filled."""
    if template is None:
        return None
    if os.path.isdir(template):
        return os.path.join(template, f"{node_id}.json")
    return template.replace("{node_id}", node_id)
