"""`disagg serve prefill|decode|mixed`: one node of a deployment per process (S2, S4).

The options every node takes are defined once (`NODE_OPTIONS`); `node_command` gives them to
each command beside its own, and builds one `NodeConfig` from both, which `disagg.node.serve`
runs. `LocalCluster` builds the same `NodeConfig` and hands it to its children as JSON.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer

from disagg.apps.options import (
    ChunkOption,
    CudaGraphOption,
    DeviceOption,
    DomainsPerRankOption,
    FabricNodeOption,
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
    PrefixCachingOption,
    ProviderOption,
    ReplicatedOption,
    SpeculativeOption,
    ThreadsOption,
    TpOption,
    TraceOption,
    speculative_config,
)
from disagg.config import CacheConfig, ParallelConfig, ReliabilityConfig, SchedulerConfig
from disagg.node.node_config import NodeConfig, NodeRole

serve_app = typer.Typer(help="Run one node of a disaggregated deployment.",
                        no_args_is_help=True)

NodeIdOption = Annotated[str | None, typer.Option(
    help="Name in logs, traces and handshakes (default: ROLE-0)")]


def _option(name: str, annotation: object, default: object) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=annotation)


# Every node's options, once: (name, typer annotation, default).
NODE_OPTIONS = [
    _option("model", ModelOption, inspect.Parameter.empty),
    _option("listen", ListenOption, "127.0.0.1:0"),
    _option("node_id", NodeIdOption, None),
    _option("kv_layout", LayoutOption, "NHD"),
    _option("page_size", PageSizeOption, 16),
    _option("num_pages", NumPagesOption, 512),
    _option("chunk_size", ChunkOption, 256),
    _option("provider", ProviderOption, "tcp"),
    _option("threads", ThreadsOption, 0),
    _option("trace", TraceOption, None),
    _option("tp", TpOption, 1),
    _option("replicated_kv", ReplicatedOption, False),
    _option("faults", FaultsOption, None),
    _option("lease", LeaseOption, 300.0),
    _option("metrics_port", MetricsPortOption, None),
    _option("device", DeviceOption, "cpu"),
    _option("kv_memory_path", MemoryPathOption, "auto"),
    _option("prefix_caching", PrefixCachingOption, True),
    _option("domains_per_rank", DomainsPerRankOption, 1),
    _option("fabric_node", FabricNodeOption, "auto"),
]


def node_config(role: NodeRole, *, model: str, listen: str, node_id: str | None,
                kv_layout: str, page_size: int, num_pages: int, chunk_size: int, provider: str,
                threads: int, trace: str | None, tp: int, replicated_kv: bool,
                faults: str | None, lease: float, metrics_port: int | None, device: str,
                kv_memory_path: str, prefix_caching: bool, domains_per_rank: int,
                fabric_node: str, **fields: Any) -> NodeConfig:  # noqa: ANN401
    """The `NodeConfig` of a node of `role` from the shared options (threads 0: default)
    and the `NodeConfig` fields of the command's own options."""
    mode = "prefill_only" if role is NodeRole.PREFILL else "mixed"
    return NodeConfig(
        model, CacheConfig(page_size=page_size, num_pages=num_pages,
                           kv_layout=kv_layout,  # type: ignore[arg-type]  # checked there
                           prefix_caching=prefix_caching),
        SchedulerConfig(chunk_size=chunk_size, max_num_batched_tokens=chunk_size,
                        mode=mode),  # type: ignore[arg-type]
        ParallelConfig(tp, replicated_kv), role=role, node_id=node_id or f"{role.value}-0",
        listen=listen, provider=provider, threads=threads or None, faults=faults,
        lease_s=lease, metrics_port=metrics_port, trace=trace, device=device,
        kv_memory_path=kv_memory_path, domains_per_rank=domains_per_rank,
        fabric_node=fabric_node, **fields)


NodeFields = dict[str, Any]


def node_command(role: NodeRole) -> Callable[[Callable[..., NodeFields]], Callable[..., None]]:
    """Give `command(**its_own_options)` every option in `NODE_OPTIONS` too. The command
    returns the `NodeConfig` fields its own options set; the node then runs one `NodeConfig`
    of `role`, built once from both (so the config is checked whole, never patched)."""

    def decorate(command: Callable[..., NodeFields]) -> Callable[..., None]:
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(command, eval_str=True).parameters.values()]

        def wrapper(**options: Any) -> None:  # noqa: ANN401 - typer passes each option
            shared = {p.name: options.pop(p.name) for p in NODE_OPTIONS}
            _run(node_config(role, **shared, **command(**options)))

        parameters = [*NODE_OPTIONS, *own]
        wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        wrapper.__name__, wrapper.__doc__ = command.__name__, command.__doc__
        return wrapper

    return decorate


def _run(config: NodeConfig) -> None:
    from disagg.node.serve import run_node  # loads torch models: only when a node starts

    run_node(config)


@serve_app.command("prefill")
@node_command(NodeRole.PREFILL)
def serve_prefill() -> NodeFields:
    """Run a prefiller: prefill requests from decoders and stream their KV back."""
    return {}


@serve_app.command("decode")
@node_command(NodeRole.DECODE)
def serve_decode(
    prefiller: Annotated[list[str], typer.Option(help="A prefiller's host:port (repeatable)")],
    kv_timeout: KVTimeoutOption = 120.0,
    retry: Annotated[bool, typer.Option(
        help="Retry a dead prefiller's requests on another prefiller (else they fail)")] = True,
    speculative: SpeculativeOption = None, num_draft_tokens: DraftTokensOption = 3,
    draft_layers: DraftLayersOption = 0, cuda_graph: CudaGraphOption = False,
) -> NodeFields:
    """Run a decoder: take requests, get their KV from prefillers, decode them."""
    reliability = ReliabilityConfig(kv_timeout_s=kv_timeout, retry_on_prefiller_failure=retry)
    return {"prefillers": tuple(prefiller), "reliability": reliability,
            "speculative": speculative_config(speculative, num_draft_tokens, draft_layers),
            "cuda_graph": cuda_graph}


@serve_app.command("mixed")
@node_command(NodeRole.MIXED)
def serve_mixed(cuda_graph: CudaGraphOption = False) -> NodeFields:
    """Run a single-node engine (prefill and decode mixed, S1) behind the router protocol."""
    return {"cuda_graph": cuda_graph}
