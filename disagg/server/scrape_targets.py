"""Where Prometheus finds the nodes: the front door's `/metrics/targets`, in the format of
Prometheus' HTTP service discovery (`http_sd_configs`), and a reader that scrapes a cluster
through it as Prometheus would (X4, X7b).

The front door does not relay the nodes' series: one slow node would slow every scrape of the
front door, and a relayed counter or histogram loses its type. Instead each node with a known
metrics address is one target, labelled with its node id, role and the served model, so every
series Prometheus scrapes from it carries them. Which addresses are known: `serve cluster`
knows every node's (the nodes it started report theirs on their READY line); `serve router`
knows a decoder's only through `--decoder-metrics`, and no prefiller's (it never learns of
them: decoders find their prefillers), so prefillers behind a router are scraped from a static
Prometheus config.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from disagg.server.health import NodeInfo

SCRAPE_TIMEOUT_S = 10.0


def scrape_targets(nodes: Iterable[NodeInfo], model_name: str) -> list[dict[str, Any]]:
    """One `{"targets": ["host:port"], "labels": {...}}` per node whose metrics address is
    known; a node without one is left out (nothing could scrape it).

    >>> scrape_targets([NodeInfo("decode-0", "decode", "h:1", "h:2")], "tiny")
    [{'targets': ['h:2'], 'labels': {'node': 'decode-0', 'role': 'decode', 'model_name': 'tiny'}}]
    """
    return [{"targets": [node.metrics_address],
             "labels": {"node": node.name, "role": node.role, "model_name": model_name}}
            for node in nodes if node.metrics_address]


def scrape_cluster(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> list[Sample]:
    """Every sample of the front door at `url` (`http://host:port`) and of each node its
    `/metrics/targets` lists, each node's samples with that target's labels added, as
    Prometheus stores them (for tests, benchmarks and the demo; not a hot path)."""
    samples = list(_scrape(f"{url}/metrics", {}, timeout_s))
    with urllib.request.urlopen(f"{url}/metrics/targets", timeout=timeout_s) as reply:
        targets = json.loads(reply.read())
    for group in targets:
        for address in group["targets"]:
            samples += _scrape(f"http://{address}/metrics", group["labels"], timeout_s)
    return samples


def _scrape(url: str, labels: dict[str, str], timeout_s: float) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        text = reply.read().decode()
    return [sample._replace(labels={**sample.labels, **labels})
            for family in text_string_to_metric_families(text) for sample in family.samples]
