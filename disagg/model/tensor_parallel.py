"""Which part of the model one tensor-parallel rank computes, Megatron style (S3c, S6).

Q, K, V, gate and up are column-parallel: rank r computes its block of query heads, the KV
heads `Sharding.heads_of(r)` says it holds, and its slice of the intermediate size. o_proj and
down_proj are row-parallel: each rank multiplies its slice and an all-reduce sums the partial
outputs, so every rank ends each layer with the same full hidden state. Embeddings, norms and
the LM head are replicated: they are small next to the layers, and replicating them keeps the
hidden state whole on every rank with no extra collective (only the leader computes logits).

KV heads follow `Sharding`: a contiguous block per rank, replicated on several ranks when the
model has fewer KV heads than ranks (GQA, MQA), or every head on every rank (the MLA-style
`replicated` cache). With a replicated cache a rank still attends only with the KV heads its
query heads use (`attention_heads`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from disagg.config import ModelConfig
from disagg.errors import ConfigError
from disagg.model.sharding import Sharding

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Cut(NamedTuple):
    """The part of a full weight one rank holds: `[start, stop)` along dimension `dim`.

    Each module says which cuts its weights take (`tp_cuts`), so sharding a state dict and
    reading only a rank's slices from a checkpoint (`model/weight_shards.py`) share one rule.
    """

    dim: int
    start: int
    stop: int

    @staticmethod
    def rows(heads: range, width: int) -> Cut:
        """The rows of heads `heads`, each `width` rows, along dimension 0."""
        return Cut(0, heads.start * width, heads.stop * width)

    def along(self, dim: int) -> Cut:
        """The same range along another dimension (a row-parallel weight's columns)."""
        return Cut(dim, self.start, self.stop)

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full `tensor`, contiguous."""
        return tensor.narrow(self.dim, self.start, self.stop - self.start).contiguous()


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `sharding.tp`; `all_reduce` sums a tensor over the ranks (in place)."""

    rank: int
    sharding: Sharding
    all_reduce: AllReduce = _identity

    @staticmethod
    def single(num_kv_heads: int) -> TPShard:
        """The whole model on one rank."""
        return TPShard(0, Sharding(1, num_kv_heads))

    @property
    def size(self) -> int:
        return self.sharding.tp

    @property
    def is_leader(self) -> bool:
        """Rank 0: the rank that bumps the layer counter and samples (S3c)."""
        return self.rank == 0

    def query_heads(self, config: ModelConfig) -> range:
        """The global query heads this rank computes."""
        per_rank = config.num_heads // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def kv_heads(self) -> range:
        """The global KV heads this rank computes and stores."""
        return self.sharding.heads_of(self.rank)

    def attention_heads(self, config: ModelConfig) -> slice:
        """Which of this rank's stored KV heads its query heads attend with (local indices)."""
        queries = self.query_heads(config)
        group = config.num_queries_per_kv
        first, last = queries.start // group, (queries.stop - 1) // group
        stored = self.kv_heads()
        return slice(first - stored.start, last - stored.start + 1)

    def split(self, size: int, what: str) -> slice:
        """This rank's contiguous share of `size` (an intermediate size, a head count)."""
        if size % self.size:
            raise ConfigError(f"TP {self.size} does not divide the {what} {size}")
        per_rank = size // self.size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)


def check_tp(config: ModelConfig, sharding: Sharding) -> None:
    """Refuse a TP degree the model's shapes cannot be split by, naming the shape."""
    tp = sharding.tp
    if config.num_heads % tp:
        raise ConfigError(f"TP {tp} does not divide model {config.name}'s "
                          f"{config.num_heads} attention heads")
    if config.intermediate_size % tp:
        raise ConfigError(f"TP {tp} does not divide model {config.name}'s intermediate size "
                          f"{config.intermediate_size}")
    # Every expert's intermediate dimension is split like the dense MLP's (`moe.py`).
    if config.moe is not None and config.moe.moe_intermediate_size % tp:
        raise ConfigError(f"TP {tp} does not divide model {config.name}'s "
                          f"moe_intermediate_size {config.moe.moe_intermediate_size}")
    if sharding.num_kv_heads != config.num_kv_heads:
        raise ConfigError(f"sharding for {sharding.num_kv_heads} KV heads, model {config.name} "
                          f"has {config.num_kv_heads}")
