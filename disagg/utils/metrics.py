"""A node's counters, histograms and gauges in Prometheus' text format, and its `/health`
(X4, X7b).

Each node owns a `Metrics`: a small layer over its own `prometheus_client.CollectorRegistry`,
never the process-wide default one (several nodes share one test process). Counters and
histograms are prometheus_client's, made on first use; gauges and counters kept elsewhere (a
messenger's stats) are callbacks read at scrape time. One naming rule holds for every series the
project exports, nodes and front door alike (as vLLM's `vllm:`): the `disagg:` prefix, the unit
in the name (`_seconds`, `_bytes`, `_tokens`, `_pages`), counters and only counters ending in
`_total`. A node's own collector yields them all, leaving out the `_created` timestamps
prometheus_client adds to counters and histograms, so a scrape holds values only (sums over
keys stay sums); `ValuesOnly` does the same for the front door's metrics.

`serve_metrics` answers `GET /metrics` and `GET /health` on the node's metrics port;
`parse_metrics` reads a scrape back into a dict through prometheus_client's parser.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

PREFIX = "disagg:"
DEFAULT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COUNTER_KINDS = ("counter", "counter_from", "counters_from")


class Metrics:
    """One node's registry: `inc("name", labels)`, `observe("name", seconds)`,
    `gauge("name", fn)`, `counter_from("name", fn)`; `registry` is what a scrape collects.
    Names are given without the prefix; a counter's must end in `_total`, and no other's may."""

    def __init__(self, prefix: str = PREFIX) -> None:
        self.prefix = prefix
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._kinds: dict[str, str] = {}  # name -> counter, histogram, gauge or counter_from
        self._owned: dict[str, Counter | Histogram] = {}  # counters and histograms
        self._reads: dict[str, Callable[[], float]] = {}  # gauges and counters kept elsewhere
        self._help: dict[str, str] = {}
        self._families: dict[str, tuple[str, Callable[[], dict[str, float]]]] = {}
        self.registry.register(_Collector(self))

    def describe(self, name: str, text: str) -> None:
        """Help text shown for `name` (call it before the metric's first use)."""
        self._help[name] = text

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """Add `amount` to a counter, one series per label set; the label names are fixed by
        the first call."""
        counter = self._metric(name, "counter", tuple(sorted(labels)))
        (counter.labels(**labels) if labels else counter).inc(amount)

    def observe(self, name: str, value: float) -> None:
        """Record one value (seconds) in a histogram with `DEFAULT_BUCKETS`."""
        self._metric(name, "histogram", ()).observe(value)

    def gauge(self, name: str, read: Callable[[], float]) -> None:
        """A value read at scrape time."""
        self._claim(name, "gauge")
        self._reads[name] = read

    def counter_from(self, name: str, read: Callable[[], float]) -> None:
        """A counter kept elsewhere (e.g. a messenger's stats), read at scrape time."""
        self._claim(name, "counter_from")
        self._reads[name] = read

    def counters_from(self, name: str, label: str,
                      read: Callable[[], dict[str, float]]) -> None:
        """Counters kept elsewhere, one series per value of `label` (e.g. bytes per fabric
        domain), read at scrape time."""
        self._claim(name, "counters_from")
        self._families[name] = (label, read)

    def value(self, name: str, **labels: str) -> float:
        """A counter's or gauge's current value, a histogram's count (0 if never used)."""
        if name in self._reads:
            return float(self._reads[name]())
        metric = self._owned.get(name)
        for family in metric.collect() if metric is not None else ():
            for sample in family.samples:
                if sample.name in (f"{family.name}_total", f"{family.name}_count") \
                        and sample.labels == labels:
                    return sample.value
        return 0.0

    def snapshot(self) -> dict[str, float]:
        """Every counter and gauge, each histogram's `_count` and `_sum`, as `name{labels}` ->
        value with the prefix left off (for JSON output)."""
        out = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name != f"{family.name}_bucket":
                    name = sample.name.removeprefix(self.prefix)
                    out[sample_key(name, sample.labels)] = sample.value
        return out

    def render(self) -> str:
        """Prometheus text exposition format (`generate_latest` of this node's registry)."""
        return generate_latest(self.registry).decode()

    def collect(self) -> Iterator[Metric]:
        """Every family, gauges read now (what this node's registry yields at a scrape)."""
        with self._lock:
            owned, reads = list(self._owned.values()), list(self._reads.items())
            families = list(self._families.items())
        for metric in owned:
            yield from values_only(metric)
        for name, read in reads:
            kind = CounterMetricFamily if self._kinds[name] == "counter_from" else GaugeMetricFamily
            yield kind(self._full(name), self._help.get(name, name), value=float(read()))
        for name, (label, read_all) in families:
            family = CounterMetricFamily(self._full(name), self._help.get(name, name),
                                         labels=[label])
            for key, value in sorted(read_all().items()):
                family.add_metric([key], float(value))
            yield family

    def _metric(self, name: str, kind: str, labelnames: tuple[str, ...]) -> Any:
        metric = self._owned.get(name)
        if metric is not None and self._kinds[name] == kind:
            return metric
        with self._lock:
            self._claim_locked(name, kind)
            if name not in self._owned:
                full, text = self._full(name), self._help.get(name, name)
                # registry=None: this node's collector yields it, not the default registry.
                self._owned[name] = (Counter(full, text, labelnames, registry=None)
                                     if kind == "counter" else
                                     Histogram(full, text, buckets=DEFAULT_BUCKETS, registry=None))
            return self._owned[name]

    def _claim(self, name: str, kind: str) -> None:
        with self._lock:
            self._claim_locked(name, kind)

    def _claim_locked(self, name: str, kind: str) -> None:
        # The naming rule is checked where a name is first used, so no series can break it.
        if (kind in COUNTER_KINDS) != name.endswith("_total"):
            raise ValueError(f"metric {name!r}: a {kind}'s name "
                             f"{'must' if kind in COUNTER_KINDS else 'must not'} end in _total")
        known = self._kinds.setdefault(name, kind)
        if known != kind:
            raise ValueError(f"metric {name!r} is a {known}, not a {kind}")

    def _full(self, name: str) -> str:
        return f"{self.prefix}{name}"


class _Collector(Collector):
    """Adapts `Metrics` to the registry (its own `describe` means something else)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self.metrics.collect()


class ValuesOnly(Collector):
    """prometheus_client metrics made with `registry=None`, yielded without their `_created`
    series (the front door's registry holds one of these)."""

    def __init__(self, *metrics: Counter | Gauge | Histogram) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            yield from values_only(metric)


def values_only(metric: Counter | Gauge | Histogram) -> Iterator[Metric]:
    """`metric`'s families without the `_created` timestamp samples."""
    for family in metric.collect():
        created = f"{family.name}_created"
        family.samples = [s for s in family.samples if s.name != created]
        yield family


def sample_key(name: str, labels: dict[str, str]) -> str:
    """`name{a="x",b="y"}` (labels sorted, as the exposition writes them), or `name`."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def parse_metrics(text: str) -> dict[str, float]:
    """A scrape back into `name{labels}` -> value, one entry per sample, read by
    prometheus_client's own text parser."""
    return {sample_key(sample.name, sample.labels): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def health_reply(health: Callable[[], dict[str, Any]]) -> tuple[int, bytes]:
    """(HTTP status, JSON body) for `GET /health`: 200 when the report's state is "ok", 503
    otherwise; a report that raises is a 503 with state "error", never a dead endpoint."""
    try:
        report = dict(health())
    except Exception as error:  # noqa: BLE001 (any failure of the probe means unhealthy)
        report = {"state": "error", "error": repr(error)}
    return (200 if report.get("state") == "ok" else 503), json.dumps(report).encode()


SHUTDOWN_POLL_S = 0.1


def serve_metrics(metrics: Metrics, address: tuple[str, int],
                  health: Callable[[], dict[str, Any]] | None = None) -> ThreadingHTTPServer:
    """Serve `GET /metrics` on `address` (host, port; an IPv4 or IPv6 host) from a daemon
    thread, and `GET /health` (the JSON `health()` returns) when `health` is given; any other
    path is a 404. Returns the server (`shutdown()` stops it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server API)
            path = urlsplit(self.path).path
            if path == "/metrics":
                self._reply(200, generate_latest(metrics.registry), CONTENT_TYPE_PLAIN_0_0_4)
            elif path == "/health" and health is not None:
                self._reply(*health_reply(health), content_type="application/json")
            else:
                self.send_error(404)

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass  # scrapes and probes are not worth a log line each

    class Server(ThreadingHTTPServer):
        # http.server binds IPv4 unless told; an IPv6 literal ("::1") needs AF_INET6.
        address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET

    server = Server(address, Handler)
    # `shutdown()` waits for the loop's next look at its flag: a tenth of a second, not the
    # default half (a wake-up per 0.1 s costs an idle node nothing it would notice).
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                     daemon=True, name="metrics").start()
    return server
