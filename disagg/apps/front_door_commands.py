"""`disagg serve cluster` and `disagg serve router`: the OpenAI-compatible HTTP front door, in
front of a cluster it starts (here, or on Ray with `--ray`) or of nodes started by hand
(`disagg/server/`). X1"""

from __future__ import annotations

from typing import Annotated

import typer

from disagg.apps.options import (
    ChunkOption,
    CudaGraphOption,
    DeviceOption,
    DraftLayersOption,
    DraftTokensOption,
    LayoutOption,
    MemoryPathOption,
    ModelOption,
    NumPagesOption,
    PageSizeOption,
    PrefixCachingOption,
    ProviderOption,
    RoutingMarginOption,
    RoutingOption,
    SpeculativeOption,
    speculative_config,
)
from disagg.apps.serve_commands import serve_app
from disagg.config import check_kv_layout
from disagg.errors import ConfigError

HostOption = Annotated[str, typer.Option(help="Address the HTTP API listens on")]
PortOption = Annotated[int, typer.Option(help="Port of the HTTP API (0: any free port)")]
MaxInFlightOption = Annotated[int, typer.Option(
    help="Requests admitted at once; one more is answered 429")]
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


@serve_app.command("cluster")
def serve_cluster(
    model: ModelOption = "smollm2-135m",
    prefillers: Annotated[int, typer.Option(help="Prefiller processes")] = 1,
    decoders: Annotated[int, typer.Option(help="Decoder processes")] = 1,
    mixed: Annotated[int, typer.Option(
        help="Serve from N single-node mixed engines instead of prefillers and decoders "
             "(the S1 baseline)")] = 0,
    host: HostOption = "127.0.0.1", port: PortOption = 8000,
    max_in_flight: MaxInFlightOption = 256, served_model_name: ServedNameOption = None,
    kv_layout: LayoutOption = "NHD", page_size: PageSizeOption = 16,
    num_pages: NumPagesOption = 512, chunk_size: ChunkOption = 256,
    provider: ProviderOption = "tcp",
    prefill_tp: Annotated[int, typer.Option(help="Prefiller TP degree (KV by head)")] = 1,
    decode_tp: Annotated[int, typer.Option(help="Decoders' TP degree")] = 1,
    replicated: Annotated[bool, typer.Option(help="Replicated KV on every rank (S9a)")] = False,
    speculative: SpeculativeOption = None, num_draft_tokens: DraftTokensOption = 3,
    draft_layers: DraftLayersOption = 0,
    device: DeviceOption = "cpu", kv_memory_path: MemoryPathOption = "auto",
    cuda_graph: CudaGraphOption = False, prefix_caching: PrefixCachingOption = True,
    routing: RoutingOption = "prefix", routing_margin: RoutingMarginOption = 4,
    ray: RayOption = None, ray_prefill_resource: RayResourceOption = None,
    ray_decode_resource: RayResourceOption = None,
    ray_cpus_per_rank: Annotated[float, typer.Option(
        help="With --ray: CPUs each TP rank of a node reserves", rich_help_panel="Ray")] = 1.0,
    ray_gpus_per_rank: Annotated[float | None, typer.Option(
        help="With --ray: GPUs each TP rank reserves (default: 1 with --device cuda, else 0)",
        rich_help_panel="Ray")] = None,
    ray_max_restarts: Annotated[int, typer.Option(
        help="With --ray: times Ray restarts a node that died (-1: without end)",
        rich_help_panel="Ray")] = 3,
    ray_base_port: Annotated[int, typer.Option(
        help="With --ray: node i listens on this + 2i (control) and + 2i + 1 (metrics), so "
             "a restarted node comes back at the same address", rich_help_panel="Ray")] = 20000,
) -> None:
    """Start a cluster (local processes over libfabric, or Ray actors with --ray) and the
    OpenAI API in front of it."""
    from disagg.node.local_cluster import ClusterConfig
    from disagg.node.node_config import check_node_memory
    from disagg.node.ray_placement import (
        RayConfig,
        ResourceRequest,
        check_ray_installed,
        plan_nodes,
        probe_address,
    )
    from disagg.server.launch import HTTPConfig
    from disagg.server.launch import serve_cluster as run

    check_node_memory(device, kv_memory_path)
    for name, value in (("--prefillers", prefillers), ("--decoders", decoders)):
        if value < 1 and not mixed:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if mixed < 0:
        raise ConfigError(f"--mixed must be >= 0, got {mixed}")
    cluster = ClusterConfig(
        model=model, num_decoders=decoders, num_prefillers=prefillers, num_mixed=mixed,
        kv_layout=check_kv_layout(kv_layout), page_size=page_size, num_pages=num_pages,
        chunk_size=chunk_size, provider=provider, prefill_tp=prefill_tp, decode_tp=decode_tp,
        replicated_kv=replicated, device=device, kv_memory_path=kv_memory_path,
        speculative=speculative_config(speculative, num_draft_tokens, draft_layers),
        cuda_graph=cuda_graph, prefix_caching=prefix_caching, routing=routing,
        routing_margin=routing_margin)
    cluster.router_config()  # an unknown policy fails here, before any process starts
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
    run(cluster, HTTPConfig(host, port, max_in_flight, served_model_name), ray_config)


@serve_app.command("router")
def serve_router(
    decoder: Annotated[list[str], typer.Option(
        help="A decoder's (or mixed node's) host:port (repeatable)")],
    model: ModelOption = "smollm2-135m",
    host: HostOption = "127.0.0.1", port: PortOption = 8000,
    max_in_flight: MaxInFlightOption = 256, served_model_name: ServedNameOption = None,
    routing: RoutingOption = "prefix", routing_margin: RoutingMarginOption = 4,
    page_size: Annotated[int, typer.Option(
        help="The decoders' page size: the blocks prefix routing compares")] = 16,
) -> None:
    """The OpenAI API in front of decoders started with `disagg serve decode|mixed`."""
    from disagg.node.prefix_index import RoutingConfig
    from disagg.server.launch import HTTPConfig
    from disagg.server.launch import serve_router as run

    routing_config = RoutingConfig.parse(routing, routing_margin, page_size)
    run(model, decoder, HTTPConfig(host, port, max_in_flight, served_model_name),
        routing_config)
