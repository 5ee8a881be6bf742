"""`ClusterConfig`: a node config every node shares plus the cluster's own choices. The node
configs each process of a default cluster runs are written out in full (first, against the
old flat config), so that recomposing the cluster could not change what it starts."""

from __future__ import annotations

import json
import re
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
from disagg.errors import ConfigError
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

    monkeypatch.setattr(launch, "serve_cluster", lambda cluster, *_, **__: clusters.append(cluster))
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


def test_nodes_start_prefillers_first_then_decoders_or_only_the_mixed() -> None:
    cluster = ClusterConfig.from_options(model="tiny", num_prefillers=2, num_decoders=2)
    assert cluster.nodes() == [("prefill-0", NodeRole.PREFILL), ("prefill-1", NodeRole.PREFILL),
                               ("decode-0", NodeRole.DECODE), ("decode-1", NodeRole.DECODE)]
    mixed = ClusterConfig.from_options(model="tiny", num_mixed=2)
    assert mixed.nodes() == [("mixed-0", NodeRole.MIXED), ("mixed-1", NodeRole.MIXED)]


def test_each_role_gets_its_tp_locally_and_on_ray_alike() -> None:
    """Mixed nodes stand where decoders stand: decode_tp, in the node's config and in the Ray
    bundles reserved for it (they used to disagree: prefill_tp locally, decode_tp on Ray)."""
    from disagg.node.ray_placement import RayConfig, plan_nodes

    for num_mixed in (0, 2):
        cluster = ClusterConfig.from_options(model="tiny", num_mixed=num_mixed, prefill_tp=2,
                                             decode_tp=4)
        for placement in plan_nodes(cluster, RayConfig("local")):
            decoder = placement.role is NodeRole.DECODE
            config = cluster.node_config(placement.role, placement.name,
                                         (PREFILLER,) if decoder else ())
            assert config.parallel.tp == len(placement.bundles) == cluster.tp_of(placement.role)
        assert cluster.tp_of(NodeRole.MIXED) == cluster.tp_of(NodeRole.DECODE) == 4


def test_only_decoders_keep_the_decoder_options() -> None:
    cluster = ClusterConfig.from_options(model="tiny", speculative="mtp", cuda_graph=True)
    decoder = cluster.node_config(NodeRole.DECODE, "decode-0", (PREFILLER,))
    assert decoder.speculative is not None
    assert decoder.cuda_graph
    for role in (NodeRole.PREFILL, NodeRole.MIXED):
        config = cluster.node_config(role, role.value)
        assert (config.speculative, config.cuda_graph) == (None, False)


def test_the_router_compares_the_nodes_pages() -> None:
    cluster = ClusterConfig.from_options(model="tiny", page_size=4, routing="least-loaded",
                                         routing_margin=2)
    routing = cluster.router_config()
    assert (routing.policy.value, routing.load_margin, routing.page_size) == \
        ("least-loaded", 2, 4)


@pytest.mark.parametrize(("options", "message"), [
    ({"tp": 2}, "shared node config has tp 2: set prefill_tp and decode_tp"),
    ({"num_decoders": 0}, "num_decoders must be at least 1, got 0"),
    ({"num_prefillers": 0}, "num_prefillers must be at least 1, got 0"),
    ({"num_mixed": -1}, "num_mixed must be >= 0, got -1"),
    ({"decode_tp": 0}, "decode_tp must be >= 1, got 0"),
    ({"routing": "round-robin"}, "unknown routing policy 'round-robin'"),
    ({"kv_layout": "NDH"}, "unknown kv_layout 'NDH'"),
    ({"kv_memory_path": "rdma"}, "unknown KV memory path 'rdma'"),
])
def test_a_cluster_that_cannot_work_is_refused_naming_why(options: dict[str, Any],
                                                          message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        ClusterConfig.from_options(model="tiny", **options)


def test_the_shared_node_config_is_a_mixed_node_without_prefillers() -> None:
    """Set there, a role or prefillers would be replaced per node without a word: refused."""
    decoder = NodeConfig("tiny", role=NodeRole.DECODE, prefillers=(PREFILLER,))
    with pytest.raises(ConfigError, match="each node's role and prefillers are its own"):
        ClusterConfig(decoder)


def test_an_unknown_scheduler_mode_is_refused_naming_it() -> None:
    """The mode a JSON document names is checked like the CLI's words (a Literal field)."""
    document = json.loads(_default_cluster().node_config(NodeRole.MIXED, "m").to_json())
    document["scheduler"]["mode"] = "chunky"
    with pytest.raises(ConfigError, match="unknown scheduler mode 'chunky'"):
        NodeConfig.from_json(json.dumps(document))
