"""A node's options in the command line's words, mapped to one `NodeConfig`: the one mapping
(S2, X1).

`disagg serve prefill|decode|mixed` (one node), `disagg serve cluster` and `disagg demo` (the
node config a cluster's nodes share, through `ClusterConfig.from_options`) and every script
that starts a cluster call `node_config_from_options`. Its keyword defaults are the command
line's defaults: the CLI reads them from this signature (`OPTION_DEFAULTS`) instead of
writing them again, and where a default is an engine config's own it is quoted from that
dataclass (`default_of`). The words that stand for a `Literal` (kv_layout, kv_memory_path,
the draft kind) are checked here, once, so a bad one is a `ConfigError` naming it and no
cast is needed. Not a second config: nothing here outlives the call.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from disagg.config import (
    CacheConfig,
    ParallelConfig,
    ReliabilityConfig,
    SchedulerConfig,
    SpeculativeConfig,
    check_draft_kind,
    check_dtype,
    check_kv_layout,
    default_of,
)
from disagg.node.node_config import (
    NodeConfig,
    NodeRole,
    check_memory_path,
    node_name,
    scheduler_mode,
)

# A served node's defaults where they differ from the engine dataclasses' own (which the
# engine's unit tests are written against): a larger cache and shorter prefill chunks.
NUM_PAGES = 512
KV_DTYPE_AUTO = "auto"  # --kv-dtype: the weights' dtype
CHUNK_SIZE = 256


def speculative_config(kind: str | None, num_draft_tokens: int = default_of(
        SpeculativeConfig, "num_draft_tokens"), draft_layers: int = default_of(
        SpeculativeConfig, "draft_layers")) -> SpeculativeConfig | None:
    """The `SpeculativeConfig` the options describe, or None without a draft kind."""
    if kind is None:
        return None
    return SpeculativeConfig(check_draft_kind(kind), num_draft_tokens, draft_layers)


def node_config_from_options(
    role: NodeRole = NodeRole.MIXED, *, model: str, node_id: str | None = None,
    listen: str = default_of(NodeConfig, "listen"), prefillers: Sequence[str] = (),
    kv_layout: str = default_of(CacheConfig, "kv_layout"),
    page_size: int = default_of(CacheConfig, "page_size"), num_pages: int = NUM_PAGES,
    prefix_caching: bool = default_of(CacheConfig, "prefix_caching"),
    chunk_size: int = CHUNK_SIZE, tp: int = default_of(ParallelConfig, "tp"),
    replicated_kv: bool = default_of(ParallelConfig, "replicated_kv"),
    provider: str = default_of(NodeConfig, "provider"),
    fabric_node: str = default_of(NodeConfig, "fabric_node"),
    domains_per_rank: int = default_of(NodeConfig, "domains_per_rank"),
    device: str = default_of(NodeConfig, "device"),
    kv_memory_path: str = default_of(NodeConfig, "kv_memory_path"),
    threads: int = 0, trace: str | None = None, otlp_endpoint: str | None = None,
    faults: str | None = None,
    lease: float = default_of(NodeConfig, "lease_s"),
    min_post_kib: int = default_of(NodeConfig, "min_post_bytes") // 1024,
    metrics_port: int | None = None,
    kv_timeout: float = default_of(ReliabilityConfig, "kv_timeout_s"),
    retry: bool = default_of(ReliabilityConfig, "retry_on_prefiller_failure"),
    speculative: str | None = None,
    num_draft_tokens: int = default_of(SpeculativeConfig, "num_draft_tokens"),
    draft_layers: int = default_of(SpeculativeConfig, "draft_layers"),
    cuda_graph: bool = default_of(NodeConfig, "cuda_graph"),
    dtype: str = "float32", kv_dtype: str = KV_DTYPE_AUTO,
) -> NodeConfig:
    """The `NodeConfig` of a node of `role` that the options describe.

    Each keyword is one command-line option (`--kv-layout` is `kv_layout`). `node_id`
    defaults to the role's first name (`prefill-0`); `threads` 0 keeps torch's default; a
    prefill chunk is also the step's token budget; `speculative` names the draft kind;
    `kv_dtype` "auto" keeps the KV in the weights' `dtype`.

    >>> config = node_config_from_options(NodeRole.PREFILL, model="tiny", chunk_size=32)
    >>> config.node_id, config.scheduler.mode, config.scheduler.max_num_batched_tokens
    ('prefill-0', 'prefill_only', 32)
    """
    return NodeConfig(
        model,
        CacheConfig(page_size=page_size, num_pages=num_pages,
                    kv_layout=check_kv_layout(kv_layout), prefix_caching=prefix_caching,
                    dtype=check_dtype(dtype if kv_dtype == KV_DTYPE_AUTO else kv_dtype)),
        SchedulerConfig(chunk_size=chunk_size, max_num_batched_tokens=chunk_size,
                        mode=scheduler_mode(role)),
        ParallelConfig(tp, replicated_kv), role=role,
        node_id=node_id or node_name(role, 0), listen=listen, prefillers=tuple(prefillers),
        provider=provider, fabric_node=fabric_node, threads=threads or None, faults=faults,
        reliability=ReliabilityConfig(kv_timeout_s=kv_timeout, retry_on_prefiller_failure=retry),
        lease_s=lease, min_post_bytes=min_post_kib * 1024, metrics_port=metrics_port,
        trace=trace, otlp_endpoint=otlp_endpoint,
        speculative=speculative_config(speculative, num_draft_tokens, draft_layers),
        device=device, kv_memory_path=check_memory_path(kv_memory_path), cuda_graph=cuda_graph,
        domains_per_rank=domains_per_rank, dtype=check_dtype(dtype))


# Every option's default, by keyword: what the command line shows and uses.
OPTION_DEFAULTS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(node_config_from_options).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY}
