"""The paged KV cache: FlashInfer's shapes, write/gather round trips, byte geometry (S7)."""

from __future__ import annotations

import pytest
import torch

from disagg.config import CacheConfig, ModelConfig
from disagg.errors import ConfigError
from disagg.model.kv_cache import PagedKVCache

MODEL = ModelConfig.from_name("tiny")  # 4 kv heads, head_dim 8, 2 layers


def make_cache(kv_layout: str, page_size: int = 4, num_pages: int = 6) -> PagedKVCache:
    return PagedKVCache(MODEL, CacheConfig(page_size, num_pages, kv_layout))


@pytest.mark.parametrize(("kv_layout", "k_shape"),
                         [("NHD", (6, 4, 4, 8)), ("HND", (6, 4, 4, 8))])
def test_k_half_has_flashinfer_shape(kv_layout: str, k_shape: tuple[int, ...]) -> None:
    """layer(i)[:, 0] is FlashInfer's K cache in the layout's documented shape."""
    cache = PagedKVCache(MODEL, CacheConfig(page_size=4, num_pages=6, kv_layout=kv_layout))
    assert tuple(cache.layer(0)[:, 0].shape) == k_shape
    assert cache.layer(1).data_ptr() - cache.layer(0).data_ptr() == cache.layer_nbytes


def test_nhd_and_hnd_orders_differ_as_documented() -> None:
    """Token t, head h of page p sits at [p, 0, t, h] in NHD and at [p, 0, h, t] in HND."""
    k = torch.randn(1, 4, 8)
    for kv_layout in ("NHD", "HND"):
        cache = make_cache(kv_layout)
        cache.write(1, k, -k, torch.tensor([2]), torch.tensor([3]))
        stored = cache.layer(1)[2, 0, 3] if kv_layout == "NHD" else cache.layer(1)[2, 0, :, 3]
        assert torch.equal(stored, k[0])


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_write_then_gather_round_trips(kv_layout: str) -> None:
    """Tokens written to scattered pages come back in order from gather."""
    cache = make_cache(kv_layout)
    page_ids = torch.tensor([5, 1, 3])
    num_tokens = 10  # not page-aligned
    positions = torch.arange(num_tokens)
    k, v = torch.randn(num_tokens, 4, 8), torch.randn(num_tokens, 4, 8)
    cache.write(0, k, v, page_ids[positions // 4], positions % 4)
    got_k, got_v = cache.gather(0, page_ids, num_tokens)
    assert torch.equal(got_k, k.transpose(0, 1))
    assert torch.equal(got_v, v.transpose(0, 1))
    assert cache.layer(1).abs().sum() == 0  # other layers untouched


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize(("head_start", "head_end"), [(0, 4), (0, 2), (2, 4), (1, 3), (3, 4)])
def test_page_segments_cover_exactly_the_head_range(kv_layout: str, head_start: int,
                                                    head_end: int) -> None:
    """The byte runs of a head range hold exactly those heads' K and V of that page."""
    cache = make_cache(kv_layout)
    values = torch.arange(cache.buffer.numel(), dtype=torch.float32)
    cache.buffer.copy_(values.view_as(cache.buffer))
    raw = cache.buffer.view(-1).view(torch.uint8)
    segments = cache.page_segments(1, 4, head_start, head_end)
    got = torch.cat([raw[s.offset:s.offset + s.nbytes] for s in segments])
    page = cache.layer(1)[4]  # [2, ...]
    heads = page[:, :, head_start:head_end] if kv_layout == "NHD" else page[:, head_start:head_end]
    assert torch.equal(got.view(torch.float32), heads.reshape(-1))


@pytest.mark.parametrize(("kv_layout", "expected"), [("NHD", 8), ("HND", 2)])
def test_head_slice_write_counts(kv_layout: str, expected: int) -> None:
    """Half the heads of a 4-token page: 2 runs in HND, 2 x 4 tokens in NHD (the S7 lesson)."""
    cache = make_cache(kv_layout)
    assert len(cache.page_segments(0, 0, 0, 2)) == expected
    assert cache.is_contiguous(0, 2) == (kv_layout == "HND")
    assert len(cache.page_segments(0, 0)) == 1
    assert cache.is_contiguous()


def test_page_offset_rejects_bad_ids() -> None:
    """A wrong page id or layer is an error naming it, never a silent wrong offset."""
    cache = make_cache("NHD")
    with pytest.raises(IndexError, match="page id 6"):
        cache.page_offset(0, 6)
    with pytest.raises(IndexError, match="layer 2"):
        cache.page_offset(2, 0)
    with pytest.raises(ValueError, match="head range"):
        cache.page_segments(0, 0, 3, 3)


def test_cumem_memory_is_refused_off_cuda() -> None:
    """cuMem is CUDA memory: asking for it on a CPU cache is a clear ConfigError."""
    with pytest.raises(ConfigError, match="'cumem' is CUDA memory"):
        PagedKVCache(MODEL, CacheConfig(page_size=4, num_pages=8, memory="cumem"))


def test_unknown_kv_memory_is_refused() -> None:
    """A typo in the allocator's name fails where it is written."""
    with pytest.raises(ConfigError, match="unknown KV memory 'cumme'"):
        CacheConfig(memory="cumme")  # type: ignore[arg-type]


@pytest.mark.gpu_only
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_cumem_cache_round_trips(kv_layout: str) -> None:
    """A cuMem-backed cache stores and gathers like any other."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: cuMem needs one")
    from transfer_core.cuda.driver import cuda_available

    if not cuda_available():
        pytest.skip("cuda-python cannot reach the GPU")
    cache = PagedKVCache(MODEL, CacheConfig(page_size=4, num_pages=8, kv_layout=kv_layout,
                                            memory="cumem"), "cuda")
    assert not cache.buffer.any()
    k = torch.randn(6, MODEL.num_kv_heads, MODEL.head_dim, device="cuda")
    pages = torch.tensor([3, 3, 3, 3, 5, 5], device="cuda")
    offsets = torch.tensor([0, 1, 2, 3, 0, 1], device="cuda")
    cache.write(1, k, -k, pages, offsets)
    got_k, got_v = cache.gather(1, torch.tensor([3, 5], device="cuda"), 6)
    assert torch.equal(got_k, k.transpose(0, 1))
    assert torch.equal(got_v, -k.transpose(0, 1))


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_copy_page_equals_a_manual_copy_of_every_layer_k_and_v(kv_layout: str) -> None:
    """copy_page(2, 5) makes page 5 of each layer's K and V page 2's; nothing else moves."""
    cache = make_cache(kv_layout, page_size=3)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=torch.Generator().manual_seed(0)))
    want = cache.buffer.clone()
    for layer in range(MODEL.num_layers):
        for half in (0, 1):
            want[layer, 5, half] = want[layer, 2, half]
    cache.copy_page(2, 5)
    assert torch.equal(cache.buffer, want)


def test_copy_page_refuses_a_bad_page() -> None:
    """A page id past the cache, or a copy onto itself, raises before anything is written."""
    cache = make_cache("NHD")
    with pytest.raises(IndexError, match="page id 6 out of range"):
        cache.copy_page(1, 6)
    with pytest.raises(ValueError, match="onto itself"):
        cache.copy_page(1, 1)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_gathers_reuse_the_caches_buffers(kv_layout: str) -> None:
    """Every layer's gather lands in the same memory (no fresh, page-faulting allocation per
    layer and step), and still holds exactly the pages asked for; a padded batch with more
    pages than the cache has gets its own tensor, as right."""
    cache = make_cache(kv_layout)
    cache.buffer.copy_(torch.randn_like(cache.buffer))
    table = torch.tensor([[3, 1], [0, 5]])
    k0, _ = cache.gather_batch(0, table)
    pointer = k0.data_ptr()
    k1, v1 = cache.gather_batch(1, table)
    assert k1.data_ptr() == pointer  # layer 0's result is gone: it was used already
    expected = cache.layer(1)[table.reshape(-1)]  # [4 pages, 2, ...page dims]
    for part, got in enumerate((k1, v1)):
        pages = expected[:, part]
        tokens = pages if kv_layout == "NHD" else pages.transpose(1, 2)  # [p, slots, heads, d]
        assert torch.equal(got, tokens.reshape(2, -1, *tokens.shape[2:]).transpose(1, 2))
    padded = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0]])  # 8 entries > 6 pages
    k, _ = cache.gather_batch(0, padded)
    assert torch.equal(k[1, :, :4], cache.gather_batch(0, padded[1:, :1])[0][0])


def test_each_thread_gathers_into_buffers_of_its_own() -> None:
    """A second thread's gather (a checker beside the engine) never overwrites what the
    engine thread gathered."""
    import threading

    cache = make_cache("NHD")
    cache.buffer.copy_(torch.randn_like(cache.buffer))
    mine, _ = cache.gather_batch(0, torch.tensor([[1, 2]]))
    before = mine.clone()
    other = threading.Thread(target=lambda: cache.gather_batch(1, torch.tensor([[4, 5]])))
    other.start()
    other.join()
    assert torch.equal(mine, before)
