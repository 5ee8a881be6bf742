"""`disagg serve cluster` and `disagg serve router`: the OpenAI-compatible HTTP front door, in
front of a cluster it starts (here, or on Ray with `--ray`) or of nodes started by hand
(`disagg/server/`). X1"""

from __future__ import annotations

from typing import Annotated

import typer

from disagg.apps.options import (
    DECODER,
    DEFAULT_MODEL,
    LOG_LEVEL,
    ROUTING,
    SHARED,
    AccessLogOption,
    DecodeTpOption,
    LogLevelOption,
    NodeOptions,
    PrefillTpOption,
    RoutingMarginOption,
    RoutingOption,
    configure_logging,
    with_node_options,
)
from disagg.apps.serve_commands import serve_app
from disagg.config import default_of
from disagg.control.address import parse_address
from disagg.errors import ConfigError
from disagg.node.cluster_config import THREADS_PER_NODE, ClusterConfig
from disagg.node.prefix_index import LOAD_MARGIN, PAGE_SIZE
from disagg.node.ray_placement import RayConfig
from disagg.server.http_config import HTTPConfig

HostOption = Annotated[str, typer.Option(help="Address the HTTP API listens on")]
PortOption = Annotated[int, typer.Option(help="Port of the HTTP API (0: any free port)")]
MaxInFlightOption = Annotated[int, typer.Option(
    help="Requests admitted at once; one more is answered 429")]
MaxBodyBytesOption = Annotated[int, typer.Option(
    help="Largest request body in bytes; a larger one is answered 413 unread")]
MaxConnectionsOption = Annotated[int, typer.Option(
    help="Open HTTP connections at once; one more is answered 503 and closed")]
HeaderTimeoutOption = Annotated[float, typer.Option(
    help="Seconds a client has to send a request's headers (else 408, closed)")]
ApiKeyOption = Annotated[str | None, typer.Option(
    envvar="DISAGG_API_KEY", show_envvar=True, show_default=False,
    help="Require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize (else 401); "
         "/health, /metrics and /version stay open. Compared on every request, in constant "
         "time. The API speaks plain HTTP: put a TLS proxy in front so the key is not sent "
         "in clear. The environment variable keeps the key out of `ps`")]
ServedNameOption = Annotated[str | None, typer.Option(
    help="The model name clients send (default: the --model value)")]
RayOption = Annotated[str | None, typer.Option(
    "--ray", rich_help_panel="Ray",
    help="Place the nodes on Ray: the head's host:port (`ray start --head`), auto "
         "(RAY_ADDRESS, or the cluster `ray start` made here) or local (a private "
         "instance). Needs the ray extra: pip install 'disagg\\[ray]'")]
RayResourceOption = Annotated[str | None, typer.Option(
    help="With --ray: a custom Ray resource NAME or NAME=AMOUNT every such node asks for "
         "(pins the role to the machines started with it)", rich_help_panel="Ray")]


# Defaults quoted from the configs that own them (typer needs them in the signature).
HOST: str = default_of(HTTPConfig, "host")
PORT: int = default_of(HTTPConfig, "port")
MAX_IN_FLIGHT: int = default_of(HTTPConfig, "max_in_flight")
MAX_BODY_BYTES: int = default_of(HTTPConfig, "max_body_bytes")
MAX_CONNECTIONS: int = default_of(HTTPConfig, "max_connections")
HEADER_TIMEOUT_S: float = default_of(HTTPConfig, "header_timeout_s")
RAY_CPUS_PER_RANK: float = default_of(RayConfig, "cpus_per_rank")
RAY_MAX_RESTARTS: int = default_of(RayConfig, "max_restarts")
RAY_BASE_PORT: int = default_of(RayConfig, "base_port")


@serve_app.command("cluster")
@with_node_options(("model", *SHARED, *DECODER), model=DEFAULT_MODEL, threads=THREADS_PER_NODE)
def serve_cluster(
    node_options: NodeOptions,
    num_prefillers: Annotated[int, typer.Option("--prefillers", help="Prefiller processes")] = 1,
    num_decoders: Annotated[int, typer.Option("--decoders", help="Decoder processes")] = 1,
    num_mixed: Annotated[int, typer.Option(
        "--mixed", help="Serve from N single-node mixed engines instead of prefillers and "
                        "decoders (the S1 baseline)")] = 0,
    host: HostOption = HOST,
    port: PortOption = PORT,
    max_in_flight: MaxInFlightOption = MAX_IN_FLIGHT,
    max_body_bytes: MaxBodyBytesOption = MAX_BODY_BYTES,
    max_connections: MaxConnectionsOption = MAX_CONNECTIONS,
    header_timeout: HeaderTimeoutOption = HEADER_TIMEOUT_S,
    served_model_name: ServedNameOption = None,
    api_key: ApiKeyOption = None,
    prefill_tp: PrefillTpOption = 1, decode_tp: DecodeTpOption = 1,
    routing: RoutingOption = ROUTING, routing_margin: RoutingMarginOption = LOAD_MARGIN,
    ray: RayOption = None, ray_prefill_resource: RayResourceOption = None,
    ray_decode_resource: RayResourceOption = None,
    ray_cpus_per_rank: Annotated[float, typer.Option(
        help="With --ray: CPUs each TP rank of a node reserves",
        rich_help_panel="Ray")] = RAY_CPUS_PER_RANK,
    ray_gpus_per_rank: Annotated[float | None, typer.Option(
        help="With --ray: GPUs each TP rank reserves (default: 1 with --device cuda, else 0)",
        rich_help_panel="Ray")] = None,
    ray_max_restarts: Annotated[int, typer.Option(
        help="With --ray: times Ray restarts a node that died (-1: without end)",
        rich_help_panel="Ray")] = RAY_MAX_RESTARTS,
    ray_base_port: Annotated[int, typer.Option(
        help="With --ray: node i listens on this + 2i (control) and + 2i + 1 (metrics), so "
             "a restarted node comes back at the same address",
        rich_help_panel="Ray")] = RAY_BASE_PORT,
    log_level: LogLevelOption = LOG_LEVEL,
    access_log: AccessLogOption = True,
) -> None:
    """Start a cluster (local processes over libfabric, or Ray actors with --ray) and the
    OpenAI API in front of it."""
    http = HTTPConfig(host, port, max_in_flight, served_model_name, max_body_bytes,
                      max_connections, header_timeout,  # bad limits fail before any node starts
                      api_key=api_key)
    from disagg.node.node_config import check_node_memory
    from disagg.node.ray_placement import (
        ResourceRequest,
        check_ray_installed,
        plan_nodes,
        probe_address,
    )
    from disagg.server.launch import serve_cluster as run

    cluster = ClusterConfig.from_options(
        **node_options, num_prefillers=num_prefillers, num_decoders=num_decoders,
        num_mixed=num_mixed,
        prefill_tp=prefill_tp, decode_tp=decode_tp, routing=routing,
        routing_margin=routing_margin)
    check_node_memory(cluster.node.device, cluster.node.kv_memory_path)  # here, not per node
    ray_config = None
    if ray is not None:
        ray_config = RayConfig(
            ray, *(ResourceRequest.parse(text, option) if text else None for text, option in (
                (ray_prefill_resource, "--ray-prefill-resource"),
                (ray_decode_resource, "--ray-decode-resource"))),
            ray_cpus_per_rank, ray_gpus_per_rank, ray_max_restarts, ray_base_port)
        plan_nodes(cluster, ray_config)  # bad placement options fail before Ray starts
        probe_address(ray)  # a wrong address is one line now, not minutes of Ray retrying
        check_ray_installed()
    elif ray_prefill_resource or ray_decode_resource:
        raise ConfigError("--ray-prefill-resource and --ray-decode-resource need --ray")
    configure_logging(log_level, access_log)
    from disagg.apps.progress import StartupProgress

    if ray_config is not None:  # Ray places the nodes: no node events to show, no spinner
        run(cluster, http, ray_config)
        return
    what = (f"{num_mixed} mixed" if num_mixed else
            f"{cluster.num_prefillers} prefill and {cluster.num_decoders} decode")
    title = f"starting {what} nodes ({cluster.node.model}, {cluster.node.provider})"
    with StartupProgress(expect=[name for name, _ in cluster.nodes()], title=title) as progress:
        run(cluster, http, on_node=progress.on_node)


@serve_app.command("router")
@with_node_options(("model", "trace", "otlp_endpoint"), model=DEFAULT_MODEL)
def serve_router(
    node_options: NodeOptions,
    decoder: Annotated[list[str], typer.Option(
        help="A decoder's (or mixed node's) host:port (repeatable)")],
    host: HostOption = HOST,
    port: PortOption = PORT,
    max_in_flight: MaxInFlightOption = MAX_IN_FLIGHT,
    max_body_bytes: MaxBodyBytesOption = MAX_BODY_BYTES,
    max_connections: MaxConnectionsOption = MAX_CONNECTIONS,
    header_timeout: HeaderTimeoutOption = HEADER_TIMEOUT_S,
    served_model_name: ServedNameOption = None,
    api_key: ApiKeyOption = None,
    routing: RoutingOption = ROUTING, routing_margin: RoutingMarginOption = LOAD_MARGIN,
    page_size: Annotated[int, typer.Option(
        help="The decoders' page size: the pages prefix routing compares")] = PAGE_SIZE,
    decoder_metrics: Annotated[list[str] | None, typer.Option(
        help="A decoder's metrics host:port (repeatable: one per --decoder, in the same "
             "order); /health then shows each decoder's pid and its own state")] = None,
    log_level: LogLevelOption = LOG_LEVEL,
    access_log: AccessLogOption = True,
) -> None:
    """The OpenAI API in front of decoders started with `disagg serve decode|mixed`."""
    from disagg.node.prefix_index import RoutingConfig
    from disagg.server.launch import serve_router as run

    http = HTTPConfig(host, port, max_in_flight, served_model_name, max_body_bytes,
                      max_connections, header_timeout, api_key=api_key)
    routing_config = RoutingConfig.parse(routing, routing_margin, page_size)
    configure_logging(log_level, access_log)
    run(node_options["model"], decoder, http, routing_config,
        _metrics_addresses(decoder, decoder_metrics), trace=node_options["trace"],
        otlp_endpoint=node_options["otlp_endpoint"])


def _metrics_addresses(decoders: list[str], metrics: list[str] | None) -> list[str | None] | None:
    """Each --decoder-metrics checked before the API starts (X5e): the i-th belongs to the
    i-th decoder, so a count that differs would pair a decoder with another's /health."""
    if not metrics:
        return None
    if len(metrics) != len(decoders):
        raise ConfigError(f"--decoder-metrics was given {len(metrics)} times for "
                          f"{len(decoders)} --decoder; give one per decoder, in the same order")
    for address in metrics:
        try:
            parse_address(address)
        except ValueError as error:
            raise ConfigError(f"--decoder-metrics: {error}") from error
    return list(metrics)
