"""Paged attention equals dense reference attention, in both layouts (S3a, S7), on both paths
of a decode: the C kernel that reads pages in place (X8b, where the CPU has it) and the PyTorch
gather-and-SDPA path (every other device, and the kernel's reference)."""

from __future__ import annotations

import pytest
import torch

from disagg.config import CacheConfig, ModelConfig
from disagg.model import attention as attention_module
from disagg.model.attention import (
    AttentionMetadata,
    SequenceSlice,
    paged_attention,
    reference_attention,
)
from disagg.model.kv_cache import PagedKVCache

MODEL = ModelConfig.from_name("tiny")  # 8 query heads, 4 kv heads, head_dim 8
SCALE = MODEL.head_dim ** -0.5


@pytest.fixture(autouse=True, params=["kernel where available", "pytorch"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "pytorch":
        monkeypatch.setattr(attention_module, "takes_kernel", lambda *_: False)
    return request.param


def fill_request(cache: PagedKVCache, page_ids: list[int], k: torch.Tensor,
                 v: torch.Tensor) -> None:
    positions = torch.arange(k.shape[0])
    pages = torch.tensor(page_ids)
    cache.write(0, k, v, pages[positions // cache.page_size], positions % cache.page_size)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize(("context_len", "query_len"), [(0, 7), (5, 6), (9, 1), (0, 1), (12, 3)])
def test_chunk_over_cached_prefix_matches_dense(kv_layout: str, context_len: int,
                                                query_len: int) -> None:
    """A chunk attends causally over its prefix plus itself, exactly like dense attention."""
    torch.manual_seed(0)
    cache = PagedKVCache(MODEL, CacheConfig(page_size=4, num_pages=16, kv_layout=kv_layout))
    total = context_len + query_len
    page_ids = [9, 2, 14, 0, 7][: -(-total // 4)]
    k, v = torch.randn(total, 4, 8), torch.randn(total, 4, 8)
    fill_request(cache, page_ids, k, v)
    q = torch.randn(query_len, 8, 8)
    meta = AttentionMetadata(torch.empty(0), torch.empty(0),
                             [SequenceSlice(0, query_len, context_len, torch.tensor(page_ids))])
    got = paged_attention(q, cache, 0, meta, SCALE)
    torch.testing.assert_close(got, reference_attention(q, k, v, context_len, SCALE))


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_batched_decode_matches_dense_per_request(kv_layout: str) -> None:
    """The padded one-call decode path gives each request its own dense result."""
    torch.manual_seed(1)
    cache = PagedKVCache(MODEL, CacheConfig(page_size=4, num_pages=16, kv_layout=kv_layout))
    kv_lens, pages = [3, 9, 1], [[5], [1, 12, 3], [8]]
    keys = [(torch.randn(n, 4, 8), torch.randn(n, 4, 8)) for n in kv_lens]
    for page_ids, (k, v) in zip(pages, keys, strict=True):
        fill_request(cache, page_ids, k, v)
    q = torch.randn(3, 8, 8)
    table = torch.tensor([[5, 0, 0], [1, 12, 3], [8, 0, 0]])
    sequences = [SequenceSlice(i, 1, n - 1, torch.tensor(p)) for i, (n, p) in
                 enumerate(zip(kv_lens, pages, strict=True))]
    meta = AttentionMetadata(torch.empty(0), torch.empty(0), sequences,
                             decode_page_table=table, decode_kv_lens=torch.tensor(kv_lens))
    got = paged_attention(q, cache, 0, meta, SCALE)
    for i, (n, (k, v)) in enumerate(zip(kv_lens, keys, strict=True)):
        expected = reference_attention(q[i:i + 1], k, v, n - 1, SCALE)
        torch.testing.assert_close(got[i:i + 1], expected)


def test_a_mixed_batch_gives_each_request_its_own_dense_result() -> None:
    """A prefill chunk over a cached prefix beside two decodes, one call: every row as dense
    attention over its own request (the decodes' rows land where their queries were)."""
    torch.manual_seed(4)
    cache = PagedKVCache(MODEL, CacheConfig(page_size=4, num_pages=16))
    requests = [([9, 2], 6, 3), ([14], 3, 1), ([0, 7, 11], 10, 1)]  # pages, kv_len, query_len
    keys = []
    for page_ids, kv_len, _ in requests:
        k, v = torch.randn(kv_len, 4, 8), torch.randn(kv_len, 4, 8)
        fill_request(cache, page_ids, k, v)
        keys.append((k, v))
    q = torch.randn(sum(n for *_, n in requests), 8, 8)
    sequences, start = [], 0
    for page_ids, kv_len, query_len in requests:
        sequences.append(SequenceSlice(start, query_len, kv_len - query_len,
                                       torch.tensor(page_ids)))
        start += query_len
    got = paged_attention(q, cache, 0, AttentionMetadata(torch.empty(0), torch.empty(0),
                                                         sequences), SCALE)
    for seq, (k, v) in zip(sequences, keys, strict=True):
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        torch.testing.assert_close(got[rows], reference_attention(q[rows], k, v,
                                                                  seq.context_len, SCALE))
