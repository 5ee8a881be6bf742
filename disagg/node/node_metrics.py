"""What each node exports to Prometheus: its KV pages (in use, and how many it has, so a
dashboard shows utilisation) and prefix cache, the bytes each fabric domain wrote (S6a), and
its side's transfers (S2b on a prefiller; S2a, S4c and X4 on a decoder). Read at scrape time
from the objects that own the numbers. Names follow `disagg.utils.metrics`' rule (X7b): the
unit in the name, counters and only counters end in `_total`."""

from __future__ import annotations

from disagg.engine.llm_engine import LLMEngine
from disagg.engine.request import FailureCause
from disagg.kv_transfer.decode_messenger import DecodeMessenger
from disagg.kv_transfer.prefill_messenger import PrefillMessenger
from disagg.utils.metrics import Metrics
from transfer_core.transport import Transport

# A prefiller messenger's stats -> the counter each is exported as, with its help text.
PREFILL_STATS = {
    "pages": ("kv_sent_pages_total", "KV pages shipped to decoders"),
    "writes": ("kv_sent_writes_total", "RDMA writes posted to decoders"),
    "bytes": ("kv_sent_bytes_total", "KV bytes shipped to decoders"),
    "requests": ("kv_sent_requests_total", "requests whose KV transfer ended (ok or not)"),
    "failed": ("kv_send_failures_total", "requests whose KV transfer failed"),
    "expired_leases": ("kv_expired_leases_total", "decoders' page leases that ran out"),
    "staged_bytes": ("staged_bytes_total",
                     "bytes copied between the KV cache and its pinned host shadow (S5)"),
}


def add_cache_metrics(metrics: Metrics, engine: LLMEngine) -> None:
    """What every node with a KV cache says of its pages: in use and in all, and its prefix
    cache's hits (in tokens, as vLLM counts them: hits / queries is the hit rate)."""
    allocator = engine.allocator
    metrics.describe("kv_pages_in_use", "KV pages some request holds")
    metrics.describe("kv_pages_capacity", "KV pages requests can be given (the cache's size)")
    metrics.gauge("kv_pages_in_use", lambda: allocator.num_used)
    metrics.gauge("kv_pages_capacity", lambda: allocator.num_pages)
    cache = allocator.cache
    if cache is None:
        return
    metrics.describe("prefix_cache_pages", "KV pages registered in the prefix cache")
    metrics.describe("prefix_cache_queried_tokens_total", "prompt tokens looked up")
    metrics.describe("prefix_cache_hit_tokens_total", "prompt tokens found in the cache")
    metrics.describe("prefix_cache_evicted_pages_total", "cached pages evicted for room")
    metrics.gauge("prefix_cache_pages", lambda: len(cache))
    metrics.counter_from("prefix_cache_queried_tokens_total", lambda: cache.queried_tokens)
    metrics.counter_from("prefix_cache_hit_tokens_total", lambda: cache.hit_tokens)
    metrics.counter_from("prefix_cache_evicted_pages_total", lambda: cache.evictions)


def add_fabric_metrics(metrics: Metrics, transfer: Transport) -> None:
    """Bytes each fabric domain (NIC) wrote: with TP, rank i's pages leave through rank i's
    domains (S6a), so the split shows here."""
    metrics.describe("fabric_bytes_written_total", "bytes written through each fabric domain")
    metrics.counters_from("fabric_bytes_written_total", "domain", lambda: {
        str(d): stats.bytes_written for d, stats in enumerate(transfer.stats())})


def prefill_metrics(engine: LLMEngine, messenger: PrefillMessenger, transfer: Transport
                    ) -> Metrics:
    """The prefiller's metrics: pages, writes and bytes sent, requests, failures, leases."""
    metrics = Metrics()
    for stat in messenger.stats:
        name, text = PREFILL_STATS.get(stat, (f"{stat}_total", stat))
        metrics.describe(name, text)
        metrics.counter_from(name, lambda stat=stat: messenger.stats[stat])
    add_cache_metrics(metrics, engine)
    add_fabric_metrics(metrics, transfer)
    metrics.describe("kv_transfers_in_flight", "requests whose KV is being shipped")
    metrics.gauge("kv_transfers_in_flight", lambda: messenger.num_in_flight)
    return metrics


def decode_metrics(engine: LLMEngine, messenger: DecodeMessenger, transfer: Transport
                   ) -> Metrics:
    """The decoder's (and a mixed node's) metrics: transfers, failures by cause, pages,
    quarantine. The node itself counts `requests_total` by state, `kv_transfer_seconds`,
    `kv_bytes_total` and `kv_writes_total` (received) and `failures_total` by cause."""
    metrics = Metrics()
    metrics.describe("kv_transfer_seconds", "from asking a prefiller to the KV counter firing")
    metrics.describe("kv_bytes_total", "KV bytes received from prefillers")
    metrics.describe("kv_writes_total", "RDMA writes received from prefillers")
    metrics.describe("failures_total", "requests that failed, by cause")
    metrics.describe("requests_total", "requests that ended, by state")
    # Every cause at 0 from the start, so a rate over failures is 0 before the first one,
    # not absent.
    for cause in FailureCause:
        metrics.inc("failures_total", 0, cause=cause.value)
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
