"""Step 1: the paged KV cache and its two layouts (S7). Runs on a laptop CPU in a second.

Stores a 10-token request in three scattered pages of a tiny model's cache, reads it back in
order, and shows why HND lets a tensor-parallel rank move its heads of a page in one write while
NHD needs one write per token. Then forks one prompt into n = 3 streams that share its pages
(X6c). Pairs with docs/tutorials/01-paged-kv-cache.md.
"""

from __future__ import annotations

import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.page_allocator import PageAllocator
from disagg.engine.request import SamplingParams
from disagg.model.kv_cache import PagedKVCache
from disagg.model.loading.registry import init_random_weights


def main() -> None:
    model = ModelConfig.from_name("tiny")  # 2 layers, 4 KV heads of 8 dims
    torch.manual_seed(0)
    num_tokens, page_size = 10, 4
    k = torch.randn(num_tokens, model.num_kv_heads, model.head_dim)
    v = torch.randn(num_tokens, model.num_kv_heads, model.head_dim)

    for kv_layout in ("NHD", "HND"):
        cache = PagedKVCache(model, CacheConfig(page_size=page_size, num_pages=8,
                                                kv_layout=kv_layout))
        allocator = PageAllocator(cache.num_pages)
        allocator.allocate(2)  # someone else holds pages 0 and 1
        page_ids = allocator.allocate(-(-num_tokens // page_size))  # 3 pages for 10 tokens

        # Token t lives in page page_ids[t // page_size], slot t % page_size.
        positions = torch.arange(num_tokens)
        pages = torch.tensor(page_ids)
        cache.write(0, k, v, pages[positions // page_size], positions % page_size)
        got_k, _ = cache.gather(0, pages, num_tokens)  # [kv_heads, tokens, dim]
        assert torch.equal(got_k, k.transpose(0, 1))

        print(f"{kv_layout}: layer shape {tuple(cache.layer(0).shape)}, "
              f"request pages {page_ids}, page = {cache.page_nbytes} bytes")
        # A TP=2 rank owns heads 0-1 of every page: how many contiguous runs is that?
        runs = cache.page_segments(0, page_ids[0], head_start=0, head_end=2)
        print(f"  heads 0-1 of one page: {len(runs)} runs of {runs[0].nbytes} bytes")
        allocator.free(page_ids)
    forks()


def forks() -> None:
    """n = 3 answers to one 14-token prompt: computed once, then three forks that share its
    full pages (a reference each) and each own a copy of the partly filled last one."""
    model = ModelConfig.from_name("tiny")
    engine = build_engine(EngineConfig(model, CacheConfig(page_size=4, num_pages=64),
                                       SchedulerConfig(chunk_size=16, max_num_batched_tokens=16)),
                          init_random_weights(model))
    parent = engine.add_request(list(range(3, 17)),
                                SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=0))
    while not parent.forks:
        engine.step()
    for fork in parent.forks:
        refs = [engine.allocator.refcount(page) for page in fork.page_ids]
        print(f"{fork.request_id}: pages {fork.page_ids}, references {refs}")
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_used == 0  # every fork let go of every page


if __name__ == "__main__":
    main()
