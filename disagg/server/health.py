"""Which nodes the front door stands in front of, and whether each one answers (`/health`).

A node answers when its process (if we started it) runs and its metrics endpoint says so
(`GET /health` on the node's metrics port); a node without a metrics address counts as up
while the router's connection to it is alive. `/health` is 200 only when every node answers.
A node placed on Ray (`serve cluster --ray`) is listed with its Ray node id, and with the
process id its own `/health` reports (Ray may have restarted it since the start).
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

HEALTH_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node: its name and role, control address, metrics address and process, if known."""

    name: str
    role: str
    address: str
    metrics_address: str | None = None
    process: subprocess.Popen[str] | None = None
    connected: Callable[[], bool] | None = None  # the router's view, for decoders
    ray_node_id: str | None = None  # the Ray node its actor runs on (`serve cluster --ray`)


def node_state(node: NodeInfo) -> tuple[str, int | None]:
    """("ok", or a word for what is wrong: exited, unreachable, disconnected; the process id
    the node's own `/health` reported, if it answered)."""
    if node.process is not None and node.process.poll() is not None:
        return "exited", None
    if node.connected is not None and not node.connected():
        return "disconnected", None
    if node.metrics_address is None:
        return "ok", None
    try:
        url = f"http://{node.metrics_address}/health"
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as reply:
            pid = json.loads(reply.read()).get("pid")
            return ("ok" if reply.status == 200 else "unhealthy"), pid
    except urllib.error.HTTPError as error:
        state = "unhealthy" if error.code == 503 else "ok" if error.code == 404 else "unreachable"
        return state, None
    except (OSError, ValueError):
        return "unreachable", None


def check_nodes(nodes: list[NodeInfo]) -> tuple[bool, dict[str, Any]]:
    """(every node answers, the `/health` body listing each node)."""
    with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        states = list(pool.map(node_state, nodes))
    listed = [{"name": n.name, "role": n.role, "address": n.address, "state": state,
               "pid": n.process.pid if n.process is not None else pid,
               **({"ray_node_id": n.ray_node_id} if n.ray_node_id else {})}
              for n, (state, pid) in zip(nodes, states, strict=True)]
    missing = [n["name"] for n in listed if n["state"] != "ok"]
    body: dict[str, Any] = {"status": "ok" if not missing else "degraded", "nodes": listed}
    if missing:
        body["missing"] = missing
    return not missing, body
