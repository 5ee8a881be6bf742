"""The KV checksum a prefiller packs into the context slot and a decoder recomputes (S4c, S5).

The decoder's guard against a counter that fired early (a duplicated immediate) or over pages
that were corrupted or misplaced: it is computed from the logical values, so both sides agree
whatever their layouts and shardings.
"""

from __future__ import annotations

import torch

from disagg.model.kv_cache import KVCache


def kv_checksum(kv_cache: KVCache, page_ids: list[int], num_tokens: int,
                first_page: int = 0) -> float:
    """A float64 sum of every K/V value of the first `num_tokens` tokens, all layers and heads,
    leaving out the pages before `first_page` (those a decoder held already: prefix caching).

    It depends only on the logical values, not on the layout or the sharding, so a prefiller
    and a decoder holding the same KV compute the same number: the decoder's check that the
    counter did not fire early (a duplicated immediate) or over corrupted pages (issue 8).
    """
    pages = torch.tensor(page_ids[first_page:], dtype=torch.int64, device=kv_cache.device)
    num_tokens -= first_page * kv_cache.page_size
    total = torch.zeros((), dtype=torch.float64, device=kv_cache.device)  # one sync, at the end
    for layer in range(kv_cache.num_layers):
        k, v = kv_cache.gather(layer, pages, num_tokens)
        total += k.contiguous().double().sum() + v.contiguous().double().sum()
    return float(total)
