"""Options the `disagg` commands share: typer `Annotated` aliases, and the node options table.

`NODE_FLAGS` is the flag of every keyword of the one mapping to a node config
(`disagg.node.node_options.node_config_from_options`), and `with_node_options` gives a command
the flags it names, with the mapping's own defaults, and hands their values over as one dict
in the mapping's words. So `serve prefill|decode|mixed`, `serve cluster` and `demo` read the
same flags, with the same help and defaults, and none of them maps a flag by hand.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from typing import Annotated, Any

import typer

from disagg.apps.config_file import CONFIG, apply_config_file
from disagg.config import default_of
from disagg.node.log_level import DEFAULT_LOG_LEVEL, LOG_LEVEL_ENV, LOG_LEVELS, check_log_level
from disagg.node.node_options import OPTION_DEFAULTS
from disagg.node.prefix_index import RoutingConfig

DEFAULT_MODEL = "smollm2-135m"  # what a cluster, a router and the demo serve unless told
ROUTING: str = default_of(RoutingConfig, "policy").value  # the router's policy, as a word
REQUIRED = inspect.Parameter.empty  # a flag with no default must be given

SpeculativeOption = Annotated[str | None, typer.Option(
    help="Speculative decoding with this draft: mtp (an MTP head, random-init) or early-exit "
         "(the model's first layers)")]
DraftTokensOption = Annotated[int, typer.Option(
    help="Draft tokens proposed per step, verified by one forward (with --speculative)")]
DraftLayersOption = Annotated[int, typer.Option(
    help="Layers of the early-exit draft (0: all but the last two)")]
ModelOption = Annotated[str, typer.Option(
    help="smollm2-135m, a random-init preset (tiny, small, tiny-mla-moe, tiny-qwen3-moe), a "
         "Hugging Face safetensors checkpoint directory or a Hub id (owner/name) of Llama, "
         "Mistral, Qwen2, Qwen3, Qwen3-MoE or DeepSeek-V3")]
LayoutOption = Annotated[str, typer.Option(help="KV page layout: NHD or HND")]
PageSizeOption = Annotated[int, typer.Option(help="Tokens per KV page")]
NumPagesOption = Annotated[int, typer.Option(help="KV pages in the cache")]
ChunkOption = Annotated[int, typer.Option(help="Prefill chunk size in tokens")]
ProviderOption = Annotated[str, typer.Option(help="libfabric provider: tcp, shm, efa, verbs, or "
                                                   "a provider name")]
ThreadsOption = Annotated[int, typer.Option(help="torch threads per node (0: torch's default)")]
TraceOption = Annotated[str | None, typer.Option(
    help="Write a Chrome trace: a file path ({node_id} is filled in) or a directory")]
OtlpOption = Annotated[str | None, typer.Option(
    help="Send requests' spans to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318 "
         "(needs the otel extra)")]
FabricNodeOption = Annotated[str, typer.Option(
    help="Local fabric address the KV writes use: auto (loopback for tcp/shm, every device for "
         "efa/verbs), or this host's IP for tcp between hosts")]
DomainsPerRankOption = Annotated[int, typer.Option(
    help="Fabric domains per TP rank where no RDMA NIC is near it: stand-ins over the "
         "provider's own interface (with RDMA NICs, the nearest NICs decide; S5b, S6a)")]
TpOption = Annotated[int, typer.Option(
    help="Tensor-parallel degree: this process leads N-1 rank processes, the model's heads and "
         "KV split among them (S3c, S6)")]
PrefillTpOption = Annotated[int, typer.Option(help="Prefillers' TP degree (KV by head)")]
DecodeTpOption = Annotated[int, typer.Option(help="Decoders' TP degree")]
ReplicatedOption = Annotated[bool, typer.Option(
    help="Every TP rank holds the whole KV cache (MLA-style latent cache, S9a)")]
FaultsOption = Annotated[str | None, typer.Option(
    hidden=True, help="Test only: inject fabric faults, e.g. seed=1,drop_imm=0.01")]
KVTimeoutOption = Annotated[float, typer.Option(
    help="Decoder: seconds a request may wait for its KV before it is cancelled and retried")]
RetryOption = Annotated[bool, typer.Option(
    help="Decoder: retry a dead prefiller's requests on another prefiller (else they fail)")]
LeaseOption = Annotated[float, typer.Option(
    help="Prefiller: seconds after which a transfer is stopped and its pages freed")]
MinPostOption = Annotated[int, typer.Option(
    min=0, help="Prefiller: KiB a group of layers carries before it is posted (smaller layers "
                "ride with the next ones; 0: every layer alone, as soon as it is done)")]
ListenOption = Annotated[str, typer.Option(
    help="host:port for control connections (port 0: any free port)")]
NodeIdOption = Annotated[str | None, typer.Option(
    help="Name in logs, traces and handshakes (default: ROLE-0)")]
PrefillerOption = Annotated[list[str], typer.Option(
    "--prefiller", help="A prefiller's host:port (repeatable)")]
MetricsPortOption = Annotated[int | None, typer.Option(
    help="Serve Prometheus metrics at http://host:PORT/metrics (0: any free port)")]
DeviceOption = Annotated[str, typer.Option(help="Model and KV cache device: cpu, cuda, cuda:N")]
MemoryPathOption = Annotated[str, typer.Option(
    help="How the NIC reaches the KV (S5): auto, host (CPU), hmem (FI_HMEM) or staged")]
DtypeOption = Annotated[str, typer.Option(
    help="Weights and activations: float32, bfloat16 or float16")]
KVDtypeOption = Annotated[str, typer.Option(
    help="The KV cache, hence every page write: auto (the weights' --dtype), float32, "
         "bfloat16 or float16")]
CudaGraphOption = Annotated[bool, typer.Option(
    help="Decode steps through static buffers, replayed as CUDA graphs on a GPU (S3b)")]
PrefixCachingOption = Annotated[bool, typer.Option(
    "--prefix-caching/--no-prefix-caching",
    help="Keep full KV pages after a request and reuse them for prompts with the same prefix")]
RoutingOption = Annotated[str, typer.Option(
    help="How the router picks a decoder: prefix (the longest cached prefix, unless past "
         "--routing-margin of the least loaded) or least-loaded")]
ConfigOption = Annotated[str | None, typer.Option(
    "--config", is_eager=True, callback=apply_config_file, show_default=False,
    help="A YAML (.yaml, .yml) or TOML (.toml) file of this command's flags, keyed by flag "
         "name (page-size: 8); flags given on the command line override it. "
         "`disagg config show COMMAND` prints one")]
LogLevelOption = Annotated[str, typer.Option(
    help=f"How much this process and every node it starts log to stderr: "
         f"{', '.join(LOG_LEVELS)}")]
AccessLogOption = Annotated[bool, typer.Option(
    "--access-log/--no-access-log",
    help="One line per HTTP request on stderr: client, method, path, status, milliseconds")]
RoutingMarginOption = Annotated[int, typer.Option(
    help="Requests in flight beyond the least-loaded decoder that a cached prefix may cost")]

# The flag of every keyword of `node_config_from_options`, the one mapping.
NODE_FLAGS: dict[str, object] = {
    "model": ModelOption, "node_id": NodeIdOption, "listen": ListenOption,
    "prefillers": PrefillerOption, "kv_layout": LayoutOption, "page_size": PageSizeOption,
    "num_pages": NumPagesOption, "prefix_caching": PrefixCachingOption, "chunk_size": ChunkOption,
    "tp": TpOption, "replicated_kv": ReplicatedOption, "provider": ProviderOption,
    "fabric_node": FabricNodeOption, "domains_per_rank": DomainsPerRankOption,
    "device": DeviceOption, "kv_memory_path": MemoryPathOption, "threads": ThreadsOption,
    "trace": TraceOption, "otlp_endpoint": OtlpOption, "faults": FaultsOption,
    "lease": LeaseOption, "min_post_kib": MinPostOption,
    "metrics_port": MetricsPortOption, "kv_timeout": KVTimeoutOption, "retry": RetryOption,
    "speculative": SpeculativeOption, "num_draft_tokens": DraftTokensOption,
    "draft_layers": DraftLayersOption, "cuda_graph": CudaGraphOption, "dtype": DtypeOption,
    "kv_dtype": KVDtypeOption,
}
# The options every node of a cluster shares, besides the model; a cluster sets ONE_NODE's
# per node itself, and only decoders keep DECODER's.
SHARED = ("kv_layout", "page_size", "num_pages", "prefix_caching", "chunk_size",
          "replicated_kv", "provider", "fabric_node", "domains_per_rank", "device",
          "kv_memory_path", "threads", "trace", "otlp_endpoint", "faults", "lease",
          "min_post_kib", "dtype", "kv_dtype")
ONE_NODE = ("node_id", "listen", "tp", "metrics_port")
DECODER = ("kv_timeout", "retry", "speculative", "num_draft_tokens", "draft_layers",
           "cuda_graph")
assert set(NODE_FLAGS) == {"model", "prefillers", *SHARED, *ONE_NODE, *DECODER} == set(
    OPTION_DEFAULTS), "every keyword of the mapping has one flag, in one group"

NodeOptions = dict[str, Any]
LOG_LEVEL = DEFAULT_LOG_LEVEL


def configure_logging(log_level: str, access_log: bool | None = None) -> None:
    """This process's logging at `log_level`, and the same for every node process it starts
    (through `LOG_LEVEL_ENV`); with `access_log` set, the front door's access log on or off."""
    level = check_log_level(log_level)
    os.environ[LOG_LEVEL_ENV] = log_level.lower()
    logging.basicConfig(level=level, format="%(name)s %(levelname)s %(message)s")
    if access_log is not None:
        from disagg.server.http_server import enable_access_log

        enable_access_log(access_log)


def with_node_options(names: tuple[str, ...], **defaults: Any  # noqa: ANN401 - a default
                      ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give the typer command `command(node_options, **its_own)` the flags of the node options
    `names` besides its own, each with the mapping's default unless `defaults` names another
    (`REQUIRED`: none), and `--config FILE` for all of them. Their values reach it as
    `node_options`, keyed by the mapping's keywords: its body passes them on whole, so a flag
    added here reaches every node config."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(command, eval_str=True).parameters.values()
               if p.name != "node_options"]
        flags = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                   annotation=NODE_FLAGS[name],
                                   default=defaults.get(name, OPTION_DEFAULTS[name]))
                 for name in names]

        def wrapper(**options: Any) -> Any:  # noqa: ANN401 - typer passes each option
            options.pop(CONFIG)  # read already: its values are the other flags' defaults
            node_options = {name: options.pop(name) for name in names}
            return command(node_options=node_options, **options)

        config = inspect.Parameter(CONFIG, inspect.Parameter.KEYWORD_ONLY,
                                   annotation=ConfigOption, default=None)
        parameters = [config, *flags, *own]
        wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        wrapper.__name__, wrapper.__doc__ = command.__name__, command.__doc__
        return wrapper

    return decorate
