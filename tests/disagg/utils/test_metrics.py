"""Metrics: Prometheus text format, cumulative histogram buckets, the /metrics endpoint."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from disagg.utils.metrics import Metrics, parse_metrics, serve_metrics


def test_counters_histograms_and_gauges_render_as_prometheus_text() -> None:
    """Labelled counters, cumulative buckets and gauges round-trip through the text."""
    metrics = Metrics()
    metrics.inc("failures_total", cause="deadline")
    metrics.inc("failures_total", 2, cause="checksum")
    for seconds in (0.003, 0.2, 7.0):
        metrics.observe("kv_transfer_seconds", seconds)
    metrics.gauge("pages_in_use", lambda: 12)
    text = metrics.render()
    assert "# TYPE disagg_failures_total counter" in text
    values = parse_metrics(text)
    assert values['disagg_failures_total{cause="checksum"}'] == 2
    assert values['disagg_kv_transfer_seconds_bucket{le="0.005"}'] == 1
    assert values['disagg_kv_transfer_seconds_bucket{le="0.25"}'] == 2
    assert values['disagg_kv_transfer_seconds_bucket{le="+Inf"}'] == 3
    assert values["disagg_pages_in_use"] == 12


def test_endpoint_serves_the_current_values() -> None:
    """GET /metrics returns what the registry holds at that moment."""
    metrics = Metrics()
    server = serve_metrics(metrics, ("127.0.0.1", 0))
    try:
        metrics.inc("requests_total", state="finished_length")
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            values = parse_metrics(response.read().decode())
        assert values['disagg_requests_total{state="finished_length"}'] == 1
    finally:
        server.shutdown()


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_endpoint_serves_on_an_ipv6_host() -> None:
    """A node listening on [::1] serves its metrics there too."""
    metrics = Metrics()
    metrics.inc("requests_total", state="finished_stopped")
    server = serve_metrics(metrics, ("::1", 0))
    try:
        url = f"http://[::1]:{server.server_address[1]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            values = parse_metrics(response.read().decode())
        assert values['disagg_requests_total{state="finished_stopped"}'] == 1
    finally:
        server.shutdown()
