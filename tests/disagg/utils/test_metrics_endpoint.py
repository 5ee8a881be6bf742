"""The metrics port: `GET /metrics` (Prometheus text, IPv4 or IPv6), `GET /health` (JSON,
200 or 503) and 404 for anything else."""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4

from disagg.utils.metrics import Metrics, parse_metrics, serve_metrics


def get(url: str) -> tuple[int, str, str]:
    """(status, content type, body), HTTP errors included."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


@pytest.fixture
def node_health() -> dict[str, Any]:
    return {"node_id": "decode-0", "role": "decode", "state": "ok", "pid": os.getpid()}


@pytest.fixture
def endpoint(node_health: dict[str, Any]) -> Iterator[tuple[Metrics, str]]:
    """A served Metrics and its base URL; /health reports `node_health` as it is then."""
    metrics = Metrics()
    server = serve_metrics(metrics, ("127.0.0.1", 0), health=lambda: node_health)
    try:
        yield metrics, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_endpoint_serves_the_current_values(endpoint: tuple[Metrics, str]) -> None:
    """GET /metrics returns what the registry holds at that moment, as Prometheus text."""
    metrics, url = endpoint
    metrics.inc("requests_total", state="finished_length")
    status, content_type, body = get(url + "/metrics")
    assert (status, content_type) == (200, CONTENT_TYPE_PLAIN_0_0_4)
    assert parse_metrics(body)['disagg:requests_total{state="finished_length"}'] == 1


def test_health_answers_200_with_the_nodes_report(endpoint: tuple[Metrics, str]) -> None:
    """GET /health: the node's JSON report, 200 while its state is "ok"."""
    status, content_type, body = get(endpoint[1] + "/health")
    assert (status, content_type) == (200, "application/json")
    assert json.loads(body) == {"node_id": "decode-0", "role": "decode", "state": "ok",
                                "pid": os.getpid()}


def test_health_answers_503_when_the_node_is_not_ok(endpoint: tuple[Metrics, str],
                                                    node_health: dict[str, Any]) -> None:
    """Any other state is a 503 that still carries the report."""
    node_health["state"] = "unhealthy"
    status, _, body = get(endpoint[1] + "/health")
    assert status == 503
    assert json.loads(body)["state"] == "unhealthy"


def test_a_failing_health_report_is_a_503() -> None:
    """A report that raises makes the node unhealthy, not the endpoint dead."""
    def broken() -> dict[str, Any]:
        raise RuntimeError("no engine")

    server = serve_metrics(Metrics(), ("127.0.0.1", 0), health=broken)
    try:
        status, _, body = get(f"http://127.0.0.1:{server.server_address[1]}/health")
    finally:
        server.shutdown()
        server.server_close()
    report = json.loads(body)
    assert (status, report["state"]) == (503, "error")
    assert "no engine" in report["error"]


def test_other_paths_are_404(endpoint: tuple[Metrics, str]) -> None:
    """Only /metrics and /health exist (a query string does not change the path)."""
    assert get(endpoint[1] + "/")[0] == 404
    assert get(endpoint[1] + "/metricsx")[0] == 404
    assert get(endpoint[1] + "/metrics?x=1")[0] == 200


def test_no_health_callable_means_no_health_path() -> None:
    """Without `health`, /health is a 404 like any unknown path."""
    server = serve_metrics(Metrics(), ("127.0.0.1", 0))
    try:
        assert get(f"http://127.0.0.1:{server.server_address[1]}/health")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_endpoint_serves_on_an_ipv6_host(node_health: dict[str, Any]) -> None:
    """A node listening on [::1] serves its metrics and its health there too."""
    metrics = Metrics()
    metrics.inc("requests_total", state="finished_stopped")
    server = serve_metrics(metrics, ("::1", 0), health=lambda: node_health)
    try:
        url = f"http://[::1]:{server.server_address[1]}"
        values = parse_metrics(get(url + "/metrics")[2])
        assert values['disagg:requests_total{state="finished_stopped"}'] == 1
        assert get(url + "/health")[0] == 200
    finally:
        server.shutdown()
        server.server_close()
