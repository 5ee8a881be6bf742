"""Step 1: the paged KV cache and its two layouts (S7). Runs on a laptop CPU in a second.

Stores a 10-token request in three scattered pages of a tiny model's cache, reads it back in
order, and shows why HND lets a tensor-parallel rank move its heads of a page in one write while
NHD needs one write per token. Pairs with docs/tutorials/01-paged-kv-cache.md.
"""

from __future__ import annotations

import torch

from disagg.config import CacheConfig, ModelConfig
from disagg.engine.page_allocator import PageAllocator
from disagg.model.kv_cache import PagedKVCache


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


if __name__ == "__main__":
    main()
