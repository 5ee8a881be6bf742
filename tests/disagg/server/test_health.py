"""`/health` tells the truth (X5e): 200 only when a request could be served now and every
node answers; every node listed with its pid and restart count.

First the judgement over stand-in nodes (callables, and a node `/health` served by
`serve_metrics`); then a real supervised cluster behind both front doors' views (`serve
cluster`'s and `serve router`'s): the prefiller killed, both say 503 and name what is wrong,
and once the supervisor brought it back, 200 again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from disagg.node.cluster_config import ClusterConfig
from disagg.node.local_cluster import LocalCluster
from disagg.node.router import Router
from disagg.server.health import NodeInfo, check_nodes
from disagg.server.launch import cluster_nodes, router_nodes
from disagg.utils.metrics import Metrics, serve_metrics


def decoder(name: str = "decode-0", takes: bool = True, connected: bool = True,
            metrics_address: str | None = None) -> NodeInfo:
    return NodeInfo(name, "decode", "127.0.0.1:1", metrics_address,
                    connected=lambda: connected, takes_requests=lambda: takes)


@pytest.fixture
def exited() -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen([sys.executable, "-c", "pass"], text=True)
    process.wait()
    yield process


def test_a_decoder_that_takes_requests_is_200() -> None:
    ok, body = check_nodes([decoder()])
    assert ok and body["status"] == "ok" and body["servable"]
    assert body["nodes"][0]["state"] == "ok" and body["nodes"][0]["restarts"] == 0


def test_a_connected_decoder_that_refuses_requests_is_503() -> None:
    """The reproduced bug: connected is not enough (no live prefiller: it refuses)."""
    ok, body = check_nodes([decoder(takes=False)])
    assert not ok and body["status"] == "unavailable"
    assert body["missing"] == ["decode-0"] and body["nodes"][0]["state"] == "refusing"


def test_a_disconnected_decoder_is_named_so() -> None:
    ok, body = check_nodes([decoder(takes=False, connected=False)])
    assert not ok and body["nodes"][0]["state"] == "disconnected"


def test_a_dead_prefiller_is_listed_and_named(exited: subprocess.Popen[str]) -> None:
    """A prefiller whose process ended: 503 "degraded" while a decoder still takes requests
    (the router has not heard yet), the prefiller named, its pid and restarts listed."""
    prefiller = NodeInfo("prefill-0", "prefill", "127.0.0.1:2", process=lambda: exited,
                         restarts=lambda: 2)
    ok, body = check_nodes([prefiller, decoder()])
    assert not ok and body["status"] == "degraded" and body["missing"] == ["prefill-0"]
    assert body["prefillers"] == [{"name": "prefill-0", "role": "prefill",
                                   "address": "127.0.0.1:2", "state": "exited",
                                   "pid": exited.pid, "restarts": 2}]


def test_a_nodes_own_health_gives_its_pid_and_its_reason() -> None:
    """A decoder whose own /health is 503 "no_prefiller" is unhealthy for that reason, even
    while the router still sends it requests; an ok one reports its own pid."""
    states = {"state": "no_prefiller"}
    server = serve_metrics(Metrics(), ("127.0.0.1", 0),
                           lambda: {"node_id": "d", "pid": 4242, **states})
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        ok, body = check_nodes([decoder(metrics_address=address)])
        assert not ok and body["nodes"][0] | {"address": ""} == {
            "name": "decode-0", "role": "decode", "address": "", "state": "unhealthy",
            "pid": 4242, "reason": "no_prefiller", "restarts": 0}
        states["state"] = "ok"
        ok, body = check_nodes([decoder(metrics_address=address)])
        assert ok and body["nodes"][0]["pid"] == 4242
    finally:
        server.shutdown()
        server.server_close()


def test_prefillers_are_listed_as_the_decoders_see_them() -> None:
    """`serve router` knows no prefiller itself: it lists those its decoders' own /health
    names, alive when some decoder has it alive, and which decoders see it."""
    views = [[{"address": "10.0.0.1:5", "alive": False}, {"address": "10.0.0.2:5",
                                                          "alive": True}],
             [{"address": "10.0.0.1:5", "alive": True}]]
    servers = [serve_metrics(Metrics(), ("127.0.0.1", 0), lambda view=view: {
        "node_id": "d", "pid": 1, "state": "ok", "prefillers": view}) for view in views]
    try:
        nodes = [decoder(f"decode-{i}", metrics_address=f"127.0.0.1:{s.server_address[1]}")
                 for i, s in enumerate(servers)]
        ok, body = check_nodes(nodes)
        assert ok and body["nodes"][0]["prefillers"] == views[0]
        assert body["prefillers"] == [
            {"address": "10.0.0.1:5", "alive": True, "seen_by": ["decode-0", "decode-1"]},
            {"address": "10.0.0.2:5", "alive": True, "seen_by": ["decode-0"]}]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_an_unreachable_node_health_is_named_so() -> None:
    ok, body = check_nodes([decoder(metrics_address="127.0.0.1:1")])
    assert not ok and body["nodes"][0]["state"] == "unreachable"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4,
                                        num_pages=128, chunk_size=32)
    with LocalCluster(config, supervise=True) as started:
        yield started
    assert started.exit_codes() == [0, 0], started.logs


def wait_health(nodes: list[NodeInfo], ok: bool, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    while (result := check_nodes(nodes))[0] != ok:
        assert time.monotonic() < deadline, result[1]
        time.sleep(0.1)
    return result[1]


@pytest.mark.fabric
@pytest.mark.slow  # two node processes, the prefiller restarted once
def test_a_killed_prefiller_is_503_until_the_supervisor_brings_it_back(
        cluster: LocalCluster) -> None:
    """Both front doors' views: `serve cluster`'s names the dead prefiller; `serve router`'s
    (decoders only, started by hand) names the decoder that refuses for want of it. Both
    are 200 again once it is back; the pids and the restart count are listed."""
    router = Router(cluster.decoder_addresses)
    try:
        whole = cluster_nodes(cluster, router)
        by_hand = router_nodes(router, cluster.decoder_addresses)
        with_pids = router_nodes(router, cluster.decoder_addresses,
                                 [cluster.metrics_addresses["decode-0"]])
        body = wait_health(whole, True)
        assert {n["name"]: n["pid"] for n in body["nodes"]} == {
            name: cluster.process_of(name).pid for name in cluster.names}
        assert wait_health(with_pids, True)["nodes"][0]["pid"] == cluster.process_of(
            "decode-0").pid
        old = cluster.process_of("prefill-0").pid
        os.kill(old, signal.SIGKILL)
        body = wait_health(whole, False, timeout_s=10)
        assert "prefill-0" in body["missing"], body
        body = wait_health(by_hand, False, timeout_s=10)
        assert body["nodes"][0]["state"] == "refusing" and body["status"] == "unavailable"
        seen = wait_health(with_pids, False, timeout_s=10)["prefillers"]
        assert seen == [{"address": cluster.prefiller_address, "alive": False,
                         "seen_by": ["decoder-0"]}]
        body = wait_health(whole, True)
        assert body["prefillers"][0]["restarts"] == 1
        assert body["prefillers"][0]["pid"] == cluster.process_of("prefill-0").pid != old
        wait_health(by_hand, True)
    finally:
        router.close()
