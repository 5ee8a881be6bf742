"""Decode attention read in place from the paged cache, in C (X8b, S7).

A decode step's attention is a few hundred keys per sequence and layer; with PyTorch it is a
gather of every page of the request (K and V, per layer) and then a call to SDPA, and on a CPU
the copies, the calls and their thread hand-offs cost several times the arithmetic (SmolLM2 at
batch 1: 146 us a layer, of which the math is a few). `decode_attention.c` scores each
sequence's keys where the page table says they lie, NHD or HND, for the query heads sharing each
KV head, and writes the output rows. `attention.py` calls it for every decode when
`takes_kernel` holds (a CPU cache of K/V in the queries' dtype, float32 or bfloat16, and
AVX-512); everything else, and the tests' reference, is the gather-and-SDPA path.
"""

from __future__ import annotations

import torch

from disagg.errors import KernelError
from disagg.model.cpu_kernels import AVX512, DTYPE_CODES, lib, named_call, traced
from disagg.model.kv_cache import KVCache, PagedKVCache

PROFILER_NAME = "disagg::decode_attention"
_LAYOUTS = {"NHD": 0, "HND": 1}
# decode_attention.c's refusals, by code (a refusal here is a caller's bug: nothing falls back).
_REFUSALS = {-1: "this CPU has no AVX-512", -2: "a page id outside the cache",
             -3: "a length outside its page table", -4: "heads it cannot take",
             -5: "no memory for its scratch"}


def takes_kernel(q: torch.Tensor, kv_cache: KVCache) -> bool:
    """Whether `decode_attention` runs for these queries over this cache."""
    return (AVX512 and isinstance(kv_cache, PagedKVCache) and kv_cache.kv_parts == 2
            and q.dtype in DTYPE_CODES and kv_cache.dtype == q.dtype
            and kv_cache.buffer.is_contiguous()
            and q.is_cpu and kv_cache.buffer.is_cpu
            and not (torch.is_grad_enabled() and q.requires_grad) and not traced())


def decode_attention(q: torch.Tensor, kv_cache: PagedKVCache, layer_idx: int,
                     page_table: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                     kv_heads: slice | None = None) -> torch.Tensor:
    """One token per sequence: `q` ``[batch, num_heads, head_dim]`` attends over the first
    `kv_lens[b]` tokens of the pages in row b of `page_table` ``[batch, max_pages]``; returns
    ``[batch, num_heads, head_dim]``. `kv_heads`: the cache heads these queries use (a TP
    rank's share of a replicated cache), all of them by default."""
    return named_call(PROFILER_NAME, _run, q, kv_cache, layer_idx, page_table, kv_lens, scale,
                      kv_heads)


def _run(q: torch.Tensor, kv_cache: PagedKVCache, layer_idx: int, page_table: torch.Tensor,
         kv_lens: torch.Tensor, scale: float, kv_heads: slice | None) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    start, stop = (0, kv_cache.num_kv_heads) if kv_heads is None else (kv_heads.start,
                                                                       kv_heads.stop)
    if (num_heads % (stop - start) or head_dim != kv_cache.head_dim
            or page_table.shape[0] != batch or kv_lens.numel() != batch):
        raise KernelError(f"{num_heads} query heads of {head_dim} over KV heads [{start}, {stop}) "
                          f"of {kv_cache.head_dim}, a page table for {page_table.shape[0]} and "
                          f"lengths for {kv_lens.numel()} sequences: not one batch of {batch}")
    q = q.contiguous()
    table = page_table.to(torch.int64).contiguous()
    lens = kv_lens.to(torch.int64).contiguous()
    layer = kv_cache.buffer[layer_idx]  # a view: every layer is one contiguous block
    out = torch.empty_like(q)
    status = lib.da_decode_attention(
        DTYPE_CODES[q.dtype], _LAYOUTS[kv_cache.kv_layout], q.data_ptr(), layer.data_ptr(),
        table.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, table.shape[1],
        kv_cache.num_pages, kv_cache.page_size, kv_cache.num_kv_heads, head_dim, start,
        stop - start, num_heads // (stop - start), scale, torch.get_num_threads())
    if status != 0:
        raise KernelError(f"decode attention refused layer {layer_idx}: "
                          f"{_REFUSALS.get(status, f'code {status}')}")
    return out
