"""Who holds which KV heads: tensor-parallel sharding, head replication, replica sets (S6, S9a).

With TP degree `tp` the KV cache is split by KV head. When the model has at least `tp` KV heads,
rank r holds a contiguous block of `num_kv_heads / tp` heads. When it has fewer, each head is
replicated on `tp / num_kv_heads` consecutive ranks, as real engines do. With `replicated` KV
(MLA's latent cache, DeepSeek-R1) every rank holds every head. A *replica set* is a set of
ranks that together hold every head exactly once; any one of them can serve a destination (S6c).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.errors import ConfigError
from disagg.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class Sharding:
    """How one node spreads `num_kv_heads` KV heads over `tp` ranks.

    >>> Sharding(tp=4, num_kv_heads=2).heads_of(3)  # heads replicated on pairs of ranks
    range(1, 2)
    >>> Sharding(tp=4, num_kv_heads=2).replica_sets()
    [[0, 2], [1, 3]]
    """

    tp: int
    num_kv_heads: int
    replicated: bool = False

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"tp must be >= 1, got {self.tp}")
        if self.replicated:
            return
        big, small = max(self.tp, self.num_kv_heads), min(self.tp, self.num_kv_heads)
        if big % small:
            raise ConfigError(f"tp={self.tp} and num_kv_heads={self.num_kv_heads}: one must "
                              "divide the other to shard KV heads evenly")

    @staticmethod
    def of_model(model: ModelConfig, tp: int, replicated: bool = False) -> Sharding:
        """How `model`'s cache spreads over `tp` ranks. An MLA model's latent row is computed
        whole on every rank, so its cache is replicated by construction, whatever was asked;
        `replicated` replicates a GQA cache too (an experiment, not a real deployment)."""
        return Sharding(tp, model.num_kv_heads, replicated or model.mla is not None)

    @property
    def heads_per_rank(self) -> int:
        """KV heads each rank holds."""
        if self.replicated:
            return self.num_kv_heads
        return max(1, self.num_kv_heads // self.tp)

    def heads_of(self, rank: int) -> range:
        """Global KV heads held by `rank`, in the order they sit in its pages."""
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} outside [0, {self.tp})")
        if self.replicated:
            return range(self.num_kv_heads)
        if self.num_kv_heads >= self.tp:
            n = self.num_kv_heads // self.tp
            return range(rank * n, (rank + 1) * n)
        copies = self.tp // self.num_kv_heads
        return range(rank // copies, rank // copies + 1)

    def replica_sets(self) -> list[list[int]]:
        """Disjoint sets of ranks, each holding every head exactly once."""
        if self.replicated:
            return [[rank] for rank in range(self.tp)]
        if self.num_kv_heads >= self.tp:
            return [list(range(self.tp))]
        copies = self.tp // self.num_kv_heads
        return [list(range(j, self.tp, copies)) for j in range(copies)]

    def owner_in(self, replica_set: list[int], head: int) -> int:
        """The rank of `replica_set` that holds `head`."""
        for rank in replica_set:
            if head in self.heads_of(rank):
                return rank
        raise ValueError(f"replica set {replica_set} does not hold head {head}")

    def primary_owners(self) -> list[tuple[int, int]]:
        """For each head in order, (rank, index within that rank's heads) of its first holder."""
        first_set = self.replica_sets()[0]
        owners = []
        for head in range(self.num_kv_heads):
            rank = self.owner_in(first_set, head)
            owners.append((rank, self.heads_of(rank).index(head)))
        return owners
