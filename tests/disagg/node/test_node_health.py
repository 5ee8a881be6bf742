"""Every node answers `GET /health` on its metrics port: who it is, its pid, state "ok"."""

from __future__ import annotations

import json
import urllib.request

import pytest

from disagg.node.cluster_config import ClusterConfig
from disagg.node.local_cluster import LocalCluster
from disagg.utils.metrics import parse_metrics

pytestmark = [pytest.mark.fabric, pytest.mark.slow]  # two processes, a few seconds


def test_each_node_reports_its_health_and_metrics() -> None:
    """A prefiller and a decoder as processes: /health names the node, its role and pid."""
    with LocalCluster(ClusterConfig.from_options(model="tiny", num_decoders=1)) as cluster:
        assert set(cluster.metrics_addresses) == {"prefill-0", "decode-0"}
        for name, address in cluster.metrics_addresses.items():
            with urllib.request.urlopen(f"http://{address}/health", timeout=10) as reply:
                assert reply.status == 200
                report = json.loads(reply.read())
            process = cluster.processes[cluster.names.index(name)]
            # TP 1: the ranks are itself; a decoder adds its prefillers as it sees them.
            seen = ({"prefillers": [{"address": cluster.prefiller_address, "alive": True}]}
                    if name.startswith("decode") else {})
            assert report == {"node_id": name, "role": name.split("-")[0], "state": "ok",
                              "pid": process.pid, "ranks": [process.pid], **seen}
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
                assert "disagg:kv_pages_in_use" in parse_metrics(reply.read().decode())
    assert cluster.exit_codes() == [0, 0]
