"""What a cluster is asked to be: the `NodeConfig` its nodes share, and the cluster's own
choices, how many nodes of each role, TP per role, routing (S1, S2, S9, X1, X3).

A cluster composes a node config, it does not re-declare one: `node` holds every node
option once (model, cache, scheduler, transport, decoder options), and `node_config(role,
node_id, prefillers)` derives each process's config from it, the one place where a node's
role decides its scheduler mode, its TP degree and whether it keeps the decoder-only
options. `LocalCluster` and `RayCluster` start exactly those configs, in the order `nodes()`
gives. `from_options` builds a cluster from the command line's words through the mapping
`disagg serve prefill|decode|mixed` uses (`node_options.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

from disagg.config import default_of
from disagg.errors import ConfigError
from disagg.node.node_config import NodeConfig, NodeRole, node_name, scheduler_mode
from disagg.node.node_options import node_config_from_options
from disagg.node.prefix_index import RoutingConfig, RoutingPolicy, check_routing_policy

# A cluster's nodes share machines (all of them, for a local cluster): one torch thread each
# unless told otherwise, where a node alone would take torch's default of every core.
THREADS_PER_NODE = 1


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The nodes to start: what they share (`node`, a mixed node's config whose role,
    node id, prefillers and TP each node replaces) and how many of each role.

    `prefill_tp` is the prefillers' TP degree; `decode_tp` the decoders', and the mixed
    nodes', which stand where decoders stand. With `num_mixed` > 0 the cluster is that many
    single-node engines (the S1 baseline) and the prefiller and decoder counts are unused.
    """

    node: NodeConfig
    num_prefillers: int = 1
    num_decoders: int = 1
    num_mixed: int = 0
    prefill_tp: int = 1
    decode_tp: int = 1
    routing: RoutingPolicy = default_of(RoutingConfig, "policy")  # a router in front of it
    routing_margin: int = default_of(RoutingConfig, "load_margin")
    startup_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        # Set in `node`, any of these would be silently replaced per node: refused instead.
        if self.node.role is not NodeRole.MIXED or self.node.prefillers:
            raise ConfigError("a cluster's shared node config is a mixed node's with no "
                              "prefillers: each node's role and prefillers are its own")
        if self.node.parallel.tp != 1:
            raise ConfigError(f"a cluster's shared node config has tp {self.node.parallel.tp}: "
                              "set prefill_tp and decode_tp instead")
        if self.num_mixed < 0:
            raise ConfigError(f"num_mixed must be >= 0, got {self.num_mixed}")
        for name in ("num_prefillers", "num_decoders"):
            if not self.num_mixed and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("prefill_tp", "decode_tp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    @staticmethod
    def from_options(**options: Any) -> ClusterConfig:  # noqa: ANN401 - the CLI's words
        """A cluster from the command line's words: the `ClusterConfig` fields by name
        (`routing` as its word), every other keyword an option of `node_config_from_options`
        (threads default to `THREADS_PER_NODE`).

        >>> cluster = ClusterConfig.from_options(model="tiny", num_decoders=2, page_size=4)
        >>> cluster.num_decoders, cluster.node.cache.page_size, cluster.node.threads
        (2, 4, 1)
        """
        own = {f.name for f in dataclasses.fields(ClusterConfig)} - {"node"}
        fields = {name: options.pop(name) for name in own & set(options)}
        if "routing" in fields:
            fields["routing"] = check_routing_policy(fields["routing"])
        options.setdefault("threads", THREADS_PER_NODE)
        return ClusterConfig(node_config_from_options(NodeRole.MIXED, **options), **fields)

    def nodes(self) -> list[tuple[str, NodeRole]]:
        """(name, role) of every node, in the order they start: prefillers first, since the
        decoders need their addresses; or the mixed nodes."""
        if self.num_mixed:
            return [(node_name(NodeRole.MIXED, i), NodeRole.MIXED) for i in range(self.num_mixed)]
        return [*[(node_name(NodeRole.PREFILL, i), NodeRole.PREFILL)
                  for i in range(self.num_prefillers)],
                *[(node_name(NodeRole.DECODE, i), NodeRole.DECODE)
                  for i in range(self.num_decoders)]]

    def tp_of(self, role: NodeRole) -> int:
        """The TP degree of a node of `role`."""
        return self.prefill_tp if role is NodeRole.PREFILL else self.decode_tp

    def node_config(self, role: NodeRole, node_id: str,
                    prefillers: tuple[str, ...] = ()) -> NodeConfig:
        """The `NodeConfig` of one node of this cluster: `node` as that role. Only decoders
        keep the decoder options (a draft, decode graphs); every node serves its metrics
        on a free port, which the cluster reads back from its READY line."""
        decoder = role is NodeRole.DECODE
        return replace(
            self.node, role=role, node_id=node_id, prefillers=prefillers,
            scheduler=replace(self.node.scheduler, mode=scheduler_mode(role)),
            parallel=replace(self.node.parallel, tp=self.tp_of(role)),
            speculative=self.node.speculative if decoder else None,
            cuda_graph=self.node.cuda_graph and decoder, metrics_port=0)

    def router_config(self) -> RoutingConfig:
        """What a router in front of this cluster does; it compares the nodes' pages."""
        return RoutingConfig(self.routing, self.routing_margin, self.node.cache.page_size)

    def with_node(self, **changes: Any) -> ClusterConfig:  # noqa: ANN401 - any node field
        """A copy whose shared node config has some fields changed."""
        return replace(self, node=replace(self.node, **changes))
