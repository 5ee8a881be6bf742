"""Multi-head Latent Attention over the paged latent cache, in its two forms (S3b, S9a).

The cache holds one row per token, ``[c_KV ; k_rope]``: the normalised latent and the RoPE key
every head shares. Per head the key is ``[W_UK c_KV ; k_rope]`` and the value ``W_UV c_KV``,
with `W_UK`, `W_UV` the two halves of kv_b_proj. Two ways compute the same attention:

- up-projected (prefill chunks): expand every cached row into per-head K and V, then ordinary
  attention. Many queries share each expansion, so it is paid once per chunk.
- absorbed (decodes): fold `W_UK` into the query (``q_nope W_UK`` scores against `c_KV`
  directly), attend over the latent rows as one shared key and value "head", and apply `W_UV`
  to the attention output. Nothing per key is expanded: one query row reads the small rows.

Pure functions like `attention.py`; the projections around them live in `latent_attention.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disagg.model.attention import AttentionMetadata, causal_mask
from disagg.model.kv_cache import KVCache


def upprojected_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                          w_uk: torch.Tensor, w_uv: torch.Tensor, context_len: int,
                          scale: float) -> torch.Tensor:
    """One request's chunk attending causally over its cached prefix and itself, with K and V
    expanded from the latent rows.

    `q_nope` is ``[query_len, num_heads, qk_nope_head_dim]``, `q_rope` ``[query_len, num_heads,
    qk_rope_head_dim]``, `latent` ``[context_len + query_len, kv_lora_rank + qk_rope_head_dim]``;
    `w_uk` ``[num_heads, qk_nope_head_dim, kv_lora_rank]``, `w_uv` ``[num_heads, v_head_dim,
    kv_lora_rank]``. Returns ``[query_len, num_heads, v_head_dim]``.
    """
    query_len, num_heads, _ = q_nope.shape
    rank = w_uk.shape[-1]
    c_kv, k_rope = latent[:, :rank], latent[:, rank:]
    k_nope = torch.einsum("sr,hnr->hsn", c_kv, w_uk)  # [num_heads, kv_len, qk_nope_head_dim]
    v = torch.einsum("sr,hvr->hsv", c_kv, w_uv)  # [num_heads, kv_len, v_head_dim]
    k_rope = k_rope[None].expand(num_heads, -1, -1)  # the one RoPE key, shared by every head
    k = torch.cat((k_nope, k_rope), dim=-1)  # [num_heads, kv_len, qk_head_dim]
    q = torch.cat((q_nope, q_rope), dim=-1).transpose(0, 1)  # [num_heads, query_len, qk_head_dim]
    if query_len == 1:
        mask, causal = None, False
    elif context_len == 0:
        mask, causal = None, True
    else:
        mask, causal = causal_mask(context_len, query_len, q.device), False
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return o.transpose(0, 1)


def absorbed_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                       w_uk: torch.Tensor, w_uv: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> torch.Tensor:
    """Attention straight over the latent rows, `W_UK` in the query and `W_UV` after.

    Batched: `q_nope` ``[batch, query_len, num_heads, qk_nope_head_dim]``, `q_rope` ``[batch,
    query_len, num_heads, qk_rope_head_dim]``, `latent` ``[batch, kv_len, kv_lora_rank +
    qk_rope_head_dim]``; `mask` (True = may attend) broadcasts to ``[batch, num_heads, query_len,
    kv_len]``, None for every key. Returns ``[batch, query_len, num_heads, v_head_dim]``.
    """
    rank = w_uk.shape[-1]
    q_latent = torch.einsum("bthn,hnr->bhtr", q_nope, w_uk)  # [batch, heads, query_len, rank]
    q = torch.cat((q_latent, q_rope.transpose(1, 2)), dim=-1)  # same width as a latent row
    # One key/value "head" for every query head: the row is the key, its c_KV part the value.
    k = latent[:, None]  # [batch, 1, kv_len, kv_lora_rank + qk_rope_head_dim]
    v = latent[:, None, :, :rank]  # [batch, 1, kv_len, kv_lora_rank]
    o_latent = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)  # [batch, heads, query_len, rank]
    return torch.einsum("bhtr,hvr->bthv", o_latent, w_uv)


def latent_paged_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: KVCache,
                           layer_idx: int, meta: AttentionMetadata, w_uk: torch.Tensor,
                           w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Every batch token over its own request's latent rows (after this batch's append).

    `q_nope` ``[num_tokens, num_heads, qk_nope_head_dim]`` and `q_rope` ``[num_tokens,
    num_heads, qk_rope_head_dim]``; returns ``[num_tokens, num_heads, v_head_dim]``. Decodes
    take the absorbed form, chunks of several tokens the up-projected one.
    """
    if meta.decode_page_table is not None:
        return _batched_decode(q_nope, q_rope, kv_cache, layer_idx, meta, w_uk, w_uv, scale)
    out = q_nope.new_empty(*q_nope.shape[:2], w_uv.shape[1])
    for seq in meta.sequences:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        latent = kv_cache.gather_latent(layer_idx, seq.page_ids, seq.kv_len)  # [kv_len, dim]
        latent = latent.to(q_nope.dtype)  # a cache kept in another precision
        if seq.query_len == 1:
            out[rows] = absorbed_attention(q_nope[None, rows], q_rope[None, rows], latent[None],
                                           w_uk, w_uv, None, scale)[0]
        else:
            out[rows] = upprojected_attention(q_nope[rows], q_rope[rows], latent, w_uk, w_uv,
                                              seq.context_len, scale)
    return out


def _batched_decode(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: KVCache,
                    layer_idx: int, meta: AttentionMetadata, w_uk: torch.Tensor,
                    w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """All requests decode one token over a padded ``[batch, max_kv, dim]`` gather.

    A captured decode graph replays this (`disagg/engine/cuda_graphs.py`), so as in
    `attention.py` shapes come from the page table alone, lengths only enter the mask, and no
    tensor value is read on the host.
    """
    page_table, kv_lens = meta.decode_page_table, meta.decode_kv_lens
    assert page_table is not None
    assert kv_lens is not None
    latent = kv_cache.gather_latent_batch(layer_idx, page_table).to(q_nope.dtype)
    key_pos = torch.arange(latent.shape[1], device=q_nope.device)
    mask = (key_pos[None, :] < kv_lens[:, None])[:, None, None, :]  # [seqs, 1, 1, max_kv]
    out = absorbed_attention(q_nope[:, None], q_rope[:, None], latent, w_uk, w_uv, mask, scale)
    return out[:, 0]
