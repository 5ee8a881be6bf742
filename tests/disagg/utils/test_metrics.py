"""Metrics: a per-node prometheus_client registry; its text parses back with prometheus_client's
parser, histogram buckets are cumulative, callbacks are read at scrape time."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.utils.metrics import Metrics, parse_metrics


def families(metrics: Metrics) -> dict[str, tuple[str, dict[str, float]]]:
    """Family name -> (type, {sample key: value}), read by prometheus_client's parser."""
    out = {}
    for family in text_string_to_metric_families(metrics.render()):
        samples = {s.name + str(sorted(s.labels.items())): s.value for s in family.samples}
        out[family.name] = (family.type, samples)
    return out


def test_counters_histograms_and_gauges_render_as_prometheus_text() -> None:
    """Labelled counters, cumulative buckets and gauges round-trip through the text."""
    metrics = Metrics()
    metrics.describe("failures_total", "KV transfers that failed, by cause")
    metrics.inc("failures_total", cause="deadline")
    metrics.inc("failures_total", 2, cause="checksum")
    for seconds in (0.003, 0.2, 7.0):
        metrics.observe("kv_transfer_seconds", seconds)
    metrics.gauge("pages_in_use", lambda: 12)
    text = metrics.render()
    assert "# TYPE disagg:failures_total counter" in text
    assert "# HELP disagg:failures_total KV transfers that failed, by cause" in text
    assert "_created" not in text  # values only: a sum over keys stays a sum
    values = parse_metrics(text)
    assert values['disagg:failures_total{cause="checksum"}'] == 2
    assert values['disagg:failures_total{cause="deadline"}'] == 1
    assert values['disagg:kv_transfer_seconds_bucket{le="0.005"}'] == 1
    assert values['disagg:kv_transfer_seconds_bucket{le="0.25"}'] == 2
    assert values['disagg:kv_transfer_seconds_bucket{le="+Inf"}'] == 3
    assert values["disagg:kv_transfer_seconds_count"] == 3
    assert values["disagg:kv_transfer_seconds_sum"] == pytest.approx(7.203)
    assert values["disagg:pages_in_use"] == 12


def test_exposition_parses_into_typed_families() -> None:
    """prometheus_client's parser sees a counter, a histogram, a gauge and an outside counter."""
    metrics = Metrics()
    metrics.inc("kv_bytes_total", 4096)
    metrics.observe("kv_transfer_seconds", 0.02)
    metrics.gauge("transfers_in_flight", lambda: 3)
    metrics.counter_from("staged_bytes_total", lambda: 7)
    parsed = families(metrics)
    assert parsed["disagg:kv_bytes"] == ("counter", {"disagg:kv_bytes_total[]": 4096})
    assert parsed["disagg:kv_transfer_seconds"][0] == "histogram"
    assert parsed["disagg:transfers_in_flight"] == ("gauge", {"disagg:transfers_in_flight[]": 3})
    assert parsed["disagg:staged_bytes"] == ("counter", {"disagg:staged_bytes_total[]": 7})


def test_histogram_buckets_are_cumulative() -> None:
    """Each bucket counts every value at or below its bound; +Inf counts them all."""
    metrics = Metrics()
    for seconds in (0.0005, 0.001, 0.03, 0.03, 0.4, 3.0, 60.0):
        metrics.observe("kv_transfer_seconds", seconds)
    buckets = [(float(key.split('"')[1]), value) for key, value in
               parse_metrics(metrics.render()).items() if "_bucket" in key]
    counts = [count for _, count in sorted(buckets)]
    assert counts == sorted(counts)  # never decreasing with the bound
    assert dict(buckets)[0.001] == 2  # le is inclusive
    assert dict(buckets)[0.05] == 4
    assert dict(buckets)[float("inf")] == 7


def test_callbacks_are_read_at_scrape_time() -> None:
    """A gauge or a counter kept elsewhere shows the value at the moment of the scrape."""
    stats = {"writes": 1, "pages": 5}
    metrics = Metrics()
    metrics.counter_from("writes_total", lambda: stats["writes"])
    metrics.gauge("pages_in_use", lambda: stats["pages"])
    assert parse_metrics(metrics.render())["disagg:writes_total"] == 1
    stats.update(writes=9, pages=0)
    values = parse_metrics(metrics.render())
    assert (values["disagg:writes_total"], values["disagg:pages_in_use"]) == (9, 0)
    assert (metrics.value("writes_total"), metrics.value("pages_in_use")) == (9, 0)


def test_value_and_snapshot() -> None:
    """`value` reads one series; `snapshot` lists counters, gauges and histogram totals."""
    metrics = Metrics()
    metrics.inc("requests_total", state="finished_length")
    metrics.inc("requests_total", state="finished_length")
    metrics.observe("kv_transfer_seconds", 0.5)
    metrics.gauge("pages_in_use", lambda: 4)
    assert metrics.value("requests_total", state="finished_length") == 2
    assert metrics.value("requests_total", state="aborted") == 0
    assert metrics.value("never_incremented_total") == 0
    assert metrics.snapshot() == {'requests_total{state="finished_length"}': 2,
                                  "kv_transfer_seconds_count": 1,
                                  "kv_transfer_seconds_sum": 0.5, "pages_in_use": 4}


def test_two_nodes_in_one_process_do_not_collide() -> None:
    """Each Metrics has its own registry: the same names twice, separate values."""
    prefill, decode = Metrics(), Metrics()
    for metrics, pages in ((prefill, 1), (decode, 2)):
        metrics.gauge("pages_in_use", lambda pages=pages: pages)
    prefill.inc("kv_bytes_total", 10)
    decode.inc("kv_bytes_total", 20)
    decode.observe("kv_transfer_seconds", 0.1)
    assert parse_metrics(prefill.render()) == {"disagg:kv_bytes_total": 10,
                                               "disagg:pages_in_use": 1}
    assert parse_metrics(decode.render())["disagg:kv_bytes_total"] == 20
    assert parse_metrics(decode.render())["disagg:pages_in_use"] == 2


def test_one_name_is_one_kind() -> None:
    """A name used as a counter cannot become a gauge or a histogram; label names are fixed."""
    metrics = Metrics()
    metrics.inc("failures_total", cause="deadline")
    with pytest.raises(ValueError, match="failures_total"):
        metrics.gauge("failures_total", lambda: 0)
    with pytest.raises(ValueError, match="failures_total"):
        metrics.observe("failures_total", 1.0)
    with pytest.raises(ValueError, match="label names"):
        metrics.inc("failures_total", node="x")
