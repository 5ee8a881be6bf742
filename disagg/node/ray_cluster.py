"""The cluster of `LocalCluster`, placed on Ray: one actor per node, each in its own placement
group (X3; what `disagg serve cluster --ray` runs).

The driver (this process) connects to Ray (or starts a private instance), reserves one
placement group per node (one bundle per TP rank, STRICT_PACK: the ranks share memory, so
they share a machine), starts each prefiller's `NodeActor` in bundle 0 of its group, asks the
actors where their nodes listen (through Ray, no host:port lists), then starts the decoders
with those addresses. Every node gets the same cluster secret (the user's, or one made here)
and fixed ports (`ray_placement.plan_nodes`), so a node Ray restarts comes back where its
peers reconnect. `stop` shuts the nodes down, kills the actors, frees the groups and, for a
private instance, stops Ray.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable

import ray
from ray._private import state as ray_state
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from disagg.errors import ConfigError, DisaggError
from disagg.node.cluster_config import ClusterConfig
from disagg.node.node_config import NodeRole
from disagg.node.ray_actor import NodeActor
from disagg.node.ray_placement import (
    LOCAL,
    RayConfig,
    RayNodePlacement,
    plan_nodes,
    probe_address,
)
from disagg.node.secret_scope import SecretScope

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 20.0


@ray.remote
def _bundle_gpu_ids() -> list[str]:
    return [str(i) for i in ray.get_gpu_ids()]


class RayCluster:
    """Context manager: the nodes of `config` as Ray actors; the same attributes as
    `LocalCluster` (names, addresses, metrics addresses, roles) plus each node's Ray node."""

    def __init__(self, config: ClusterConfig, ray_config: RayConfig) -> None:
        self.config = config
        self.ray_config = ray_config
        self.placements = plan_nodes(config, ray_config)
        self.namespace = f"disagg-{uuid.uuid4().hex[:8]}"  # `ray list actors` groups them
        self.names: list[str] = []  # started nodes, prefillers first
        self.prefiller_addresses: list[str] = []
        self.decoder_addresses: list[str] = []
        self.metrics_addresses: dict[str, str] = {}
        self.ray_node_ids: dict[str, str] = {}
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self._groups: dict[str, PlacementGroup] = {}
        self._started_ray = False
        self._secret: SecretScope | None = None
        self._sigterm: Callable[..., object] | int | None = signal.SIG_DFL

    def __enter__(self) -> RayCluster:
        try:
            self._connect()
            self._reserve()
            first = [p for p in self.placements if p.role is NodeRole.PREFILL]
            self.prefiller_addresses = self._start(first, ())
            rest = [p for p in self.placements if p.role is not NodeRole.PREFILL]
            self.decoder_addresses = self._start(rest, tuple(self.prefiller_addresses))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def roles(self) -> dict[str, NodeRole]:
        """Node name -> its role, for every node started."""
        return {p.name: p.role for p in self.placements if p.name in self.names}

    def restart_count(self, name: str) -> int:
        """How often Ray restarted node `name`'s actor (X5e: `/health`'s restarts), as Ray's
        control store counts it. Ray's public state API asks the dashboard, which a private
        instance runs without, so this reads the store's actor table as `ray.get` does."""
        actor = self.actors.get(name)
        if actor is None:
            return 0
        return int(ray_state.actors(actor._actor_id.hex())["NumRestarts"])  # noqa: SLF001

    def _connect(self) -> None:
        # One secret for every node, and for this process, whose router signs its frames.
        self._secret = SecretScope()
        if ray.is_initialized():  # a caller (a test, a notebook) connected already
            return
        address = self.ray_config.address
        probe_address(address)
        # ray.init installs its own SIGTERM handler and leaves it after ray.shutdown.
        self._sigterm = signal.getsignal(signal.SIGTERM)
        if address == LOCAL:
            # Sized for this cluster: logical CPUs and the role resources its groups ask for.
            needs: dict[str, float] = {}
            for bundle in (b for p in self.placements for b in p.bundles):
                for name, amount in bundle.items():
                    needs[name] = needs.get(name, 0.0) + amount
            cpus = max(needs.pop("CPU", 0.0), float(os.cpu_count() or 1))
            needs.pop("GPU", None)  # Ray counts the GPUs it finds
            ray.init(num_cpus=math.ceil(cpus), resources=needs, include_dashboard=False,
                     namespace=self.namespace, log_to_driver=False)
        else:
            try:
                ray.init(address=address, namespace=self.namespace, log_to_driver=False)
            except (ConnectionError, RuntimeError) as error:  # no cluster, or a wrong token
                raise ConfigError(f"--ray {address}: cannot join the Ray cluster: "
                                  f"{_last_line(error)}") from None
        self._started_ray = True

    def _reserve(self) -> None:
        """One placement group per node, all asked at once; an error names those Ray could
        not place in time (no Ray node has what their bundles ask)."""
        for p in self.placements:
            self._groups[p.name] = placement_group(list(p.bundles), strategy="STRICT_PACK",
                                                   name=f"{self.namespace}-{p.name}")
        timeout = self.config.startup_timeout_s
        deadline = time.monotonic() + timeout
        waiting = [p for p in self.placements
                   if not self._groups[p.name].wait(max(0.0, deadline - time.monotonic()))]
        if waiting:
            wanted = "; ".join(f"{p.name}: {list(p.bundles)}" for p in waiting)
            raise ConfigError(f"Ray placed no group within {timeout:g} s for {wanted} (does "
                              "a Ray node have these resources? `ray status` lists them)")

    def _start(self, placements: list[RayNodePlacement],
               prefillers: tuple[str, ...]) -> list[str]:
        """Start these nodes side by side; their control addresses, in order."""
        assert self._secret is not None, "_connect set the cluster secret"
        for p in placements:
            group = self._groups[p.name]
            first = p.bundles[0]
            rank_gpus = [gpu for index in range(1, len(p.bundles))
                         for gpu in self._gpus_of(group, index, p.bundles[index])]
            custom = {k: v for k, v in first.items() if k not in ("CPU", "GPU")}
            self.actors[p.name] = ray.remote(NodeActor).options(
                name=p.name, namespace=self.namespace, num_cpus=first.get("CPU", 0),
                num_gpus=first.get("GPU", 0), resources=custom,
                max_restarts=self.ray_config.max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0),
            ).remote(self.config.node_config(p.role, p.name, prefillers).to_json(), p.port,
                     p.metrics_port, self._secret.secret, rank_gpus,
                     self.config.startup_timeout_s)
        addresses = []
        for p in placements:
            try:
                info = ray.get(self.actors[p.name].info.remote(),
                               timeout=self.config.startup_timeout_s + 30)
            except (RayActorError, GetTimeoutError) as error:
                raise DisaggError(f"{p.name} did not start on Ray: {_last_line(error)}") from None
            self.names.append(p.name)
            addresses.append(info["address"])
            self.ray_node_ids[p.name] = info["ray_node_id"]
            if info["metrics_address"]:
                self.metrics_addresses[p.name] = info["metrics_address"]
        return addresses

    def _gpus_of(self, group: PlacementGroup, index: int, bundle: dict[str, float]) -> list[str]:
        """The GPUs Ray reserved in bundle `index` (one TP rank's): a task placed there says."""
        if not bundle.get("GPU"):
            return []
        probe = _bundle_gpu_ids.options(
            num_cpus=0, num_gpus=bundle["GPU"],
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, index))
        try:
            return ray.get(probe.remote(), timeout=self.config.startup_timeout_s)
        except GetTimeoutError:
            raise DisaggError(f"no task ran in bundle {index} of a placement group within "
                              f"{self.config.startup_timeout_s:g} s to name its GPUs") from None

    def stop(self) -> None:
        """Shut every node down (all asked at once), kill the actors, free the groups; a
        private Ray instance is stopped too. Exit codes other than 0 are logged."""
        stopping = {name: actor.stop.remote(STOP_TIMEOUT_S)
                    for name, actor in self.actors.items()}
        for name, pending in stopping.items():
            try:
                code = ray.get(pending, timeout=STOP_TIMEOUT_S + 10)
            except (RayActorError, GetTimeoutError) as error:
                code = f"its actor is gone ({type(error).__name__})"
            if code != 0:
                logger.warning("%s stopped with %s", name, code)
            ray.kill(self.actors[name], no_restart=True)
        self.actors.clear()
        for group in self._groups.values():
            remove_placement_group(group)
        self._groups.clear()
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._sigterm)
        if self._secret is not None:
            self._secret.restore()


def _last_line(error: BaseException) -> str:
    """The cause of an actor's death, from Ray's multi-line report: its last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
