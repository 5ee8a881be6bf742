"""The KV checksum of a half-precision cache (S4c, S5): it sums each bf16/fp16 value's 16 bits
as one integer lane, so the lowest bit of any value counts, and a prefiller and a decoder
holding the same bf16 KV (here written by a bf16 model) agree whatever their layouts.
"""

from __future__ import annotations

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.kv_transfer.kv_checksum import kv_checksum
from disagg.model.kv_cache import PagedKVCache
from disagg.model.loading.registry import load_model
from tests.disagg.kv_transfer.test_kv_checksum import NUM_TOKENS, PAGE_IDS, filled

HALVES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "fp16"])
def test_one_unit_in_the_last_place_changes_it(dtype: torch.dtype) -> None:
    """The smallest change a value can take (its lowest mantissa bit) changes the sum."""
    cache = filled("HND", dtype=dtype)
    assert cache.buffer.dtype == dtype
    before = kv_checksum(cache, PAGE_IDS, NUM_TOKENS)
    value = cache.buffer[1, 3, 1, 2, 0]  # layer 1, page 3, V, head 2, token 0
    bits = value.view(torch.int16)
    bits[5] ^= 1
    assert kv_checksum(cache, PAGE_IDS, NUM_TOKENS) != before


@pytest.mark.parametrize("name", ["tiny", "tiny-mla-moe"])
def test_a_bf16_models_kv_checks_alike_in_both_layouts(name: str) -> None:
    """A bf16 engine prefills a prompt (NHD); its pages, copied token by token into an HND
    cache as a decoder would hold them, give the prefiller's checksum, and a float32 copy of
    the same values does not (the bits differ)."""
    loaded = load_model(name)
    cache = CacheConfig(page_size=4, num_pages=16, dtype=torch.bfloat16)
    engine = build_engine(EngineConfig(loaded.config, cache, dtype=torch.bfloat16),
                          loaded.state_dict)
    prompt = list(range(3, 17))
    request = engine.add_request(prompt, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    engine.runner.execute(batch)
    source = engine.kv_cache.shards[0]
    page_ids = list(request.page_ids)
    expected = kv_checksum(source, page_ids, len(prompt))
    assert expected != 0.0
    for dtype in (torch.bfloat16, torch.float32):
        target = copy_into(source, loaded.config, page_ids, len(prompt), "HND", dtype)
        assert (kv_checksum(target, page_ids, len(prompt)) == expected) == (
            dtype == torch.bfloat16)


def copy_into(source: PagedKVCache, model: ModelConfig, page_ids: list[int], num_tokens: int,
              kv_layout: str, dtype: torch.dtype) -> PagedKVCache:
    """A cache of `kv_layout` and `dtype` holding `source`'s first `num_tokens` tokens of
    `page_ids` at the same pages and slots."""
    target = PagedKVCache(model, CacheConfig(page_size=source.page_size,
                                             num_pages=source.num_pages, kv_layout=kv_layout,
                                             dtype=dtype))
    pages = torch.tensor(page_ids)
    positions = torch.arange(num_tokens)
    slot_pages, offsets = pages[positions // source.page_size], positions % source.page_size
    for layer in range(model.num_layers):
        parts = source.gather_parts(layer, pages, num_tokens)  # each [heads, tokens, head_dim]
        if len(parts) == 1:
            target.write_latent(layer, parts[0][0], slot_pages, offsets)
        else:
            k, v = (part.transpose(0, 1) for part in parts)
            target.write(layer, k, v, slot_pages, offsets)
    return target
