"""Configuration dataclasses: the paged KV cache, the scheduler, parallelism,
speculation and a decoder's reliability policy (S1, S3, S6, S7, S8).

Frozen and validated on construction, so a bad value fails where it is written, not deep
inside a forward pass. The model's own shape (`ModelConfig`, presets) is in `model_config.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any, Literal, TypeVar

import torch

from disagg.errors import ConfigError
# The model's shape lives in `model_config.py`; re-exported, since every config names it.
from disagg.model_config import PRESETS as PRESETS
from disagg.model_config import ModelConfig as ModelConfig

KVLayout = Literal["NHD", "HND"]
KV_LAYOUTS: tuple[KVLayout, ...] = ("NHD", "HND")
KVMemory = Literal["torch", "cumem"]
KV_MEMORIES: tuple[KVMemory, ...] = ("torch", "cumem")
# What a node's scheduler runs: prefills and decodes together, or prefills only (a prefiller).
SchedulerMode = Literal["mixed", "prefill_only"]
SCHEDULER_MODES: tuple[SchedulerMode, ...] = ("mixed", "prefill_only")
# Batch-size buckets of the decode graphs (`EngineConfig.graph_batch_sizes`).
GRAPH_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)


Choice = TypeVar("Choice", bound=str)


def check_choice(value: str, choices: tuple[Choice, ...], what: str) -> Choice:
    """`value` as the one of `choices` it names (so typed as their `Literal`), else a
    `ConfigError` naming `what`, the value and the choices: how a word from the command line
    or a JSON document becomes a `Literal` field, checked once, with no cast.

    >>> check_choice("HND", KV_LAYOUTS, "kv_layout")
    'HND'
    """
    for choice in choices:
        if value == choice:
            return choice
    raise ConfigError(f"unknown {what} {value!r}: expected one of {choices}")


# Precisions the engine runs in: weights and activations (`EngineConfig.dtype`), the KV cache
# (`CacheConfig.dtype`), by the names torch and the command line use.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}


def check_dtype(name: str) -> torch.dtype:
    """The torch dtype `name` stands for ("bfloat16"), else a `ConfigError` naming the choices.

    >>> check_dtype("bfloat16")
    torch.bfloat16
    """
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}: expected one of {tuple(DTYPES)}")
    return DTYPES[name]


def check_kv_layout(kv_layout: str) -> KVLayout:
    """Return `kv_layout` if it names a layout, else raise `ConfigError` naming it."""
    return check_choice(kv_layout, KV_LAYOUTS, "kv_layout")


def check_scheduler_mode(mode: str) -> SchedulerMode:
    """Return `mode` if it names a scheduler mode, else raise `ConfigError` naming it."""
    return check_choice(mode, SCHEDULER_MODES, "scheduler mode")


def default_of(config: type, name: str) -> Any:  # noqa: ANN401 - any field's default
    """The default of field `name` of the config dataclass `config`: how the CLI and other
    configs quote a default without writing the value a second time.

    >>> default_of(CacheConfig, "page_size")
    16
    """
    for f in dataclasses.fields(config):
        if f.name == name:
            assert f.default is not dataclasses.MISSING, f"{config.__name__}.{name} has no default"
            return f.default
    raise AssertionError(f"{config.__name__} has no field {name!r}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache: `num_pages` pages of `page_size` tokens, one layout for all layers."""

    page_size: int = 16
    num_pages: int = 256
    kv_layout: KVLayout = "NHD"
    dtype: torch.dtype = torch.float32  # of the cached values: what every page write moves
    # Who allocates the cache: torch's allocator, or cuMem (CUDA only: exportable to another
    # process by fd and GPUDirect-RDMA capable where the GPU supports it, S5a).
    memory: KVMemory = "torch"
    # Keep full pages after their request ends and reuse them for prompts that start with the
    # same tokens (`engine/prefix_cache.py`); across the split, on both sides.
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        check_kv_layout(self.kv_layout)
        check_choice(self.memory, KV_MEMORIES, "KV memory")
        if self.page_size <= 0:
            raise ConfigError(f"page_size must be positive, got {self.page_size}")
        if self.num_pages <= 0:
            raise ConfigError(f"num_pages must be positive, got {self.num_pages}")
        if self.dtype not in DTYPES.values():
            raise ConfigError(f"KV dtype {self.dtype} is not one of {tuple(DTYPES)}")

    @property
    def num_tokens(self) -> int:
        """Tokens the whole cache can hold."""
        return self.page_size * self.num_pages


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step, tokens per step, prefill chunk size."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    chunk_size: int = 512
    # A prefiller's engine stops each request after its prompt (S2b); every other engine is
    # mixed, decoders included: what arrives by RDMA is just computed tokens (S2c).
    mode: SchedulerMode = "mixed"

    def __post_init__(self) -> None:
        check_scheduler_mode(self.mode)
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError("max_num_batched_tokens must be positive, got "
                              f"{self.max_num_batched_tokens}")
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be positive, got {self.chunk_size}")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How a node shards its KV cache: TP degree over KV heads, or replicated (MLA-style)."""

    tp: int = 1
    replicated_kv: bool = False

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"tp must be >= 1, got {self.tp}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one engine needs: model shape, cache, scheduler, parallelism, device."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32  # of the weights and activations; the KV's is the cache's
    # Pure-decode steps through static buffers, replayed as CUDA graphs on a GPU (S3b); one
    # page of the cache is then kept back for padding rows. Batch buckets, ascending.
    cuda_graph: bool = False
    graph_batch_sizes: tuple[int, ...] = GRAPH_BATCH_SIZES

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES.values():
            raise ConfigError(f"dtype {self.dtype} is not one of {tuple(DTYPES)}")
        sizes = self.graph_batch_sizes
        if not sizes or sizes[0] < 1 or any(a >= b for a, b in pairwise(sizes)):
            raise ConfigError(f"graph_batch_sizes must be positive and strictly ascending, "
                              f"got {sizes}")
        if self.cuda_graph and self.cache.num_pages < 2:
            raise ConfigError(f"cuda_graph needs a padding page besides the requests' pages: "
                              f"num_pages={self.cache.num_pages} is too small")
        if self.cuda_graph and self.parallel.tp > 1:
            # A graph replays one process's kernels; each TP rank would need its own graphs
            # with the all-reduces inside. Not built yet: refuse rather than run eagerly.
            raise ConfigError(f"--cuda-graph runs decode graphs on one process: not with TP "
                              f"{self.parallel.tp}")

    def with_cache(self, **changes: object) -> EngineConfig:
        """A copy with some cache fields changed."""
        return replace(self, cache=replace(self.cache, **changes))


DraftKind = Literal["mtp", "early-exit"]
DRAFT_KINDS: tuple[DraftKind, ...] = ("mtp", "early-exit")


def check_draft_kind(kind: str) -> DraftKind:
    """Return `kind` if it names a draft, else raise `ConfigError` naming it."""
    return check_choice(kind, DRAFT_KINDS, "draft")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Which draft, how many tokens it proposes per step, and its own knobs."""

    kind: DraftKind
    num_draft_tokens: int = 3
    draft_layers: int = 0  # early exit: target layers the draft runs (0: all but the last 2)

    def __post_init__(self) -> None:
        check_draft_kind(self.kind)
        if self.num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.draft_layers < 0:
            raise ConfigError(f"draft_layers must be >= 0, got {self.draft_layers}")

    def exit_layer(self, model: ModelConfig) -> int:
        """Layers the early-exit draft runs: `draft_layers`, or all but the last two (an
        untrained model's middle layers rarely agree with its output: on SmolLM2, 2% of
        drafts after 10 of 30 layers, 23% after 25, 44% after 28)."""
        layers = self.draft_layers or max(1, model.num_layers - 2)
        if layers >= model.num_layers:
            raise ConfigError(f"draft_layers={layers}: the draft must be shallower than the "
                              f"{model.num_layers}-layer target")
        return layers


@dataclass(frozen=True, slots=True)
class ReliabilityConfig:
    """Deadlines and retry policy of a decoder's messenger (X4)."""

    kv_timeout_s: float = 120.0  # from asking a prefiller to the counter firing
    quarantine_timeout_s: float = 10.0  # longest wait for a fence or a cancel answer
    death_grace_s: float = 1.0  # pages of a dead prefiller's requests are held this long
    max_attempts: int = 2  # a timed-out or orphaned request is retried this many times in all
    retry_on_prefiller_failure: bool = True
    verify_kv: bool = True  # compare a checksum of the received KV with the prefiller's

    def __post_init__(self) -> None:
        for name in ("kv_timeout_s", "quarantine_timeout_s", "death_grace_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
