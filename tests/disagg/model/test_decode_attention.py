"""The paged decode-attention kernel against dense attention over the same keys (X8b, S7)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from disagg.config import CacheConfig, ModelConfig
from disagg.errors import KernelError
from disagg.model import attention as attention_module
from disagg.model.attention import (
    AttentionMetadata,
    SequenceSlice,
    paged_attention,
    reference_attention,
)
from disagg.model.cpu_kernels import AVX512, lib
from disagg.model.decode_attention import decode_attention, takes_kernel
from disagg.model.kv_cache import PagedKVCache

# The kernel splits sequences and keys over torch's threads: test it with several (four),
# whatever share of the cores xdist left this worker.
pytestmark = [pytest.mark.skipif(not AVX512, reason="no AVX-512 (or the kernels are not built)"),
              pytest.mark.usefixtures("several_threads")]

TINY = ModelConfig.from_name("tiny")


def model(kv_heads: int, group: int, head_dim: int) -> ModelConfig:
    return dataclasses.replace(TINY, num_kv_heads=kv_heads, num_heads=kv_heads * group,
                               head_dim=head_dim, hidden_size=kv_heads * group * head_dim)


def random_cache(config: ModelConfig, layout: str, page_size: int, dtype: torch.dtype,
                 num_pages: int = 24) -> PagedKVCache:
    cache = PagedKVCache(config, CacheConfig(page_size=page_size, num_pages=num_pages,
                                             kv_layout=layout, dtype=dtype))
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=torch.Generator()
                                   .manual_seed(7)).to(dtype))
    return cache


def dense(q: torch.Tensor, cache: PagedKVCache, layer: int, pages: list[int], kv_len: int,
          scale: float) -> torch.Tensor:
    """Dense attention of one token over what the cache holds for `pages`, in float64."""
    k, v = cache.gather(layer, torch.tensor(pages), kv_len)  # [heads, kv_len, dim]
    out = reference_attention(q.double()[None], k.transpose(0, 1).double(),
                              v.transpose(0, 1).double(), kv_len - 1, scale)
    return out[0]


CASES = [  # (kv heads, group, head_dim, page size)
    (3, 3, 64, 16),  # SmolLM2's attention
    (4, 2, 8, 4),  # tiny
    (1, 8, 40, 1),  # MQA, a head_dim with a tail, one token a page
    (2, 1, 128, 5),  # MHA
    (2, 4, 96, 16),  # 4 heads a group: value sweeps of 4 heads by 2 column blocks
    (1, 7, 80, 16),  # 7 heads of 5 column blocks: tiles of 4, 2 and 1 heads, 4 and 1 blocks
    (2, 3, 32, 3),  # 3 heads of 2 column blocks: tiles of 2 and 1 heads by 2 blocks
]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_len", [130, 333, 600])
def test_a_lone_sequence_split_over_the_threads_gets_dense_attention(
        layout: str, dtype: torch.dtype, kv_len: int) -> None:
    """One sequence of 3 KV heads on 4 threads: each head's keys are split into parts (none
    under 64 keys) and joined again; the parts' peaks differ, so a join that forgets to rescale
    them is off by far more than the tolerance. A score scale of 1 spreads the peaks."""
    config = model(3, 3, 64)
    cache = random_cache(config, layout, 16, dtype, num_pages=40)
    pages = list(range(39, 39 - (kv_len + 15) // 16, -1))  # scattered, in reverse
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 9, 64, generator=g).to(dtype)
    assert torch.get_num_threads() == 4  # several_threads, for the whole module
    got = decode_attention(q, cache, 1, torch.tensor([pages]), torch.tensor([kv_len]), 1.0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[0].double(), dense(q[0], cache, 1, pages, kv_len, 1.0),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim", "page_size"), CASES)
def test_each_sequence_gets_dense_attention_over_its_pages(
        layout: str, dtype: torch.dtype, kv_heads: int, group: int, head_dim: int,
        page_size: int) -> None:
    config = model(kv_heads, group, head_dim)
    cache = random_cache(config, layout, page_size, dtype)
    # Scattered pages, lengths ending mid-page, a one-token sequence, a padded row.
    pages = [[17, 2, 9], [4], [11, 0, 23, 5]]
    kv_lens = [2 * page_size + 1, 1, 4 * page_size]
    table = torch.tensor([p + [0] * (4 - len(p)) for p in pages])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, kv_heads * group, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    got = decode_attention(q, cache, 1, table, torch.tensor(kv_lens), scale)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for b in range(3):
        torch.testing.assert_close(got[b].double(), dense(q[b], cache, 1, pages[b], kv_lens[b],
                                                          scale), rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_tp_rank_uses_only_its_heads_of_a_replicated_cache(layout: str) -> None:
    config = model(4, 2, 16)
    cache = random_cache(config, layout, 4, torch.float32)
    q = torch.randn(1, 4, 16)  # 2 KV heads' worth of queries: cache heads 2 and 3
    got = decode_attention(q, cache, 0, torch.tensor([[3, 8]]), torch.tensor([6]), 0.25,
                           kv_heads=slice(2, 4))
    k, v = cache.gather(0, torch.tensor([3, 8]), 6)  # [all 4 heads, 6, 16]
    want = reference_attention(q[0].double()[None], k[2:4].transpose(0, 1).double(),
                               v[2:4].transpose(0, 1).double(), 5, 0.25)[0]
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)


def test_a_page_id_outside_the_cache_is_refused_not_read() -> None:
    cache = random_cache(TINY, "NHD", 4, torch.float32)
    q = torch.randn(1, TINY.num_heads, TINY.head_dim)
    with pytest.raises(KernelError, match="page id outside the cache"):
        decode_attention(q, cache, 0, torch.tensor([[1, cache.num_pages]]), torch.tensor([6]),
                         0.5)
    with pytest.raises(KernelError, match="page id outside the cache"):
        decode_attention(q, cache, 0, torch.tensor([[-1]]), torch.tensor([2]), 0.5)


def test_a_length_beyond_the_page_table_is_refused() -> None:
    cache = random_cache(TINY, "HND", 4, torch.float32)
    q = torch.randn(1, TINY.num_heads, TINY.head_dim)
    with pytest.raises(KernelError, match="length outside its page table"):
        decode_attention(q, cache, 0, torch.tensor([[1, 2]]), torch.tensor([9]), 0.5)


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.float16, torch.float16),
                                                   (torch.float32, torch.bfloat16)])
def test_other_dtypes_take_the_pytorch_path(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    cache = random_cache(TINY, "NHD", 4, kv_dtype)
    assert not takes_kernel(torch.randn(1, 8, 8).to(q_dtype), cache)


def test_every_decode_of_a_step_runs_in_the_kernel(monkeypatch) -> None:
    """Batched decodes, a lone decode, and the decodes riding with a prefill chunk."""
    calls = []

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return decode_attention(q, *args, **kwargs)

    monkeypatch.setattr(attention_module, "decode_attention", counting)
    cache = random_cache(TINY, "NHD", 4, torch.float32)
    q = torch.randn(5, 8, 8)
    batched = AttentionMetadata(torch.empty(0), torch.empty(0), [],
                                decode_page_table=torch.tensor([[1, 2], [3, 0]]),
                                decode_kv_lens=torch.tensor([6, 2]))
    paged_attention(q[:2], cache, 0, batched, 0.5)
    lone = AttentionMetadata(torch.empty(0), torch.empty(0),
                             [SequenceSlice(0, 1, 4, torch.tensor([5, 6]))])
    paged_attention(q[:1], cache, 0, lone, 0.5)
    mixed = AttentionMetadata(torch.empty(0), torch.empty(0),
                              [SequenceSlice(0, 3, 0, torch.tensor([7])),
                               SequenceSlice(3, 1, 2, torch.tensor([8])),
                               SequenceSlice(4, 1, 5, torch.tensor([9, 10]))])
    paged_attention(q, cache, 0, mixed, 0.5)
    assert calls == [2, 1, 1, 1]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_nan_poisons_what_it_touches_as_in_dense_attention(layout: str) -> None:
    """A NaN key poisons every query head of its KV head, a NaN query its own head; the rest
    stays finite (AVX-512's max drops NaNs: the kernel must not)."""
    cache = random_cache(TINY, layout, 4, torch.float32)
    pages, kv_lens = [[3, 5], [7, 1]], [6, 7]
    k_page = cache.buffer[0, 5, 0]  # page 5 of sequence 0: tokens 4..7, its K half
    if layout == "NHD":
        k_page[1, 2] = float("nan")  # token 5, KV head 2
    else:
        k_page[2, 1] = float("nan")
    q = torch.randn(2, TINY.num_heads, TINY.head_dim)
    q[1, 3, 0] = float("nan")
    got = decode_attention(q, cache, 0, torch.tensor(pages), torch.tensor(kv_lens), 0.5)
    for b in range(2):
        want = dense(q[b], cache, 0, pages[b], kv_lens[b], 0.5)
        assert torch.equal(got[b].isnan(), want.isnan())
    assert got[0, 4:6].isnan().all() and got[1, 3].isnan().all()  # the poisoned heads
    assert got[0, :4].isfinite().all()


def test_a_query_of_another_head_dim_is_refused() -> None:
    cache = random_cache(TINY, "NHD", 4, torch.float32)
    with pytest.raises(KernelError, match="query heads of 16"):
        decode_attention(torch.randn(1, TINY.num_heads, 16), cache, 0, torch.tensor([[1]]),
                         torch.tensor([2]), 0.5)


def _vdpbf16ps_scores(q: torch.Tensor, keys: torch.Tensor, scale: float) -> np.ndarray:
    """Scores by the definition of AVX-512 BF16's `vdpbf16ps`, in float32 numpy: per lane of
    16, per 32 elements, the pair's odd product added and rounded, then its even one (each
    product of two bfloat16 values is exact in float32); the lanes summed as
    `_mm512_reduce_add_ps` pairs them (halves, quarters, lanes two apart); then the scale."""
    chunks = -(-q.shape[0] // 32)
    pad = chunks * 32 - q.shape[0]
    qs = F.pad(q.float(), (0, pad)).numpy().reshape(1, chunks, 16, 2)
    ks = F.pad(keys.float(), (0, pad)).numpy().reshape(keys.shape[0], chunks, 16, 2)
    acc = np.zeros((keys.shape[0], 16), dtype=np.float32)
    for c in range(chunks):
        acc = acc + qs[:, c, :, 1] * ks[:, c, :, 1]
        acc = acc + qs[:, c, :, 0] * ks[:, c, :, 0]
    eight = acc[:, 8:] + acc[:, :8]
    four = eight[:, 4:] + eight[:, :4]
    two = four[:, 2:] + four[:, :2]
    return (two[:, 0] + two[:, 1]) * np.float32(scale)


@pytest.mark.parametrize("head_dim", [64, 72, 128])
@pytest.mark.parametrize("count", [16, 5])
def test_bfloat16_scores_are_the_bf16_dot_products(head_dim: int, count: int) -> None:
    """A block of bfloat16 keys is scored with AVX-512 BF16's dot product, or where the CPU
    lacks it its emulation: the same bits either way, those of the instruction's definition
    (no denormals here, which the instruction alone would flush)."""
    generator = torch.Generator().manual_seed(head_dim + count)
    q = torch.randn(head_dim, generator=generator).bfloat16()
    keys = torch.randn(count, head_dim, generator=generator).bfloat16()
    out = torch.full((16,), float("nan"))
    scale = head_dim ** -0.5
    assert lib.da_block_scores(1, q.data_ptr(), keys.data_ptr(), count, head_dim, scale,
                               out.data_ptr()) == 0
    assert torch.equal(out[:count], torch.from_numpy(_vdpbf16ps_scores(q, keys, scale)))
    assert out[count:].isnan().all()  # nothing written past the block's keys
