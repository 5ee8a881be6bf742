"""The KV checksum sees where each value sits, agrees across layouts and shardings, and a
decoder's check reads every rank's copy (S4c, S5, S6)."""

from __future__ import annotations

import math

import pytest
import torch

from disagg.config import CacheConfig, ModelConfig
from disagg.kv_transfer.kv_checksum import (
    MASK,
    ReplicaSums,
    agreed,
    kv_checksum,
    replica_sums,
)
from disagg.model import cpu_kernels
from disagg.model.kv_cache import PagedKVCache
from disagg.model.sharded_kv_cache import ShardedKVCache, shard_config
from disagg.model.sharding import Sharding

MODEL = ModelConfig.from_name("tiny")  # 4 kv heads
PAGE_IDS = [5, 1, 3, 6]
NUM_TOKENS = 14  # the last page part-filled


def filled(kv_layout: str = "NHD", sharding: Sharding | None = None, dtype: torch.dtype =
           torch.float32) -> PagedKVCache | ShardedKVCache:
    """The same 14 tokens (seed 0) written into pages 5, 1, 3, 6 of a plain or sharded cache."""
    cache = CacheConfig(page_size=4, num_pages=8, kv_layout=kv_layout, dtype=dtype)
    if sharding is None:
        target: PagedKVCache | ShardedKVCache = PagedKVCache(MODEL, cache)
    else:
        shards = [PagedKVCache(shard_config(MODEL, sharding), cache) for _ in range(sharding.tp)]
        target = ShardedKVCache(MODEL, cache, sharding, shards)
    positions = torch.arange(NUM_TOKENS)
    page_ids = torch.tensor(PAGE_IDS)[positions // 4]
    generator = torch.Generator().manual_seed(0)
    for layer in range(MODEL.num_layers):
        k, v = (torch.randn(NUM_TOKENS, 4, 8, generator=generator).to(dtype) for _ in range(2))
        target.write(layer, k, v, page_ids, positions % 4)
    return target


def checksum(cache: PagedKVCache | ShardedKVCache, first_page: int = 0) -> float:
    return kv_checksum(cache, PAGE_IDS, NUM_TOKENS, first_page)


def swap_(a: torch.Tensor, b: torch.Tensor) -> None:
    saved = a.clone()
    a.copy_(b)
    b.copy_(saved)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_swapped_pages_change_it(kv_layout: str) -> None:
    """Pages 1 and 3 of layer 1 trade places: same values, other places, other checksum."""
    cache = filled(kv_layout)
    before = checksum(cache)
    swap_(cache.buffer[1, 1], cache.buffer[1, 3])
    assert checksum(cache) != before


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_swapped_tokens_within_a_page_change_it(kv_layout: str) -> None:
    """Tokens 0 and 2 of page 5's K (every head) trade places."""
    cache = filled(kv_layout)
    before = checksum(cache)
    k = cache.buffer[0, 5, 0]  # [page_size, heads, dim] (NHD) or [heads, page_size, dim] (HND)
    tokens = (k[0], k[2]) if kv_layout == "NHD" else (k[:, 0], k[:, 2])
    swap_(*tokens)
    assert checksum(cache) != before


def test_swapped_heads_and_swapped_k_and_v_change_it() -> None:
    cache = filled("HND")
    before = checksum(cache)
    swap_(cache.buffer[0, 1, 0, 0], cache.buffer[0, 1, 0, 2])  # heads 0 and 2 of page 1's K
    assert checksum(cache) != before
    cache = filled("HND")
    swap_(cache.buffer[0, 1, 0], cache.buffer[0, 1, 1])  # page 1's K and V
    assert checksum(cache) != before


SHARDINGS = [None, Sharding(2, 4), Sharding(8, 4), Sharding(2, 4, replicated=True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first_page", [0, 2])
def test_every_layout_and_sharding_gives_the_same_value(first_page: int, dtype: torch.dtype,
                                                        ) -> None:
    """NHD and HND, TP 1, 2, 8 (heads replicated over pairs) and replicated KV: the same
    logical KV gives bit-identical checksums, with or without a held prefix."""
    values = {(kv_layout, str(sharding)): checksum(filled(kv_layout, sharding, dtype), first_page)
              for kv_layout in ("NHD", "HND") for sharding in SHARDINGS}
    assert len(set(values.values())) == 1, values
    assert next(iter(values.values())) != 0.0
    assert checksum(filled(), 1) != checksum(filled(), 2)  # a held page is left out


def test_it_does_not_depend_on_the_thread_count(several_threads: int) -> None:
    """Integer sums: one thread or several, the same bits (float sums split by thread)."""
    cache = filled("HND")
    try:
        torch.set_num_threads(1)
        one = checksum(cache)
    finally:
        torch.set_num_threads(several_threads)
    assert checksum(cache) == one


@pytest.mark.parametrize("sharding", [Sharding(8, 4), Sharding(2, 4, replicated=True)],
                         ids=["heads-on-pairs", "replicated"])
def test_a_corrupted_replica_on_one_rank_fails_the_decoders_check(sharding: Sharding) -> None:
    """One value of the last rank's copy changes: the prefiller's one-copy checksum cannot see
    it, the decoder's check of every copy can (NaN matches no prefiller's checksum)."""
    cache = filled("NHD", sharding)
    assert isinstance(cache, ShardedKVCache)
    intact = agreed(cache, replica_sums(cache, PAGE_IDS, NUM_TOKENS))
    assert intact == checksum(cache) == checksum(filled())
    assert len(set(replica_sums(cache, PAGE_IDS, NUM_TOKENS))) == 1
    cache.shards[-1].buffer[1, 3, 0, 2, 0, 5] += 1.0
    assert checksum(cache) == intact  # the first replica set is untouched
    assert len(set(replica_sums(cache, PAGE_IDS, NUM_TOKENS))) == 2
    assert math.isnan(agreed(cache, replica_sums(cache, PAGE_IDS, NUM_TOKENS)))


@pytest.mark.parametrize("kernels", [True, False], ids=["in-place", "pytorch"])
@pytest.mark.parametrize("sharding", [None, Sharding(8, 4), Sharding(2, 4, replicated=True)],
                         ids=["one-rank", "heads-on-pairs", "replicated"])
def test_layer_ranges_add_up_to_the_checksum_of_every_copy(
        sharding: Sharding | None, kernels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder's sums of the body (layers before the last) and of the last layer, per
    replica set, in place or in PyTorch, add up to each set's checksum (held first page left
    out), a copy changed in its last layer included; no layers sum to zero."""
    monkeypatch.setattr(cpu_kernels, "ENABLED", kernels and cpu_kernels.ENABLED)
    cache = filled("HND", sharding)
    last_rank = cache.shards[-1] if isinstance(cache, ShardedKVCache) else cache
    last_rank.buffer[-1, 3, 0, 0, 2, 5] += 1.0  # the last copy's last layer, page 3
    sums = ReplicaSums(cache, PAGE_IDS, NUM_TOKENS, first_page=1)
    body, last = range(MODEL.num_layers - 1), range(MODEL.num_layers - 1, MODEL.num_layers)
    added = [(b + t) & MASK for b, t in zip(sums.over(body), sums.over(last), strict=True)]
    whole = replica_sums(cache, PAGE_IDS, NUM_TOKENS, first_page=1)
    assert added == whole and whole[0] == int(checksum(cache, first_page=1))
    assert len(set(whole)) == len(cache.sharding.replica_sets())  # the last set differs
    assert sums.over(range(0)) == [0] * len(whole)
