"""The front door's own Prometheus metrics, named as serving dashboards expect (X4, X7b).

Request-level series come from the HTTP layer (`disagg:time_to_first_token_seconds`,
`disagg:inter_token_latency_seconds`, `disagg:e2e_request_latency_seconds`,
`disagg:request_queue_time_seconds`, running and waiting gauges, prompt and generation token
counters, cached prompt tokens, `disagg:request_success_total` by finish reason). Every series
carries `model_name`, none has a `_created` twin. The nodes' series (KV transfers, pages,
prefix cache, fabric bytes) are not relayed here: Prometheus scrapes each node itself, found
through `targets()` (`/metrics/targets`, `scrape_targets.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from disagg.server.generation import Timings
from disagg.server.health import NodeInfo
from disagg.server.scrape_targets import scrape_targets
from disagg.utils.metrics import ValuesOnly

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                   5.0, 10.0, 20.0, 40.0, 80.0)
FINISH_REASONS = ("stop", "length", "abort", "error")  # what `record` is told


class ServerMetrics:
    """The registry `/metrics` serves, what the HTTP layer records into it, and the nodes
    Prometheus should scrape besides (`targets`)."""

    def __init__(self, model_name: str, nodes: Callable[[], list[NodeInfo]] | None = None,
                 waiting: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._nodes = nodes
        labels = ["model_name"]
        # registry=None: `ValuesOnly` below yields them, without their `_created` series.

        def histogram(name: str, text: str) -> Histogram:
            return Histogram(name, text, labels, buckets=LATENCY_BUCKETS, registry=None)

        def counter(name: str, text: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, text, [*labels, *extra], registry=None)

        ttft = histogram("disagg:time_to_first_token_seconds",
                         "From the request's arrival to its first token")
        itl = histogram("disagg:inter_token_latency_seconds", "Between two tokens of one request")
        e2e = histogram("disagg:e2e_request_latency_seconds",
                        "From the request's arrival to its last token")
        queue = histogram("disagg:request_queue_time_seconds",
                          "From the request's arrival to the decoder's first event")
        running = Gauge("disagg:num_requests_running", "Requests in the cluster", labels,
                        registry=None)
        waiting_gauge = Gauge("disagg:num_requests_waiting",
                              "Requests admitted but without a first event yet", labels,
                              registry=None)
        prompt = counter("disagg:prompt_tokens_total", "Prompt tokens of finished requests")
        cached = counter("disagg:prompt_tokens_cached_total", "Prompt tokens found in a "
                         "decoder's prefix cache (neither computed nor moved)")
        generation = counter("disagg:generation_tokens_total", "Tokens generated")
        self.finished = counter("disagg:request_success_total", "Requests finished, by finish "
                                f"reason ({', '.join(FINISH_REASONS)})", ("finished_reason",))
        self.registry.register(ValuesOnly(ttft, itl, e2e, queue, running, waiting_gauge,
                                          prompt, cached, generation, self.finished))
        self.ttft, self.itl, self.e2e, self.queue = (h.labels(model_name)
                                                     for h in (ttft, itl, e2e, queue))
        self.running = running.labels(model_name)
        self.prompt_tokens, self.cached_tokens, self.generation_tokens = (
            c.labels(model_name) for c in (prompt, cached, generation))
        for reason in FINISH_REASONS:  # each at 0, so its rate is 0 before the first, not absent
            self.finished.labels(model_name, reason)
        waiting_child = waiting_gauge.labels(model_name)
        if waiting is not None:
            waiting_child.set_function(waiting)

    def targets(self) -> list[dict[str, Any]]:
        """Prometheus HTTP service discovery: every node whose metrics address is known."""
        return [] if self._nodes is None else scrape_targets(self._nodes(), self.model_name)

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
