"""Chrome/Perfetto trace events, one file per process, on one wall clock (for S3 and S1 views).

Each node can record complete events (a span: request queueing, prefill, transfer tail, a
decode step) and instant events (a layer's writes posted). Timestamps are `time.time()` in
microseconds, so files from processes on one machine line up when merged. A disabled tracer
(no path) costs a function call and nothing else.
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

    @property
    def enabled(self) -> bool:
        """Whether events are being recorded."""
        return self.path is not None

    def complete(self, name: str, start_s: float, end_s: float, **args: Any) -> None:
        """A span from `start_s` to `end_s` (`time.time()` seconds)."""
        if self.path is not None:
            self._add({"name": name, "ph": "X", "ts": start_s * 1e6,
                       "dur": max(0.0, end_s - start_s) * 1e6, "args": args})

    def instant(self, name: str, **args: Any) -> None:
        """A point in time, now."""
        if self.path is not None:
            self._add({"name": name, "ph": "i", "s": "t", "ts": time.time() * 1e6,
                       "args": args})

    def _add(self, event: dict[str, Any]) -> None:
        event["pid"] = self.pid
        event["tid"] = threading.get_ident() % 2**31
        with self._lock:
            self._events.append(event)

    def close(self) -> None:
        """Write the file (if enabled)."""
        if self.path is None:
            return
        meta = {"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0,
                "args": {"name": self.process_name}}
        with self._lock:
            events = [meta, *self._events]
        with open(self.path, "w") as file:
            json.dump({"traceEvents": events}, file)


def trace_path(template: str | None, node_id: str) -> str | None:
    """`--trace` value for one node: a directory gets `<node_id>.json`; `{node_id}` is filled."""
    if template is None:
        return None
    if os.path.isdir(template):
        return os.path.join(template, f"{node_id}.json")
    return template.replace("{node_id}", node_id)
