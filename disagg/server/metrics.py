"""The front door's Prometheus metrics, named as serving dashboards expect.

Request-level series come from the HTTP layer (`disagg:time_to_first_token_seconds`,
`disagg:inter_token_latency_seconds`, `disagg:e2e_request_latency_seconds`,
`disagg:request_queue_time_seconds`, running and waiting gauges, prompt and generation token
counters, cached prompt tokens, `disagg:request_success_total` by finish reason); KV-transfer,
page and prefix-cache series are gathered from each node's own `/metrics` at scrape time and
re-labelled with the node's name.
Every series carries `model_name`.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from disagg.server.generation import Timings

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                   5.0, 10.0, 20.0, 40.0, 80.0)
# Node series worth a dashboard, as the nodes name them -> ours.
NODE_SERIES = {
    "disagg_pages_in_use": "disagg:kv_pages_in_use",
    "disagg_kv_bytes_total": "disagg:kv_transfer_bytes_total",
    "disagg_kv_transfer_seconds_sum": "disagg:kv_transfer_seconds_sum",
    "disagg_kv_transfer_seconds_count": "disagg:kv_transfer_seconds_count",
    "disagg_transfers_in_flight": "disagg:kv_transfers_in_flight",
    "disagg_prefix_cache_queries_total": "disagg:prefix_cache_queries_total",
    "disagg_prefix_cache_hits_total": "disagg:prefix_cache_hits_total",
    "disagg_prefix_cache_pages": "disagg:prefix_cache_pages",
}


class NodeCollector(Collector):
    """Reads each node's `/metrics` when Prometheus scrapes us; a node that does not answer
    is left out of this scrape (and logged), never a failed scrape."""

    def __init__(self, model_name: str, nodes: Callable[[], dict[str, str]]) -> None:
        self.model_name = model_name
        self.nodes = nodes  # node name -> host:port of its /metrics

    def collect(self) -> Iterator[Metric]:
        families = {ours: GaugeMetricFamily(ours, f"{theirs} of each node, as it reports it",
                                            labels=["model_name", "node"])
                    for theirs, ours in NODE_SERIES.items()}
        for node, address in self.nodes().items():
            try:
                with urllib.request.urlopen(f"http://{address}/metrics", timeout=2) as reply:
                    text = reply.read().decode()
            except OSError as error:
                logger.warning("node %s: no metrics from %s: %s", node, address, error)
                continue
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    ours = NODE_SERIES.get(sample.name)
                    if ours is not None and not sample.labels:
                        families[ours].add_metric([self.model_name, node], sample.value)
        yield from families.values()


class ServerMetrics:
    """The registry `/metrics` serves, and what the HTTP layer records into it."""

    def __init__(self, model_name: str, nodes: Callable[[], dict[str, str]] | None = None,
                 waiting: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def histogram(name: str, text: str) -> Histogram:
            return Histogram(name, text, labels, buckets=LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("disagg:time_to_first_token_seconds",
                              "From the request's arrival to its first token")
        self.itl = histogram("disagg:inter_token_latency_seconds",
                             "Between two tokens of one request")
        self.e2e = histogram("disagg:e2e_request_latency_seconds",
                             "From the request's arrival to its last token")
        self.queue = histogram("disagg:request_queue_time_seconds",
                               "From the request's arrival to the decoder's first event")
        self.running = Gauge("disagg:num_requests_running", "Requests in the cluster", labels,
                             registry=self.registry).labels(model_name)
        waiting_gauge = Gauge("disagg:num_requests_waiting",
                              "Requests admitted but without a first event yet", labels,
                              registry=self.registry).labels(model_name)
        if waiting is not None:
            waiting_gauge.set_function(waiting)
        self.prompt_tokens = Counter("disagg:prompt_tokens", "Prompt tokens of admitted "
                                     "requests", labels, registry=self.registry).labels(model_name)
        self.cached_tokens = Counter("disagg:prompt_tokens_cached", "Prompt tokens found in a "
                                     "decoder's prefix cache (neither computed nor moved)",
                                     labels, registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("disagg:generation_tokens", "Tokens generated", labels,
                                         registry=self.registry).labels(model_name)
        self.finished = Counter("disagg:request_success", "Requests finished, by finish reason "
                                "(stop, length, abort, error)", [*labels, "finished_reason"],
                                registry=self.registry)
        if nodes is not None:
            self.registry.register(NodeCollector(model_name, nodes))

    def record(self, timings: Timings, prompt_tokens: int, reason: str,
               cached_tokens: int = 0) -> None:
        """One request ended (`reason`: stop, length, abort or error)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(len(timings.token_times))
        self.finished.labels(self.model_name, reason).inc()
        if timings.first_event is not None:
            self.queue.observe(timings.first_event - timings.arrival)
        if timings.token_times:
            self.ttft.observe(timings.token_times[0] - timings.arrival)
            for before, after in zip(timings.token_times, timings.token_times[1:], strict=False):
                if after > before:  # tokens of one event arrive together: not a gap
                    self.itl.observe(after - before)
        if timings.end is not None:
            self.e2e.observe(timings.end - timings.arrival)
