"""The leader's view of a KV cache split by head over tensor-parallel ranks (S5a, S6).

Each rank process allocates its own shard as shareable memory and the leader maps it
(`disagg/parallel/`): a memfd on CPU, a cuMem allocation on CUDA. So one process holds every
rank's region, registers each with its one transfer engine and posts every rank's page writes.
The model never runs through this view (each rank runs over its own shard); the transfer side
reads it: `shards` to register, plan and checksum (every rank's copy, `kv_checksum.py`), `gather`
for every head from its first holder. Page ids are shared by all ranks (the leader's one
allocator). A fork's page copy (`copy_page`) is the one change the leader does not make through
its mapping: each rank copies its own shard, in order with its forward steps (`copy_remote`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from disagg.config import CacheConfig, ModelConfig
from disagg.model.kv_cache import PagedKVCache
from disagg.model.sharding import Sharding


class ShardedKVCache:
    """`tp` per-rank paged caches behaving, to the model, like one cache of every head."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, sharding: Sharding,
                 shards: list[PagedKVCache],
                 copy_remote: Callable[[int, int], None] | None = None) -> None:
        if sharding.num_kv_heads != model.num_kv_heads:
            raise ValueError(f"sharding for {sharding.num_kv_heads} heads, model has "
                             f"{model.num_kv_heads}")
        if len(shards) != sharding.tp or any(s.num_kv_heads != sharding.heads_per_rank
                                             for s in shards):
            raise ValueError(f"{len(shards)} shards for TP {sharding.tp}: each must hold "
                             f"{sharding.heads_per_rank} heads")
        self.sharding = sharding
        self.num_layers = model.num_layers
        self.kv_parts = model.kv_parts
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.page_size = cache.page_size
        self.num_pages = cache.num_pages
        self.kv_layout = cache.kv_layout
        self._shards = list(shards)
        self._heads = [sharding.heads_of(rank) for rank in range(sharding.tp)]
        self._owners = sharding.primary_owners()
        # Tells ranks 1..tp-1 to copy a page in their own shards (`TPRanks.copy_page`); None
        # when this process holds every shard's only writer (one process, or a test).
        self._copy_remote = copy_remote

    @property
    def shards(self) -> list[PagedKVCache]:
        """One cache per rank, holding that rank's heads."""
        return self._shards

    @property
    def device(self) -> torch.device:
        """Where the shards live."""
        return self._shards[0].device

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the cache."""
        return self._shards[0].dtype

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
              page_ids: torch.Tensor, page_offsets: torch.Tensor) -> None:
        """Store each rank's heads of the new tokens' K/V (``[num_tokens, heads, dim]``): what
        the ranks' own forwards do, for tests and tools that fill a cache from outside."""
        for shard, heads in zip(self._shards, self._heads, strict=True):
            rows = slice(heads.start, heads.stop)
            shard.write(layer_idx, k[:, rows], v[:, rows], page_ids, page_offsets)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page `src` into page `dst` in every rank's shard (all layers, K and V).

        Rank 0's shard is the leader's own; with rank processes the others copy theirs when
        `copy_remote` reaches them, after the steps sent before it and before those sent
        after: a copy through the leader's mapping would be ordered with neither on a GPU.
        """
        remote = self._copy_remote is not None
        for shard in self._shards[:1] if remote else self._shards:
            shard.copy_page(src, dst)
        if self._copy_remote is not None:
            self._copy_remote(src, dst)

    def gather(self, layer_idx: int, page_ids: torch.Tensor, num_tokens: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """All heads of the first `num_tokens` tokens: ``[num_kv_heads, num_tokens, dim]``."""
        parts = [shard.gather(layer_idx, page_ids, num_tokens) for shard in self._shards]
        k = torch.stack([parts[rank][0][index] for rank, index in self._owners])
        v = torch.stack([parts[rank][1][index] for rank, index in self._owners])
        return k, v

    def write_latent(self, layer_idx: int, latent: torch.Tensor, page_ids: torch.Tensor,
                     page_offsets: torch.Tensor) -> None:
        """Store the latent rows in every rank's copy (MLA: every rank holds the same rows)."""
        for shard in self._shards:
            shard.write_latent(layer_idx, latent, page_ids, page_offsets)

    def gather_latent(self, layer_idx: int, page_ids: torch.Tensor, num_tokens: int
                      ) -> torch.Tensor:
        """The latent rows from rank 0's copy: ``[num_tokens, dim]``."""
        return self._shards[0].gather_latent(layer_idx, page_ids, num_tokens)

    def gather_latent_batch(self, layer_idx: int, page_table: torch.Tensor) -> torch.Tensor:
        """Every request's latent rows from rank 0's copy."""
        return self._shards[0].gather_latent_batch(layer_idx, page_table)

    def gather_batch(self, layer_idx: int, page_table: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V, each ``[num_seqs, num_kv_heads, max_kv, dim]``, from every rank's heads."""
        parts = [shard.gather_batch(layer_idx, page_table) for shard in self._shards]
        k = torch.stack([parts[rank][0][:, index] for rank, index in self._owners], dim=1)
        v = torch.stack([parts[rank][1][:, index] for rank, index in self._owners], dim=1)
        return k, v


def shard_config(model: ModelConfig, sharding: Sharding) -> ModelConfig:
    """The shape one rank's shard has: its KV heads (the cache needs nothing else)."""
    local = sharding.heads_per_rank
    return replace(model, num_kv_heads=local, num_heads=local)
