"""`/metrics/targets`: the nodes Prometheus should scrape, as `http_sd_configs` reads them; the
front door's own `/metrics` holds its own series only (X4)."""

from __future__ import annotations

import json
import urllib.request
from types import SimpleNamespace

from disagg.server.health import NodeInfo
from disagg.server.launch import router_nodes
from disagg.server.metrics import ServerMetrics
from disagg.server.scrape_targets import scrape_targets
from tests.disagg.server.app_harness import FakeRouter, running_app

NODES = [NodeInfo("prefill-0", "prefill", "127.0.0.1:7000", "127.0.0.1:9100"),
         NodeInfo("decode-0", "decode", "127.0.0.1:7001", "127.0.0.1:9101"),
         NodeInfo("decode-1", "decode", "127.0.0.1:7002")]  # its metrics address is unknown


def get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.status, reply.headers["Content-Type"], reply.read().decode()


def test_each_node_with_a_metrics_address_is_one_labelled_target() -> None:
    assert scrape_targets(NODES, "tiny") == [
        {"targets": ["127.0.0.1:9100"],
         "labels": {"node": "prefill-0", "role": "prefill", "model_name": "tiny"}},
        {"targets": ["127.0.0.1:9101"],
         "labels": {"node": "decode-0", "role": "decode", "model_name": "tiny"}}]


def test_the_front_door_serves_the_list_as_json_and_relays_no_node_series() -> None:
    with running_app(FakeRouter()) as (address, door):
        door.metrics = ServerMetrics("tiny", nodes=lambda: NODES)
        status, content_type, body = get(f"http://{address}/metrics/targets")
        _, _, own = get(f"http://{address}/metrics")
    assert (status, content_type) == (200, "application/json")
    targets = json.loads(body)
    assert targets == scrape_targets(NODES, "tiny")
    # The shape http_sd_configs requires: a list of groups, each a list of host:port strings
    # and a string-to-string label map.
    assert all(set(group) == {"targets", "labels"} and
               all(isinstance(t, str) and ":" in t for t in group["targets"]) and
               all(isinstance(v, str) for v in group["labels"].values()) for group in targets)
    assert "disagg:time_to_first_token_seconds" in own
    assert "disagg:kv_" not in own and "node=" not in own


def test_without_nodes_the_list_is_empty() -> None:
    with running_app(FakeRouter()) as (address, _):
        assert json.loads(get(f"http://{address}/metrics/targets")[2]) == []


def test_serve_router_lists_the_decoders_given_a_metrics_address() -> None:
    """`serve router` knows a decoder's metrics address from `--decoder-metrics` only."""
    router = SimpleNamespace(alive=[True, True], takes_requests=lambda index: True)
    nodes = router_nodes(router, ["10.0.0.2:7100", "10.0.0.3:7100"],  # type: ignore[arg-type]
                         ["10.0.0.2:9100"])
    assert scrape_targets(nodes, "m") == [
        {"targets": ["10.0.0.2:9100"],
         "labels": {"node": "decoder-0", "role": "decode", "model_name": "m"}}]
