"""Counters, gauges and histograms a node exposes, in Prometheus' text format (issue 8).

Small on purpose: a `Metrics` registry per node, thread-safe increments, gauges read through a
callback at scrape time (pages in use), and `serve_metrics` for a `/metrics` HTTP endpoint.
"""

from __future__ import annotations

import bisect
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEFAULT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """A registry: `inc("name", labels)`, `observe("name", seconds)`, `gauge("name", fn)`."""

    def __init__(self, prefix: str = "disagg") -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._histograms: dict[str, list[float]] = {}  # name -> bucket counts + [sum, count]
        self._gauges: dict[str, Callable[[], float]] = {}
        self._counter_fns: set[str] = set()
        self._help: dict[str, str] = {}

    def describe(self, name: str, text: str) -> None:
        """Help text shown for `name`."""
        self._help[name] = text

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """Add `amount` to a counter (one series per label set)."""
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + amount

    def observe(self, name: str, value: float) -> None:
        """Record one value (seconds) in a histogram."""
        with self._lock:
            counts = self._histograms.setdefault(name, [0.0] * (len(DEFAULT_BUCKETS) + 2))
            index = bisect.bisect_left(DEFAULT_BUCKETS, value)
            for bucket in range(index, len(DEFAULT_BUCKETS)):
                counts[bucket] += 1
            counts[-2] += value
            counts[-1] += 1

    def gauge(self, name: str, read: Callable[[], float]) -> None:
        """A value read at scrape time."""
        self._gauges[name] = read

    def counter_from(self, name: str, read: Callable[[], float]) -> None:
        """A counter kept elsewhere (e.g. a messenger's stats), read at scrape time."""
        self._gauges[name] = read
        self._counter_fns.add(name)

    def value(self, name: str, **labels: str) -> float:
        """A counter's current value (0 if never incremented)."""
        with self._lock:
            return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def snapshot(self) -> dict[str, float]:
        """Every counter and gauge as `name{labels}` -> value (for JSON output)."""
        out = {}
        with self._lock:
            for (name, labels), value in sorted(self._counters.items()):
                out[name + _labels(labels)] = value
            for name, counts in self._histograms.items():
                out[f"{name}_count"], out[f"{name}_sum"] = counts[-1], counts[-2]
        for name, read in self._gauges.items():
            out[name] = float(read())
        return out

    def render(self) -> str:
        """Prometheus text exposition format."""
        lines = []
        with self._lock:
            counters = sorted(self._counters.items())
            histograms = {name: list(c) for name, c in self._histograms.items()}
        seen = set()
        for (name, labels), value in counters:
            full = f"{self.prefix}_{name}"
            if name not in seen:
                seen.add(name)
                lines += [f"# HELP {full} {self._help.get(name, name)}", f"# TYPE {full} counter"]
            lines.append(f"{full}{_labels(labels)} {value:g}")
        for name, counts in histograms.items():
            full = f"{self.prefix}_{name}"
            lines += [f"# HELP {full} {self._help.get(name, name)}", f"# TYPE {full} histogram"]
            for bound, count in zip(DEFAULT_BUCKETS, counts, strict=False):
                lines.append(f'{full}_bucket{{le="{bound:g}"}} {count:g}')
            lines += [f'{full}_bucket{{le="+Inf"}} {counts[-1]:g}', f"{full}_sum {counts[-2]:g}",
                      f"{full}_count {counts[-1]:g}"]
        for name, read in self._gauges.items():
            full = f"{self.prefix}_{name}"
            kind = "counter" if name in self._counter_fns else "gauge"
            lines += [f"# HELP {full} {self._help.get(name, name)}", f"# TYPE {full} {kind}",
                      f"{full} {float(read()):g}"]
        return "\n".join(lines) + "\n"


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text back into `name{labels}` -> value (comments skipped)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def serve_metrics(metrics: Metrics, address: tuple[str, int]) -> ThreadingHTTPServer:
    """Serve `GET /metrics` on `address` (host, port; an IPv4 or IPv6 host) from a daemon
    thread; returns the server."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server API)
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = metrics.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass  # scrapes are not worth a log line each

    class Server(ThreadingHTTPServer):
        # http.server binds IPv4 unless told; an IPv6 literal ("::1") needs AF_INET6.
        address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET

    server = Server(address, Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    return server
