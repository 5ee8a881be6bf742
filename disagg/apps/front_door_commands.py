"""`disagg serve cluster` and `disagg serve router`: the OpenAI-compatible HTTP front door, in
front of a local cluster it starts or of nodes started by hand (`disagg/server/`)."""

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
) -> None:
    """Start a local cluster (processes over libfabric) and the OpenAI API in front of it."""
    from disagg.node.local_cluster import ClusterConfig
    from disagg.node.node_config import check_node_memory
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
    run(cluster, HTTPConfig(host, port, max_in_flight, served_model_name))


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
