"""Starting the front door: `disagg serve cluster` (a local cluster, or one placed on Ray with
`--ray`, and its HTTP API) and `disagg serve router` (the HTTP API in front of nodes started
elsewhere). X1

Both print one line `READY http://HOST:PORT` once the server accepts connections, serve until
SIGINT or SIGTERM, then close the router; `serve cluster` then stops every node it started,
each checking on its way out that it leaked nothing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from disagg.engine.guided import GuideCompiler
from disagg.model.loading.registry import load_tokenizer
from disagg.node.cluster_config import ClusterConfig
from disagg.node.local_cluster import LocalCluster
from disagg.node.node_config import NodeRole
from disagg.node.prefix_index import RoutingConfig
from disagg.node.preflight import check_cluster, check_http, check_model_spec
from disagg.node.router import Router
from disagg.server.app import FrontDoor
from disagg.server.chat_template import ChatTemplate
from disagg.server.cluster_client import ClusterClient
from disagg.server.health import NodeInfo, check_nodes
from disagg.server.http_config import HTTPConfig
from disagg.server.http_server import serve_http
from disagg.server.metrics import ServerMetrics
from disagg.utils.trace import Tracer, trace_path

if TYPE_CHECKING:
    from disagg.node.ray_cluster import RayCluster
    from disagg.node.ray_placement import RayConfig

logger = logging.getLogger(__name__)
FRONT_DOOR = "front-door"  # the front door's name in traces (its nodes have theirs)


def make_front_door(model_spec: str, router: Router, nodes: list[NodeInfo],
                    http: HTTPConfig, max_request_tokens: int | None = None,
                    tracer: Tracer | None = None) -> FrontDoor:
    """The API's state: the model's tokenizer and chat template, the client, the metrics. It
    never reads the weights (the nodes do): for a Hub id it fetches only the tokenizer files."""
    loaded = load_tokenizer(model_spec)
    template = None
    if loaded.chat_template and loaded.tokenizer is not None:
        template = ChatTemplate.for_tokenizer(loaded.chat_template, loaded.tokenizer)
    client = ClusterClient(router, http.max_in_flight, tracer)
    name = http.model_name or model_spec
    metrics = ServerMetrics(name, lambda: nodes, lambda: client.num_waiting)
    # Its own compiler refuses a grammar that cannot compile before it is submitted.
    return FrontDoor(name, loaded.config, loaded.tokenizer, template, client, metrics,
                     lambda: check_nodes(nodes), max_request_tokens,
                     guides=GuideCompiler.for_model(loaded))


def serve_cluster(cluster_config: ClusterConfig, http: HTTPConfig,
                  ray_config: RayConfig | None = None,
                  on_node: Callable[[str, str], None] | None = None) -> None:
    """Start the cluster's processes (here, supervised: a node that dies is started again,
    X5e; or as Ray actors with `ray_config`, which Ray restarts), then the API in front of
    its decoders. The API's port and the nodes' provider are checked first: starting the
    nodes takes as long as loading the model. `on_node` hears each local node start and
    become ready (`LocalCluster`)."""
    check_http(http.host, http.port)
    check_cluster(cluster_config, local=ray_config is None)
    if ray_config is None:
        with LocalCluster(cluster_config, supervise=True, on_node=on_node) as cluster:
            _serve_nodes(cluster, http)
        return
    from disagg.node.ray_cluster import RayCluster  # only here: Ray is an optional extra

    with RayCluster(cluster_config, ray_config) as cluster:
        _serve_nodes(cluster, http)


def _serve_nodes(cluster: LocalCluster | RayCluster, http: HTTPConfig) -> None:
    """A router in front of the cluster's decoders, and the API in front of it."""
    config = cluster.config
    router = Router(cluster.decoder_addresses, config.router_config())
    tracer = front_door_tracer(config.node.trace, config.node.otlp_endpoint)
    try:
        serve_http(make_front_door(config.node.model, router, cluster_nodes(cluster, router),
                                   http, config.node.cache.num_tokens, tracer), http)
    finally:
        tracer.close()


def front_door_tracer(trace: str | None, otlp_endpoint: str | None) -> Tracer:
    """The front door's spans (X7a): where its requests' traces start; to the same
    destinations as its nodes' (`--trace`, `--otlp-endpoint`)."""
    return Tracer(trace_path(trace, FRONT_DOOR), FRONT_DOOR, otlp_endpoint=otlp_endpoint)


def cluster_nodes(cluster: LocalCluster | RayCluster, router: Router) -> list[NodeInfo]:
    """What `/health` looks at for each node of a cluster: its current process (a local
    cluster's), its restart count (the supervisor's, or Ray's), the router's view of each
    decoder, its own `/health`."""
    roles = cluster.roles()
    addresses = dict(zip(cluster.names, [*cluster.prefiller_addresses,
                                         *cluster.decoder_addresses], strict=False))
    decoders = [n for n in cluster.names if roles[n] is not NodeRole.PREFILL]
    local = isinstance(cluster, LocalCluster)
    ray_node_ids = getattr(cluster, "ray_node_ids", {})
    nodes = []
    for name in cluster.names:
        index = decoders.index(name) if name in decoders else None
        nodes.append(NodeInfo(
            name, roles[name].value, addresses.get(name, ""),
            cluster.metrics_addresses.get(name),
            process=functools.partial(cluster.process_of, name) if local else None,
            connected=None if index is None else _router_view(router.alive.__getitem__, index),
            takes_requests=None if index is None else _router_view(router.takes_requests, index),
            ray_node_id=ray_node_ids.get(name),
            restarts=functools.partial(cluster.restart_count, name)))
    return nodes


def serve_router(model_spec: str, decoder_addresses: list[str], http: HTTPConfig,
                 routing: RoutingConfig | None = None,
                 metrics_addresses: list[str | None] | None = None, trace: str | None = None,
                 otlp_endpoint: str | None = None) -> None:
    """The API in front of decoders (or mixed nodes) started by hand, maybe on other hosts;
    with each one's metrics address (`metrics_addresses`, in the same order), `/health` also
    reads its own `/health`: its pid and whether it has a live prefiller. `trace` and
    `otlp_endpoint` are where the front door's spans go."""
    check_model_spec(model_spec)
    check_http(http.host, http.port)
    tracer = front_door_tracer(trace, otlp_endpoint)  # a bad endpoint stops it here
    router = Router(decoder_addresses, routing)
    try:
        serve_http(make_front_door(model_spec, router, router_nodes(
            router, decoder_addresses, metrics_addresses), http, tracer=tracer), http)
    finally:
        tracer.close()


def router_nodes(router: Router, decoder_addresses: list[str],
                 metrics_addresses: list[str | None] | None = None) -> list[NodeInfo]:
    """What `/health` looks at for decoders started by hand: the router's view of each (it
    takes requests: connected, accepting, not silent), and its own `/health` if known."""
    metrics = list(metrics_addresses or [])
    metrics += [None] * (len(decoder_addresses) - len(metrics))
    return [NodeInfo(f"decoder-{i}", "decode", address, metrics[i],
                     connected=_router_view(router.alive.__getitem__, i),
                     takes_requests=_router_view(router.takes_requests, i))
            for i, address in enumerate(decoder_addresses)]


def _router_view(look: Callable[[int], bool], index: int) -> Callable[[], bool]:
    return lambda: look(index)
