"""Which nodes the front door stands in front of, and whether a request could be served now
(`/health`, X5e).

Each node is judged on what is known of it: its process (if we started it: the current one,
a restart replaces it), the router's view for a decoder (connected, accepting, not silent:
`Router.takes_requests`, so a decoder whose prefillers are all gone counts as refusing, as
the router would treat it), and its own `GET /health` on its metrics port (its pid, and its
own state: a decoder with no live prefiller says "no_prefiller"). `/health` is 200 only when a
request could be served now (some decoder or mixed node is ok: it takes requests, and a
decoder's own health says a prefiller is alive for it) and every node answers; the body says
which case it is ("ok", "degraded": servable with a node missing, "unavailable"), and lists
every node with its pid and how often it was restarted, prefillers included.
"""

from __future__ import annotations

import enum
import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

HEALTH_TIMEOUT_S = 1.0
SERVING_ROLES = ("decode", "mixed")  # the roles a router sends requests to


class NodeState(enum.Enum):
    """What the front door makes of one node."""

    OK = "ok"
    EXITED = "exited"  # its process ended (a supervised one is being restarted)
    DISCONNECTED = "disconnected"  # the router lost its connection
    REFUSING = "refusing"  # connected, but the router sends it nothing (not accepting, silent)
    UNHEALTHY = "unhealthy"  # its own /health says it cannot serve (its reason is listed)
    UNREACHABLE = "unreachable"  # its /health did not answer


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node: its name and role, control and metrics addresses, and how to look at it."""

    name: str
    role: str
    address: str
    metrics_address: str | None = None
    process: Callable[[], subprocess.Popen[str] | None] | None = None  # the current one
    connected: Callable[[], bool] | None = None  # the router's connection, for decoders
    takes_requests: Callable[[], bool] | None = None  # the router sends it requests
    ray_node_id: str | None = None  # the Ray node its actor runs on (`serve cluster --ray`)
    restarts: Callable[[], int] | None = None  # how often the supervisor started it again


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """One node as judged now: its state, its pid (if known) and its own reason."""

    state: NodeState
    pid: int | None = None
    reason: str | None = None  # the node's own state word when it is not "ok"
    prefillers: tuple[dict[str, Any], ...] = ()  # a decoder's, as it sees them


def node_state(node: NodeInfo) -> NodeHealth:
    """Judge one node: its process, then the router's view, then its own `/health`."""
    process = node.process() if node.process is not None else None
    if process is not None and process.poll() is not None:
        return NodeHealth(NodeState.EXITED, process.pid)
    pid = process.pid if process is not None else None
    own = None if node.metrics_address is None else _own_health(node.metrics_address)
    if isinstance(own, NodeState):
        return NodeHealth(own, pid)
    pid = pid if own is None else own.get("pid", pid)
    reason = None if own is None or own.get("state") == "ok" else str(own.get("state"))
    seen = tuple(own.get("prefillers", ())) if own is not None else ()
    if node.takes_requests is not None and not node.takes_requests():
        # The router's view decides whether requests reach it; its own reason says why not.
        connected = node.connected is None or node.connected()
        return NodeHealth(NodeState.REFUSING if connected else NodeState.DISCONNECTED, pid,
                          reason, seen)
    if reason is not None:
        return NodeHealth(NodeState.UNHEALTHY, pid, reason, seen)
    return NodeHealth(NodeState.OK, pid, prefillers=seen)


def _own_health(metrics_address: str) -> dict[str, Any] | NodeState | None:
    """The node's `/health` body, or the state its failure to answer means (None: no
    `/health` there, an older node)."""
    try:
        url = f"http://{metrics_address}/health"
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        if error.code != 503:
            return NodeState.UNREACHABLE
        try:
            return json.loads(error.read())  # 503: the body says why
        except ValueError:
            return NodeState.UNHEALTHY
    except (OSError, ValueError):
        return NodeState.UNREACHABLE


def check_nodes(nodes: list[NodeInfo]) -> tuple[bool, dict[str, Any]]:
    """(a request could be served now and every node answers, the `/health` body)."""
    with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        judged = list(pool.map(node_state, nodes))
    listed = [_entry(node, health) for node, health in zip(nodes, judged, strict=True)]
    servable = any(n.role in SERVING_ROLES and h.state is NodeState.OK
                   for n, h in zip(nodes, judged, strict=True))
    missing = [entry["name"] for entry in listed if entry["state"] != NodeState.OK.value]
    status = "unavailable" if not servable else "degraded" if missing else "ok"
    body: dict[str, Any] = {"status": status, "servable": servable, "nodes": listed,
                            "prefillers": [e for e in listed if e["role"] == "prefill"]
                            or _seen_prefillers(nodes, judged)}
    if missing:
        body["missing"] = missing
    return servable and not missing, body


def _seen_prefillers(nodes: list[NodeInfo], judged: list[NodeHealth]) -> list[dict[str, Any]]:
    """Prefillers as the decoders see them, where the front door knows none itself (`serve
    router`): each address, whether some decoder has it alive, and which decoders see it."""
    seen: dict[str, dict[str, Any]] = {}
    for node, health in zip(nodes, judged, strict=True):
        for prefiller in health.prefillers:
            entry = seen.setdefault(str(prefiller.get("address")), {
                "address": str(prefiller.get("address")), "alive": False, "seen_by": []})
            entry["seen_by"].append(node.name)
            entry["alive"] = entry["alive"] or bool(prefiller.get("alive"))
    return list(seen.values())


def _entry(node: NodeInfo, health: NodeHealth) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": node.name, "role": node.role, "address": node.address,
                             "state": health.state.value, "pid": health.pid,
                             "restarts": node.restarts() if node.restarts is not None else 0}
    if health.reason is not None:
        entry["reason"] = health.reason
    if health.prefillers:
        entry["prefillers"] = list(health.prefillers)
    if node.ray_node_id:
        entry["ray_node_id"] = node.ray_node_id
    return entry
