"""`ClusterConfig`: the node configs each process of a default cluster runs, written out in
full, so that a refactor of how the cluster is described cannot change what it starts."""

from __future__ import annotations

from typing import Any

import pytest

from disagg.apps.cli import main
from disagg.config import (
    CacheConfig,
    ParallelConfig,
    ReliabilityConfig,
    SchedulerConfig,
    SchedulerMode,
)
from disagg.node.cluster_config import ClusterConfig
from disagg.node.node_config import NodeConfig, NodeRole

PREFILLER = "127.0.0.1:7000"


def _expected(role: NodeRole, node_id: str, mode: SchedulerMode) -> NodeConfig:
    """What the cluster gave each node before `ClusterConfig` held a node config: every field."""
    return NodeConfig(
        model="tiny",
        cache=CacheConfig(page_size=16, num_pages=512, kv_layout="NHD", prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256, chunk_size=256,
                                  mode=mode),
        parallel=ParallelConfig(tp=1, replicated_kv=False), role=role, node_id=node_id,
        listen="127.0.0.1:0", prefillers=(PREFILLER,) if role is NodeRole.DECODE else (),
        provider="tcp", fabric_node="auto", threads=1, faults=None,
        reliability=ReliabilityConfig(), lease_s=300.0, metrics_port=0, trace=None,
        speculative=None, device="cpu", kv_memory_path="auto", cuda_graph=False,
        domains_per_rank=1)


EXPECTED = {
    "prefill-0": _expected(NodeRole.PREFILL, "prefill-0", "prefill_only"),
    "decode-0": _expected(NodeRole.DECODE, "decode-0", "mixed"),
    "mixed-0": _expected(NodeRole.MIXED, "mixed-0", "mixed"),
}


def _node_configs(cluster: ClusterConfig) -> dict[str, NodeConfig]:
    return {"prefill-0": cluster.node_config(NodeRole.PREFILL, "prefill-0"),
            "decode-0": cluster.node_config(NodeRole.DECODE, "decode-0", (PREFILLER,)),
            "mixed-0": cluster.node_config(NodeRole.MIXED, "mixed-0")}


def _default_cluster() -> ClusterConfig:
    return ClusterConfig.from_options(model="tiny")


def test_the_default_cluster_runs_the_same_node_configs() -> None:
    """Built in code with nothing but the model: every node's config, field by field."""
    assert _node_configs(_default_cluster()) == EXPECTED


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[ClusterConfig]:
    """The clusters `serve cluster` and `demo` would start; nothing is started."""
    import disagg.apps.demo as demo
    import disagg.server.launch as launch

    clusters: list[ClusterConfig] = []

    def fake_demo(cluster: ClusterConfig, *_: Any, **__: Any) -> dict[str, Any]:
        clusters.append(cluster)
        return {"requests": [], "totals": {"requests": 0, "failed": 0}}

    monkeypatch.setattr(launch, "serve_cluster", lambda cluster, *_: clusters.append(cluster))
    monkeypatch.setattr(demo, "run_demo", fake_demo)
    return clusters


@pytest.mark.parametrize("command", [["serve", "cluster"], ["demo", "--json"]])
def test_the_cli_default_cluster_runs_the_same_node_configs(
        captured: list[ClusterConfig], command: list[str]) -> None:
    """`disagg serve cluster --model tiny` and `disagg demo --model tiny`: the same configs."""
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--model", "tiny"])
    assert exit_info.value.code in (0, None)
    [cluster] = captured
    assert _node_configs(cluster) == EXPECTED
