"""The leader's view of every rank's KV reads back exactly what an unsharded cache holds (S5a,
S6). The shards here are plain caches in this process; `tests/disagg/parallel` maps real
ranks' memory."""

from __future__ import annotations

import pytest
import torch

from disagg.config import CacheConfig, ModelConfig
from disagg.model.kv_cache import PagedKVCache
from disagg.model.sharded_kv_cache import ShardedKVCache, shard_config
from disagg.model.sharding import Sharding

MODEL = ModelConfig.from_name("tiny")  # 4 kv heads


def filled_pair(sharding: Sharding, kv_layout: str) -> tuple[ShardedKVCache, PagedKVCache]:
    """The same 10 tokens written into pages 5, 1, 3 of a sharded and a plain cache."""
    cache = CacheConfig(page_size=4, num_pages=8, kv_layout=kv_layout)
    shards = [PagedKVCache(shard_config(MODEL, sharding), cache) for _ in range(sharding.tp)]
    sharded, plain = ShardedKVCache(MODEL, cache, sharding, shards), PagedKVCache(MODEL, cache)
    positions = torch.arange(10)
    page_ids = torch.tensor([5, 1, 3])[positions // 4]
    generator = torch.Generator().manual_seed(0)
    for layer in range(MODEL.num_layers):
        k, v = (torch.randn(10, 4, 8, generator=generator) for _ in range(2))
        for target in (sharded, plain):
            target.write(layer, k, v, page_ids, positions % 4)
    return sharded, plain


SHARDINGS = [Sharding(2, 4), Sharding(4, 4), Sharding(8, 4), Sharding(2, 4, replicated=True)]


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("sharding", SHARDINGS, ids=lambda s: f"tp{s.tp}-{s.replicated}")
def test_gather_equals_the_unsharded_cache(sharding: Sharding, kv_layout: str) -> None:
    """One request's first 10 tokens, every head, from whichever rank holds it."""
    sharded, plain = filled_pair(sharding, kv_layout)
    pages = torch.tensor([5, 1, 3])
    for layer in range(MODEL.num_layers):
        for got, want in zip(sharded.gather(layer, pages, 10), plain.gather(layer, pages, 10),
                             strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("sharding", SHARDINGS, ids=lambda s: f"tp{s.tp}-{s.replicated}")
def test_gather_batch_equals_the_unsharded_cache(sharding: Sharding, kv_layout: str) -> None:
    """A padded two-request page table gives the same K and V as the plain cache."""
    sharded, plain = filled_pair(sharding, kv_layout)
    table = torch.tensor([[5, 1, 3], [3, 0, 0]])
    for got, want in zip(sharded.gather_batch(1, table), plain.gather_batch(1, table),
                         strict=True):
        assert got.shape == (2, 4, 12, 8)
        assert torch.equal(got, want)


def test_shards_of_the_wrong_head_count_are_refused() -> None:
    """Each rank's shard must hold the sharding's heads per rank."""
    cache = CacheConfig(page_size=4, num_pages=8)
    whole = [PagedKVCache(MODEL, cache) for _ in range(2)]  # 4 heads each, not 2
    with pytest.raises(ValueError, match="each must hold 2 heads"):
        ShardedKVCache(MODEL, cache, Sharding(2, 4), whole)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("sharding", SHARDINGS, ids=lambda s: f"tp{s.tp}-{s.replicated}")
def test_copy_page_copies_every_shard(sharding: Sharding, kv_layout: str) -> None:
    """Page 6 copied from page 1 through the sharded view reads back, every head of every
    layer, K and V, as page 1 of the plain cache."""
    sharded, plain = filled_pair(sharding, kv_layout)
    sharded.copy_page(1, 6)
    for layer in range(MODEL.num_layers):
        for got, want in zip(sharded.gather(layer, torch.tensor([6]), 4),
                             plain.gather(layer, torch.tensor([1]), 4), strict=True):
            assert torch.equal(got, want)


def test_copy_page_with_rank_processes_leaves_their_shards_to_them() -> None:
    """With `copy_remote` the view copies only rank 0's shard and hands the page to the ranks."""
    sharded, _ = filled_pair(Sharding(2, 4), "HND")
    sent: list[tuple[int, int]] = []
    remote = ShardedKVCache(MODEL, CacheConfig(page_size=4, num_pages=8, kv_layout="HND"),
                            Sharding(2, 4), sharded.shards,
                            copy_remote=lambda src, dst: sent.append((src, dst)))
    remote.copy_page(1, 6)
    first, second = remote.shards
    assert torch.equal(first.buffer[:, 6], first.buffer[:, 1])
    assert not second.buffer[:, 6].any()
    assert sent == [(1, 6)]
