"""`disagg serve cluster --ray ADDRESS` on a three-node Ray cluster on this machine
(`ray.cluster_utils.Cluster`): a head, a "prefill host" and a "decode host" told apart by
custom resources. The nodes land where their resources say, in one STRICT_PACK group per node;
greedy tokens over HTTP (the real `openai` client) equal the single-node engine's (what
`disagg generate` runs); a decoder killed mid-stream ends its request once, is restarted by
Ray and re-admitted by the router (a killed prefiller comes back to the decoders the same
way); shutdown leaves no actors, processes or /dev/shm files.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from disagg.errors import ConfigError
from disagg.node.cluster_config import ClusterConfig
from disagg.node.ray_cluster import RayCluster
from disagg.node.ray_placement import RayConfig, ResourceRequest
from tests.disagg.server import test_openai_e2e as e2e
from tests.disagg.server.test_openai_e2e import MODEL, Server

# Slow: Ray's three nodes, then three node processes as actors (about 40 s in all).
pytestmark = [pytest.mark.fabric, pytest.mark.slow, pytest.mark.serial]

BASE_PORT = 24000  # above Ray's default worker ports (10002-19999)
# A Ray node's process carries ray_actor.CHILD in its command line; others' tests may run
# plain `disagg.node.serve` processes on a shared machine at the same time.
LEFTOVER_PATTERNS = ("PR_SET_PDEATHSIG", "raylet", "gcs_server")


@dataclass
class World:
    cluster: Cluster
    prefill_host: str  # Ray node ids
    decode_host: str
    server: Server
    shm_before: set[str]
    sigterm: object


def _processes_matching(pattern: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True,
                           check=False).stdout.splitlines()
    return [line for line in found if "pgrep" not in line]


def _nodes(server: Server) -> dict[str, dict]:
    return {n["name"]: n for n in json.loads(server.get("/health")[1])["nodes"]}


def _shut_down(world: World) -> None:
    """Stop the server (if running), the test's Ray connection, then Ray's nodes."""
    if world.server.process.poll() is None:
        e2e.stop_server(world.server)
    ray.shutdown()
    signal.signal(signal.SIGTERM, world.sigterm)  # ray.init's handler outlives ray.shutdown
    world.cluster.shutdown()


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    shm_before = set(os.listdir("/dev/shm"))
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})
    # Logical CPUs and GPUs: Ray counts what it is told, so 2 cores hold 2 TP-2 decoders,
    # and each rank's bundle "holds" a GPU whose id reaches the node's environment.
    prefill = cluster.add_node(num_cpus=1, num_gpus=1, resources={"prefill_host": 1})
    decode = cluster.add_node(num_cpus=4, num_gpus=4, resources={"decode_host": 2})
    cluster.wait_for_nodes()
    sigterm = signal.getsignal(signal.SIGTERM)
    ray.init(address=cluster.address)  # the test's own look at actors and groups
    try:
        server = e2e.start_server("--ray", cluster.address, "--decoders", "2", "--decode-tp", "2",
                              "--ray-prefill-resource", "prefill_host",
                              "--ray-decode-resource", "decode_host",
                              "--ray-gpus-per-rank", "1", "--ray-base-port", str(BASE_PORT),
                              "--routing", "least-loaded")
    except BaseException:
        ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)
        cluster.shutdown()
        raise
    running = World(cluster, prefill.node_id, decode.node_id, server, shm_before, sigterm)
    yield running
    _shut_down(running)


def test_nodes_land_where_their_role_resources_say(world: World) -> None:
    """/health lists each node with its Ray node id: the prefiller on the prefill host, both
    decoders on the decode host."""
    nodes = _nodes(world.server)
    assert {name: n["ray_node_id"] for name, n in nodes.items()} == {
        "prefill-0": world.prefill_host, "decode-0": world.decode_host,
        "decode-1": world.decode_host}
    assert [n["address"].rsplit(":", 1)[1] for n in nodes.values()] == [
        str(BASE_PORT), str(BASE_PORT + 2), str(BASE_PORT + 4)]


def test_each_node_has_one_strict_pack_group_of_its_tp_ranks(world: World) -> None:
    """Decoders at TP 2: two bundles, packed on one Ray node; the prefiller at TP 1: one."""
    groups = {g["name"].split("-", 2)[2]: g  # named disagg-<run>-<node>
              for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"}
    assert sorted(groups) == ["decode-0", "decode-1", "prefill-0"]
    for name, group in groups.items():
        assert group["strategy"] == "STRICT_PACK"
        assert len(group["bundles"]) == (1 if name.startswith("prefill") else 2)
        assert len(set(group["bundles_to_node_id"].values())) == 1


def test_a_nodes_process_sees_the_gpus_of_all_its_ranks(world: World) -> None:
    """The GPUs Ray reserved in a decoder's two bundles reach its process (its ranks use
    them); the two decoders' GPUs are distinct."""
    visible = []
    for name in ("decode-0", "decode-1"):
        pid = _nodes(world.server)[name]["pid"]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        [devices] = [v.split(b"=", 1)[1].decode() for v in environ
                     if v.startswith(b"CUDA_VISIBLE_DEVICES=")]
        visible.append(devices.split(","))
    assert [len(set(ids)) for ids in visible] == [2, 2]
    assert not set(visible[0]) & set(visible[1])


def test_greedy_tokens_over_http_equal_one_node(world: World) -> None:
    """Through the real `openai` client, on both decoders (least-loaded, side by side)."""
    client = world.server.client
    prompts = [e2e.prompt_of(11, seed=3), e2e.prompt_of(17, seed=4)]
    replies = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
               for p in prompts]
    assert [r.choices[0].model_extra["token_ids"] for r in replies] == [
        e2e.reference_tokens(p, 8) for p in prompts]


def _stream_events(server: Server, prompt: list[int], max_tokens: int) -> Iterator[dict]:
    """The SSE events of one streamed completion, as dicts, until [DONE] or the end."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
         "stream": True}), {"Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200
    for raw in reply:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            yield json.loads(line.removeprefix("data: "))
    connection.close()


def test_a_decoder_killed_mid_stream_is_restarted_and_readmitted(world: World) -> None:
    """SIGKILL decode-0's process while it streams: the request ends once (an error event,
    or a retry that finishes), Ray restarts the node at the same address on the same Ray
    node, the router takes it back, and it serves the next requests right."""
    victim = _nodes(world.server)["decode-0"]
    events = _stream_events(world.server, e2e.prompt_of(6, seed=9), 400)
    first = next(events)  # decoding has begun, on decode-0 (idle, least-loaded: the first)
    os.kill(victim["pid"], signal.SIGKILL)
    received = [first, *events]
    terminal = [e for e in received if "error" in e or e["choices"][0]["finish_reason"]]
    assert len(terminal) == 1, received[-3:]
    if "error" not in terminal[0]:  # retried elsewhere: then the whole answer arrived
        assert sum(len(e["choices"][0]["token_ids"]) for e in received) == 400
    back = _wait_restarted(world.server, "decode-0", victim["pid"])
    assert (back["address"], back["ray_node_id"]) == (victim["address"], victim["ray_node_id"])
    assert back["restarts"] == victim["restarts"] + 1
    for seed in (5, 6):  # sequential, least-loaded: decode-0 takes them
        prompt = e2e.prompt_of(9, seed=seed)
        reply = world.server.client.completions.create(model=MODEL, prompt=prompt,
                                                       max_tokens=6, temperature=0)
        assert reply.choices[0].model_extra["token_ids"] == e2e.reference_tokens(prompt, 6)


def _wait_restarted(server: Server, name: str, old_pid: int) -> dict:
    """The node's /health entry once /health is 200 again with a new pid for it."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        status, body = server.get("/health")
        node = {n["name"]: n for n in json.loads(body)["nodes"]}[name]
        if status == 200 and node["pid"] not in (None, old_pid):
            return node
        time.sleep(0.5)
    raise AssertionError(f"{name} not back within 90 s: {body}")


def test_a_killed_prefiller_is_restarted_and_the_decoders_take_it_back(world: World) -> None:
    """SIGKILL the only prefiller: Ray restarts it at the same address, both decoders
    reconnect to it (prefiller_link), and requests are served right again."""
    victim = _nodes(world.server)["prefill-0"]
    os.kill(victim["pid"], signal.SIGKILL)
    back = _wait_restarted(world.server, "prefill-0", victim["pid"])
    assert (back["address"], back["ray_node_id"]) == (victim["address"], victim["ray_node_id"])
    assert back["restarts"] == victim["restarts"] + 1
    prompt = e2e.prompt_of(12, seed=8)
    reply = world.server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                                   temperature=0)
    assert reply.choices[0].model_extra["token_ids"] == e2e.reference_tokens(prompt, 6)


def test_unplaceable_nodes_fail_naming_what_they_ask(world: World) -> None:
    """A role resource no Ray node has: one error naming the node and its bundles, within the
    startup timeout, and its placement groups are gone again."""
    nodes = RayCluster(ClusterConfig.from_options(model=MODEL, startup_timeout_s=2.0),
                       RayConfig(world.cluster.address, base_port=BASE_PORT + 100,
                                 decode_resource=ResourceRequest("nowhere")))
    with pytest.raises(ConfigError, match=r"decode-0: \[\{'CPU': 1.0, 'nowhere': 1.0\}\]"):
        nodes.__enter__()
    groups = [g for g in ray.util.placement_group_table().values()
              if g["name"].startswith(nodes.namespace)]
    assert sorted(g["name"].split("-", 2)[2] for g in groups) == ["decode-0", "prefill-0"]
    assert all(g["state"] == "REMOVED" for g in groups)


def test_shutdown_leaves_no_actors_processes_or_shm_files(world: World) -> None:
    """SIGINT: the server exits 0 (every node shut down clean), then no actor is alive, no
    group is held, and once Ray's nodes stop no process (node, TP rank, Ray's) or /dev/shm
    file remains."""
    leaders = [n["pid"] for n in _nodes(world.server).values()]
    ranks = [int(pid) for leader in leaders for pid in subprocess.run(
        ["pgrep", "-P", str(leader)], capture_output=True, text=True, check=False).stdout.split()]
    assert len(ranks) >= 2  # the TP-2 decoders' second ranks, children of their nodes
    e2e.stop_server(world.server)
    assert ray.util.list_named_actors(all_namespaces=True) == []
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
    _shut_down(world)
    deadline = time.monotonic() + 20
    while any(map(_processes_matching, LEFTOVER_PATTERNS)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for pattern in LEFTOVER_PATTERNS for p in _processes_matching(pattern)] == []
    assert [pid for pid in leaders + ranks if Path(f"/proc/{pid}").exists()] == []
    assert set(os.listdir("/dev/shm")) <= world.shm_before
