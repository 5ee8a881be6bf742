"""Options the `disagg` commands share (typer `Annotated` aliases), and their small parsers.

Kept apart so `cli.py` (generate, demo, tools) and `serve_commands.py` (the three node kinds)
read the same flags with the same help text.
"""

from __future__ import annotations

from typing import Annotated

import typer

from disagg.config import SpeculativeConfig

SpeculativeOption = Annotated[str | None, typer.Option(
    help="Speculative decoding with this draft: mtp (an MTP head, random-init) or early-exit "
         "(the model's first layers)")]
DraftTokensOption = Annotated[int, typer.Option(
    help="Draft tokens proposed per step, verified by one forward (with --speculative)")]
DraftLayersOption = Annotated[int, typer.Option(
    help="Layers of the early-exit draft (0: all but the last two)")]


def speculative_config(kind: str | None, num_draft_tokens: int,
                       draft_layers: int) -> SpeculativeConfig | None:
    """The `SpeculativeConfig` the options describe, or None without --speculative."""
    if kind is None:
        return None
    return SpeculativeConfig(kind, num_draft_tokens, draft_layers)  # type: ignore[arg-type]


ModelOption = Annotated[str, typer.Option(help="smollm2-135m, a preset (tiny, small) or a "
                                                "Hugging Face Llama checkpoint directory")]
LayoutOption = Annotated[str, typer.Option(help="KV page layout: NHD or HND")]
PageSizeOption = Annotated[int, typer.Option(help="Tokens per KV page")]
NumPagesOption = Annotated[int, typer.Option(help="KV pages in the cache")]
ChunkOption = Annotated[int, typer.Option(help="Prefill chunk size in tokens")]
ProviderOption = Annotated[str, typer.Option(help="libfabric provider: tcp, shm, efa, verbs, or "
                                                   "a provider name")]
ThreadsOption = Annotated[int, typer.Option(help="torch threads for this node (0: default)")]
TraceOption = Annotated[str | None, typer.Option(
    help="Write a Chrome trace: a file path ({node_id} is filled in) or a directory")]
FabricNodeOption = Annotated[str, typer.Option(
    help="Local fabric address the KV writes use: auto (loopback for tcp/shm, every device for "
         "efa/verbs), or this host's IP for tcp between hosts")]
DomainsPerRankOption = Annotated[int, typer.Option(
    help="Fabric domains per TP rank where no RDMA NIC is near it: stand-ins over the "
         "provider's own interface (with RDMA NICs, the nearest NICs decide; S5b, S6a)")]
TpOption = Annotated[int, typer.Option(
    help="Tensor-parallel degree: this process leads N-1 rank processes, the model's heads and "
         "KV split among them (S3c, S6)")]
ReplicatedOption = Annotated[bool, typer.Option(
    help="Every TP rank holds the whole KV cache (MLA-style latent cache, S9a)")]
FaultsOption = Annotated[str | None, typer.Option(
    hidden=True, help="Test only: inject fabric faults, e.g. seed=1,drop_imm=0.01")]
KVTimeoutOption = Annotated[float, typer.Option(
    help="Decoder: seconds a request may wait for its KV before it is cancelled and retried")]
LeaseOption = Annotated[float, typer.Option(
    help="Prefiller: seconds after which a transfer is stopped and its pages freed")]
ListenOption = Annotated[str, typer.Option(
    help="host:port for control connections (port 0: any free port)")]
MetricsPortOption = Annotated[int | None, typer.Option(
    help="Serve Prometheus metrics at http://host:PORT/metrics (0: any free port)")]
DeviceOption = Annotated[str, typer.Option(help="Model and KV cache device: cpu, cuda, cuda:N")]
MemoryPathOption = Annotated[str, typer.Option(
    help="How the NIC reaches the KV (S5): auto, host (CPU), hmem (FI_HMEM) or staged")]
CudaGraphOption = Annotated[bool, typer.Option(
    help="Decode steps through static buffers, replayed as CUDA graphs on a GPU (S3b)")]
PrefixCachingOption = Annotated[bool, typer.Option(
    "--prefix-caching/--no-prefix-caching",
    help="Keep full KV pages after a request and reuse them for prompts with the same prefix")]
RoutingOption = Annotated[str, typer.Option(
    help="How the router picks a decoder: prefix (the longest cached prefix, unless past "
         "--routing-margin of the least loaded) or least-loaded")]
RoutingMarginOption = Annotated[int, typer.Option(
    help="Requests in flight beyond the least-loaded decoder that a cached prefix may cost")]
