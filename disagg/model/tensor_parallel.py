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

import torch

from disagg.config import ModelConfig
from disagg.errors import ConfigError
from disagg.model.sharding import Sharding

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


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

    def intermediate(self, config: ModelConfig) -> slice:
        """This rank's slice of the MLP's intermediate size."""
        per_rank = config.intermediate_size // self.size
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
    if sharding.num_kv_heads != config.num_kv_heads:
        raise ConfigError(f"sharding for {sharding.num_kv_heads} KV heads, model {config.name} "
                          f"has {config.num_kv_heads}")


def shard_state_dict(state_dict: dict[str, torch.Tensor], config: ModelConfig,
                     shard: TPShard) -> dict[str, torch.Tensor]:
    """The weights rank `shard.rank` holds (names as in `Transformer.load_weights`)."""
    if shard.size == 1:
        return state_dict
    d = config.head_dim
    queries, kv = shard.query_heads(config), shard.kv_heads()
    q_rows = slice(queries.start * d, queries.stop * d)
    kv_rows = slice(kv.start * d, kv.stop * d)
    inner = shard.intermediate(config)
    cuts: dict[str, tuple[int, slice]] = {  # weight name suffix -> (dim, slice)
        "self_attn.q_proj.weight": (0, q_rows), "self_attn.k_proj.weight": (0, kv_rows),
        "self_attn.v_proj.weight": (0, kv_rows), "self_attn.o_proj.weight": (1, q_rows),
        "mlp.gate_proj.weight": (0, inner), "mlp.up_proj.weight": (0, inner),
        "mlp.down_proj.weight": (1, inner)}
    out = {}
    for name, tensor in state_dict.items():
        cut = next((c for suffix, c in cuts.items() if name.endswith(suffix)), None)
        if cut is None:
            out[name] = tensor
        else:
            dim, part = cut
            out[name] = tensor.narrow(dim, part.start, part.stop - part.start).contiguous()
    return out
