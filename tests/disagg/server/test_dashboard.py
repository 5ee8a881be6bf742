"""The Grafana dashboard (`deploy/grafana/disagg.json`): its shape, and, against a real
cluster (a prefiller and a decoder over libfabric, the front door in front), that every series
its PromQL names is one the front door or a node it lists at `/metrics/targets` exports (X4)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.disagg.server.test_openai_e2e import MODEL, prompt_of, start_server, stop_server
from tests.disagg.utils.test_metric_names import naming_violations

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "disagg.json"
NAME = re.compile(r"disagg:[a-zA-Z0-9_:]+")
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too (rows themselves left out)."""
    out = []
    for panel in dashboard["panels"]:
        out += panel.get("panels", []) if panel["type"] == "row" else [panel]
    return out


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: each panel target's, and each query variable's."""
    exprs = [target["expr"] for panel in panels(dashboard) for target in panel["targets"]]
    return exprs + [v["query"]["query"] for v in dashboard["templating"]["list"]
                    if v["type"] == "query"]


def test_the_dashboard_is_a_grafana_model_over_a_prometheus_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"] and all(t["expr"] and t["datasource"] == DATASOURCE
                                        for t in panel["targets"]), panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
    titles = " | ".join(p["title"].lower() for p in panels(dashboard))
    for topic in ("time to first token", "inter-token", "finished by reason", "throughput",
                  "kv transfer time", "kv bytes", "pages in use", "utilisation",
                  "prefix-cache hit rate", "per domain"):
        assert topic in titles, topic
    used = {name for expr in expressions(dashboard) for name in NAME.findall(expr)}
    # Percentiles come from the histograms' buckets.
    assert {"disagg:time_to_first_token_seconds_bucket",
            "disagg:inter_token_latency_seconds_bucket"} <= used


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as reply:
        return reply.read().decode()


@pytest.mark.fabric
@pytest.mark.slow  # a prefiller, a decoder and the front door: about 10 s
def test_every_series_the_dashboard_uses_is_scraped_from_a_real_cluster() -> None:
    server = start_server("--prefillers", "1", "--decoders", "1")
    try:
        prompt = prompt_of(13, seed=5)
        for _ in range(2):  # the second finds the first's pages in the prefix cache
            server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                             temperature=0)
        status, body = server.get("/metrics/targets")
        targets = json.loads(body)
        texts = {"front door": server.get("/metrics")[1]}
        for group in targets:
            for address in group["targets"]:
                texts[group["labels"]["node"]] = scrape(address)
    finally:
        stop_server(server)
    assert status == 200
    assert sorted((g["labels"]["node"], g["labels"]["role"]) for g in targets) == [
        ("decode-0", "decode"), ("prefill-0", "prefill")]
    for where, text in texts.items():
        assert naming_violations(text) == [], where
    scraped = {sample.name for text in texts.values()
               for family in text_string_to_metric_families(text) for sample in family.samples}
    used = {name for expr in expressions(json.loads(DASHBOARD.read_text()))
            for name in NAME.findall(expr)}
    assert used and not used - scraped, sorted(used - scraped)
    # Both nodes hold a KV cache: each says how many pages it has, and its in-use share.
    for node in ("prefill-0", "decode-0"):
        values = {s.name: s.value for f in text_string_to_metric_families(texts[node])
                  for s in f.samples if not s.labels}
        assert values["disagg:kv_pages_capacity"] > 0, node
        assert 0 <= values["disagg:kv_pages_in_use"] <= values["disagg:kv_pages_capacity"]
