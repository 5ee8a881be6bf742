"""Where each node of a cluster goes on Ray, decided without Ray (X3).

`RayConfig` is what `disagg serve cluster --ray` was asked; `plan_nodes` turns it and the
`ClusterConfig` into one `RayNodePlacement` per node: its name and role, its placement group's
bundles (one per TP rank, packed onto one Ray node because the ranks share memory) and the
two fixed ports it listens on. Fixed ports are what make a restart invisible to its peers: Ray
re-runs a dead node's actor in the same placement group, so the node comes back at the same
host:port, where the router and the decoders already reconnect. Nothing here imports `ray`:
the CLI checks its options with it, and only `ray_cluster.py` talks to Ray.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass

from disagg.control.address import parse_address
from disagg.errors import ConfigError
from disagg.node.cluster_config import ClusterConfig
from disagg.node.node_config import NodeRole

LOCAL = "local"  # `--ray local`: a private Ray instance on this machine, gone on exit
AUTO = "auto"  # `--ray auto`: the cluster RAY_ADDRESS (or `ray start` on this machine) names
PORTS_PER_NODE = 2  # control, then metrics
MAX_PORT = 65535
PROBE_TIMEOUT_S = 5.0
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


@dataclass(frozen=True, slots=True)
class ResourceRequest:
    """A custom Ray resource a node asks for, so a user can pin a role to machines."""

    name: str
    amount: float = 1.0

    @staticmethod
    def parse(text: str, option: str) -> ResourceRequest:
        """`NAME` or `NAME=AMOUNT` (a positive number); a `ConfigError` naming `option`.

        >>> ResourceRequest.parse("decode_host=0.5", "--ray-decode-resource")
        ResourceRequest(name='decode_host', amount=0.5)
        """
        name, sep, amount = text.partition("=")
        if not name or any(c.isspace() or c in "{}\"'," for c in name):
            raise ConfigError(f"{option} {text!r}: expected NAME or NAME=AMOUNT")
        if name in RAY_BUILTIN_RESOURCES:
            raise ConfigError(f"{option} {text!r}: {name} is Ray's own resource; name one "
                              "you gave `ray start --resources`")
        if not sep:
            return ResourceRequest(name)
        try:
            value = float(amount)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{option} {text!r}: the amount must be a positive number")
        return ResourceRequest(name, value)


@dataclass(frozen=True, slots=True)
class RayConfig:
    """How to place the cluster on Ray (`disagg serve cluster --ray ...`)."""

    address: str  # "local", "auto" or the head's host:port (what `ray start --head` printed)
    prefill_resource: ResourceRequest | None = None  # every prefiller asks for it
    decode_resource: ResourceRequest | None = None  # every decoder (or mixed node) asks for it
    cpus_per_rank: float = 1.0
    gpus_per_rank: float | None = None  # None: 1 on a CUDA device, else 0
    max_restarts: int = 3  # per node; -1: without end
    base_port: int = 20000  # node i listens on base + 2i (control) and base + 2i + 1 (metrics)

    def __post_init__(self) -> None:
        check_ray_address(self.address)
        if self.cpus_per_rank < 0 or (self.gpus_per_rank or 0) < 0:
            raise ConfigError("--ray-cpus-per-rank and --ray-gpus-per-rank must be >= 0")
        if self.max_restarts < -1:
            raise ConfigError(f"--ray-max-restarts must be -1 (no end) or >= 0, got "
                              f"{self.max_restarts}")
        if not 1024 <= self.base_port <= MAX_PORT - 1:
            raise ConfigError(f"--ray-base-port must be in 1024..{MAX_PORT - 1}, got "
                              f"{self.base_port}")


@dataclass(frozen=True, slots=True)
class RayNodePlacement:
    """One node on Ray: its placement group's bundles (bundle 0 holds the node's actor) and
    the ports it listens on, on whichever Ray node the group lands. (Where its TP ranks'
    NICs and cores are is `rank_placement.NodePlacement`, decided on that machine.)"""

    name: str
    role: NodeRole
    bundles: tuple[dict[str, float], ...]
    port: int
    metrics_port: int


def check_ray_address(address: str) -> str:
    """`address` if it is local, auto or host:port; else a `ConfigError` naming it."""
    if address in (LOCAL, AUTO):
        return address
    try:
        parse_address(address)
    except ValueError:
        raise ConfigError(f"--ray {address!r}: expected local, auto or the head's "
                          "host:port (as `ray start --head` printed it)") from None
    return address


def check_ray_installed() -> None:
    """A `ConfigError` naming the extra when `ray` cannot be imported (only with --ray: the
    import takes a second or two, and the cluster needs it next anyway)."""
    try:
        import ray  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"--ray needs Ray ({error}): pip install 'disagg[ray]'") from None


def probe_address(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """A `ConfigError` naming `address` unless something accepts connections there: Ray's own
    connect retries for minutes on a wrong address, so it is refused here at once."""
    if address in (LOCAL, AUTO):
        return
    host, port = parse_address(address)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        raise ConfigError(f"--ray {address}: no Ray cluster answers there "
                          f"({error.strerror or error}); start one with `ray start --head` "
                          "or use --ray local") from None


def node_bundles(tp: int, cpus: float, gpus: float,
                 resource: ResourceRequest | None) -> tuple[dict[str, float], ...]:
    """One bundle per TP rank; the custom resource goes in bundle 0 only, since STRICT_PACK
    puts every bundle on the same Ray node anyway.

    >>> node_bundles(2, 1.0, 0.0, ResourceRequest("decode_host"))
    ({'CPU': 1.0, 'decode_host': 1.0}, {'CPU': 1.0})
    """
    rank = {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}
    if not rank and resource is None:
        raise ConfigError("a node must ask Ray for something: --ray-cpus-per-rank or "
                          "--ray-gpus-per-rank above 0, or a role resource")
    first = dict(rank, **({resource.name: resource.amount} if resource else {}))
    return (first, *[dict(rank) for _ in range(tp - 1)])


def node_ports(base_port: int, index: int) -> tuple[int, int]:
    """(control, metrics) port of the `index`-th node.

    >>> node_ports(20000, 2)
    (20004, 20005)
    """
    port = base_port + PORTS_PER_NODE * index
    if port + 1 > MAX_PORT:
        raise ConfigError(f"--ray-base-port {base_port}: node {index} would need port "
                          f"{port + 1}, past {MAX_PORT}")
    return port, port + 1


def plan_nodes(cluster: ClusterConfig, ray: RayConfig) -> list[RayNodePlacement]:
    """Every node of `cluster`, in `cluster.nodes()` order (prefillers first: decoders need
    their addresses)."""
    device = cluster.node.device
    gpus = ray.gpus_per_rank
    if gpus is None:
        gpus = 1.0 if device.startswith("cuda") else 0.0
    if gpus > 0 and device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device} with --ray: use --device cuda; Ray picks each "
                          "node's GPUs")
    return [RayNodePlacement(name, role, node_bundles(
                cluster.tp_of(role), ray.cpus_per_rank, gpus,
                ray.prefill_resource if role is NodeRole.PREFILL else ray.decode_resource),
                *node_ports(ray.base_port, index))
            for index, (name, role) in enumerate(cluster.nodes())]
