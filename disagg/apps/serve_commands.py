"""`disagg serve prefill|decode|mixed`: one node of a deployment per process (S2, S4).

Each command turns its flags into a `NodeConfig` (`node_setup.node_config`) and hands it to
`disagg.node.serve`; `LocalCluster` starts nodes through exactly these commands.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from disagg.apps.options import (
    ChunkOption,
    CudaGraphOption,
    DeviceOption,
    DraftLayersOption,
    DraftTokensOption,
    FaultsOption,
    KVTimeoutOption,
    LayoutOption,
    LeaseOption,
    ListenOption,
    MemoryPathOption,
    MetricsPortOption,
    ModelOption,
    NumPagesOption,
    PageSizeOption,
    ProviderOption,
    ReplicatedOption,
    SpeculativeOption,
    ThreadsOption,
    TpOption,
    TraceOption,
    speculative_config,
)

serve_app = typer.Typer(help="Run one node of a disaggregated deployment.",
                        no_args_is_help=True)


@serve_app.command("prefill")
def serve_prefill(
    model: ModelOption,
    listen: ListenOption = "127.0.0.1:0",
    node_id: Annotated[str, typer.Option(help="Name in logs and handshakes")] = "prefill-0",
    kv_layout: LayoutOption = "NHD", page_size: PageSizeOption = 16,
    num_pages: NumPagesOption = 512, chunk_size: ChunkOption = 256,
    provider: ProviderOption = "tcp", threads: ThreadsOption = 0, trace: TraceOption = None,
    tp: TpOption = 1, replicated_kv: ReplicatedOption = False,
    faults: FaultsOption = None, kv_timeout: KVTimeoutOption = 120.0,
    lease: LeaseOption = 300.0, metrics_port: MetricsPortOption = None,
    device: DeviceOption = "cpu", kv_memory_path: MemoryPathOption = "auto",
) -> None:
    """Run a prefiller: prefill requests from decoders and stream their KV back."""
    from disagg.node.builder import node_config
    from disagg.node.serve import serve_prefill as run

    config = node_config(model, kv_layout, page_size, num_pages, chunk_size, provider, threads,
                         "prefill_only", tp, replicated_kv, faults, kv_timeout, lease,
                         metrics_port, device, kv_memory_path)
    run(config, listen, node_id, trace)


@serve_app.command("decode")
def serve_decode(
    model: ModelOption,
    prefiller: Annotated[list[str], typer.Option(help="A prefiller's host:port (repeatable)")],
    listen: ListenOption = "127.0.0.1:0",
    node_id: Annotated[str, typer.Option(help="Name in logs and handshakes")] = "decode-0",
    kv_layout: LayoutOption = "NHD", page_size: PageSizeOption = 16,
    num_pages: NumPagesOption = 512, chunk_size: ChunkOption = 256,
    provider: ProviderOption = "tcp", threads: ThreadsOption = 0, trace: TraceOption = None,
    tp: TpOption = 1, replicated_kv: ReplicatedOption = False,
    faults: FaultsOption = None, kv_timeout: KVTimeoutOption = 120.0,
    lease: LeaseOption = 300.0, metrics_port: MetricsPortOption = None,
    device: DeviceOption = "cpu", kv_memory_path: MemoryPathOption = "auto",
    retry: Annotated[bool, typer.Option(
        help="Retry a dead prefiller's requests on another prefiller (else they fail)")] = True,
    speculative: SpeculativeOption = None, num_draft_tokens: DraftTokensOption = 3,
    draft_layers: DraftLayersOption = 0, cuda_graph: CudaGraphOption = False,
) -> None:
    """Run a decoder: take requests, get their KV from prefillers, decode them."""
    from disagg.node.builder import node_config
    from disagg.node.serve import serve_decode as run

    config = node_config(model, kv_layout, page_size, num_pages, chunk_size, provider, threads,
                         "mixed", tp, replicated_kv, faults, kv_timeout, lease, metrics_port,
                         device, kv_memory_path)
    spec = speculative_config(speculative, num_draft_tokens, draft_layers)
    run(replace(config, retry_on_prefiller_failure=retry, speculative=spec,  # type: ignore[arg-type]
                cuda_graph=cuda_graph), listen,
        prefiller, node_id, trace)


@serve_app.command("mixed")
def serve_mixed(
    model: ModelOption,
    listen: ListenOption = "127.0.0.1:0",
    node_id: Annotated[str, typer.Option(help="Name in logs and traces")] = "mixed-0",
    kv_layout: LayoutOption = "NHD", page_size: PageSizeOption = 16,
    num_pages: NumPagesOption = 512, chunk_size: ChunkOption = 256,
    provider: ProviderOption = "tcp", threads: ThreadsOption = 0, trace: TraceOption = None,
    tp: TpOption = 1, replicated_kv: ReplicatedOption = False,
    faults: FaultsOption = None, kv_timeout: KVTimeoutOption = 120.0,
    lease: LeaseOption = 300.0, metrics_port: MetricsPortOption = None,
    device: DeviceOption = "cpu", kv_memory_path: MemoryPathOption = "auto",
    cuda_graph: CudaGraphOption = False,
) -> None:
    """Run a single-node engine (prefill and decode mixed, S1) behind the router protocol."""
    from disagg.node.builder import node_config
    from disagg.node.serve import serve_decode as run

    config = node_config(model, kv_layout, page_size, num_pages, chunk_size, provider, threads,
                         "mixed", tp, replicated_kv, faults, kv_timeout, lease, metrics_port,
                         device, kv_memory_path, cuda_graph)
    run(config, listen, [], node_id, trace)
