"""What each node exports to Prometheus: its pages and prefix cache, the bytes each fabric
domain wrote (S6a), and its side's transfers (S2b on a prefiller; S2a, S4c and X4 on a
decoder). Read at scrape time from the objects that own the numbers."""

from __future__ import annotations

from disagg.engine.llm_engine import LLMEngine
from disagg.kv_transfer.decode_messenger import DecodeMessenger
from disagg.kv_transfer.prefill_messenger import PrefillMessenger
from disagg.utils.metrics import Metrics
from transfer_core.transport import Transport


def add_cache_metrics(metrics: Metrics, engine: LLMEngine) -> None:
    """What every node says of its KV pages: in use, and its prefix cache's hits (in tokens,
    as vLLM counts them: hits / queries is the hit rate)."""
    allocator = engine.allocator
    metrics.gauge("pages_in_use", lambda: allocator.num_used)
    cache = allocator.cache
    if cache is None:
        return
    metrics.gauge("prefix_cache_pages", lambda: len(cache))
    metrics.counter_from("prefix_cache_queries_total", lambda: cache.queried_tokens)
    metrics.counter_from("prefix_cache_hits_total", lambda: cache.hit_tokens)
    metrics.counter_from("prefix_cache_evictions_total", lambda: cache.evictions)


def add_fabric_metrics(metrics: Metrics, transfer: Transport) -> None:
    """Bytes each fabric domain (NIC) wrote: with TP, rank i's pages leave through rank i's
    domains (S6a), so the split shows here."""
    metrics.counters_from("fabric_bytes_written_total", "domain", lambda: {
        str(d): stats.bytes_written for d, stats in enumerate(transfer.stats())})


def prefill_metrics(engine: LLMEngine, messenger: PrefillMessenger, transfer: Transport
                    ) -> Metrics:
    """The prefiller's metrics: pages, writes and bytes sent, requests, failures, leases."""
    metrics = Metrics()
    for name in messenger.stats:
        metrics.counter_from(f"{name}_total", lambda name=name: messenger.stats[name])
    add_cache_metrics(metrics, engine)
    add_fabric_metrics(metrics, transfer)
    metrics.gauge("transfers_in_flight", lambda: messenger.num_in_flight)
    return metrics


def decode_metrics(engine: LLMEngine, messenger: DecodeMessenger, transfer: Transport
                   ) -> Metrics:
    """The decoder's metrics: transfers, failures by cause, pages in use, quarantine."""
    metrics = Metrics()
    metrics.describe("kv_transfer_seconds", "from asking a prefiller to the KV counter firing")
    metrics.describe("failures_total", "requests that failed, by cause")
    add_cache_metrics(metrics, engine)
    add_fabric_metrics(metrics, transfer)
    metrics.gauge("requests_waiting_for_kv", lambda: len(messenger.pending))
    metrics.gauge("quarantined_requests", lambda: len(messenger.quarantine))
    metrics.counter_from("quarantine_forced_releases_total",
                         lambda: messenger.quarantine.forced_releases)
    # Decode steps through the static buffers (CUDA graph replays on a GPU, S3b).
    metrics.counter_from("static_decode_steps_total",
                         lambda: engine.runner.graph_stats["static"])
    # Bytes copied between the KV cache and its pinned host shadow (staged path, S5).
    metrics.counter_from("staged_bytes_total",
                         lambda: sum(kv.staged_bytes for kv in messenger.kv))
    return metrics
