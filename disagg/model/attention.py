"""Pure-PyTorch paged attention for prefill chunks and decodes, both layouts (S3a, S7).

A prefill chunk attends causally over the request's cached prefix plus the chunk itself; a decode
is a chunk of one token. `reference_attention` is the dense oracle the tests compare against.
The cache is gathered page by page and handed to `scaled_dot_product_attention`; on a CPU that
`decode_attention.takes_kernel` accepts, decodes instead run the C kernel that reads the pages
where they lie (X8b), for which the gather-and-SDPA path is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from disagg.model.decode_attention import decode_attention, takes_kernel
from disagg.model.kv_cache import KVCache


@dataclass(slots=True)
class SequenceSlice:
    """One request's part of a batch: its query rows and the pages holding its keys."""

    query_start: int  # first row of this request in the batch's token axis
    query_len: int  # tokens of this request in the batch (1 for a decode)
    context_len: int  # tokens already cached before this batch (the prefix)
    page_ids: torch.Tensor  # [num_pages_of_request], int64

    @property
    def kv_len(self) -> int:
        """Keys visible to the last query row: the prefix plus this chunk."""
        return self.context_len + self.query_len


@dataclass(slots=True)
class AttentionMetadata:
    """Where each batch token's K/V is stored and how the batch splits into requests."""

    slot_page_ids: torch.Tensor  # [num_tokens] page receiving each new token's K/V
    slot_offsets: torch.Tensor  # [num_tokens] slot within that page
    sequences: list[SequenceSlice]
    # Pure-decode batches run as one padded call: [num_seqs, max_pages] and [num_seqs].
    decode_page_table: torch.Tensor | None = None
    decode_kv_lens: torch.Tensor | None = None


def causal_mask(context_len: int, query_len: int, device: torch.device) -> torch.Tensor:
    """``[query_len, context_len + query_len]`` bool mask: row j sees keys up to context_len + j."""
    key_pos = torch.arange(context_len + query_len, device=device)
    query_pos = torch.arange(query_len, device=device) + context_len
    return key_pos[None, :] <= query_pos[:, None]


def paged_attention(q: torch.Tensor, kv_cache: KVCache, layer_idx: int,
                    meta: AttentionMetadata, scale: float,
                    kv_heads: slice | None = None) -> torch.Tensor:
    """Attention of every batch token over its own request's cache (after this batch's append).

    `q` is ``[num_tokens, num_heads, head_dim]``; returns the same shape. `kv_heads`: only
    these of the cache's heads serve `q` (a TP rank's share of a replicated cache).
    """
    in_c = takes_kernel(q, kv_cache)  # decodes read their pages in place (X8b)
    if meta.decode_page_table is not None:
        if in_c:
            return decode_attention(q, kv_cache, layer_idx, meta.decode_page_table,
                                    meta.decode_kv_lens, scale, kv_heads)
        return _batched_decode(q, kv_cache, layer_idx, meta, scale, kv_heads)
    out = torch.empty_like(q)
    for seq in meta.sequences:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        if seq.query_len == 1 and in_c:
            o = decode_attention(q[rows], kv_cache, layer_idx, seq.page_ids[None],
                                 torch.tensor([seq.kv_len], device=q.device), scale, kv_heads)
            if len(meta.sequences) == 1:
                return o
            out[rows] = o
            continue
        k, v = kv_cache.gather(layer_idx, seq.page_ids, seq.kv_len)  # [kv_heads, kv_len, dim]
        if kv_heads is not None:
            k, v = k[kv_heads], v[kv_heads]
        k, v = k.to(q.dtype), v.to(q.dtype)  # a cache kept in another precision
        # Inputs get a batch axis of one: SDPA's fused CPU kernel takes 4-D inputs only; 3-D
        # ones fall back to its math path (3.5x slower for a 512-token prefill chunk).
        if seq.query_len == 1:  # a decode: its heads as rows of their KV head's group
            o = F.scaled_dot_product_attention(grouped_queries(q[rows][0], k.shape[0])[None],
                                               k[None], v[None], scale=scale)
            out[rows] = o.reshape(1, *q.shape[1:])
            continue
        q_seq = q[rows].transpose(0, 1)  # [num_heads, query_len, dim]
        if seq.context_len == 0:
            mask, causal = None, True
        else:
            mask, causal = causal_mask(seq.context_len, seq.query_len, q.device), False
        o = F.scaled_dot_product_attention(q_seq[None], k[None], v[None], attn_mask=mask,
                                           is_causal=causal, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out


def _batched_decode(q: torch.Tensor, kv_cache: KVCache, layer_idx: int,
                    meta: AttentionMetadata, scale: float,
                    kv_heads: slice | None = None) -> torch.Tensor:
    """All requests decode one token: gather a padded ``[batch, heads, max_kv, dim]`` and mask.

    This is the attention a captured decode graph replays (`disagg/engine/cuda_graphs.py`), so
    it must stay graph-safe: shapes come from the page table's shape alone, lengths only enter
    as a mask, and nothing reads a tensor value on the host.
    """
    page_table, kv_lens = meta.decode_page_table, meta.decode_kv_lens
    assert page_table is not None
    assert kv_lens is not None
    k, v = kv_cache.gather_batch(layer_idx, page_table)  # [seqs, kv_heads, max_kv, dim] each
    if kv_heads is not None:
        k, v = k[:, kv_heads], v[:, kv_heads]
    k, v = k.to(q.dtype), v.to(q.dtype)
    key_pos = torch.arange(k.shape[2], device=q.device)
    mask = (key_pos[None, :] < kv_lens[:, None])[:, None, None, :]  # [seqs, 1, 1, max_kv]
    o = F.scaled_dot_product_attention(grouped_queries(q, k.shape[1]), k, v, attn_mask=mask,
                                       scale=scale)
    return o.reshape(q.shape)


def grouped_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """One token's queries ``[..., num_heads, dim]`` as ``[..., num_kv_heads, group, dim]``:
    the `group` heads that share a KV head become rows attending over its keys (exact: a
    decode's rows see the same keys). No K or V is repeated, and SDPA takes its fused CPU
    kernel, which `enable_gqa` with a mask did not in bfloat16 (6x slower at batch 32)."""
    *lead, heads, dim = q.shape
    return q.reshape(*lead, num_kv_heads, heads // num_kv_heads, dim)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        context_len: int, scale: float) -> torch.Tensor:
    """Dense causal attention written out longhand, for tests.

    `q` is ``[query_len, num_heads, head_dim]``; `k`, `v` are
    ``[context_len + query_len, num_kv_heads, head_dim]`` (every key of the request).
    """
    query_len, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~causal_mask(context_len, query_len, q.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)
