"""Which nodes the front door stands in front of, and whether each one answers (`/health`).

A node answers when its process (if we started it) runs and its metrics endpoint says so
(`GET /health` on the node's metrics port); a node without a metrics address counts as up
while the router's connection to it is alive. `/health` is 200 only when every node answers.
"""

from __future__ import annotations

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


def node_state(node: NodeInfo) -> str:
    """"ok", or a word for what is wrong: exited, unreachable, disconnected."""
    if node.process is not None and node.process.poll() is not None:
        return "exited"
    if node.connected is not None and not node.connected():
        return "disconnected"
    if node.metrics_address is None:
        return "ok"
    try:
        url = f"http://{node.metrics_address}/health"
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as reply:
            return "ok" if reply.status == 200 else "unhealthy"
    except urllib.error.HTTPError as error:
        return "unhealthy" if error.code == 503 else "ok" if error.code == 404 else "unreachable"
    except OSError:
        return "unreachable"


def check_nodes(nodes: list[NodeInfo]) -> tuple[bool, dict[str, Any]]:
    """(every node answers, the `/health` body listing each node)."""
    with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        states = list(pool.map(node_state, nodes))
    listed = [{"name": n.name, "role": n.role, "address": n.address, "state": state,
               "pid": n.process.pid if n.process is not None else None}
              for n, state in zip(nodes, states, strict=True)]
    missing = [n["name"] for n in listed if n["state"] != "ok"]
    body: dict[str, Any] = {"status": "ok" if not missing else "degraded", "nodes": listed}
    if missing:
        body["missing"] = missing
    return not missing, body
