"""The paged KV cache in FlashInfer's NHD and HND layouts (S7); where its bytes come from is
`kv_memory.py`.

One tensor holds every layer so that a transfer engine can register it as one memory region.
Per layer it is FlashInfer's single-tensor paged cache: K and V of a page sit next to each other,
so one RDMA write moves both. An MLA model's cache has one part instead of two: per token, the
latent row `c_KV` and the shared RoPE key, one "head" wide (`write_latent`, `gather_latent`).
This module only stores and locates; attention reads it (`attention.py`) and the allocator
decides which pages a request owns (`page_allocator.py`).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from disagg.config import CacheConfig, ModelConfig
from disagg.errors import ConfigError
from disagg.model.gather_scratch import GatherScratch
from disagg.model.kv_memory import allocate_kv_buffer
from disagg.model.page_geometry import PageGeometry, Segment
from disagg.model.sharding import Sharding


class PartRows(NamedTuple):
    """Where one part (K, V or the latent rows) of some pages lies in layer 0, byte by byte:
    each page's part starts at `addresses[i]` (int64, on the CPU) and a later layer's lies
    `layer_stride` further on per layer; inside a page, `token_stride` from one token's row to
    the next and `head_stride` from one head's to the next (NHD keeps a token's heads side by
    side, HND a head's tokens)."""

    addresses: torch.Tensor
    layer_stride: int
    token_stride: int
    head_stride: int


class PagedKVCache:
    """All layers' paged K/V in one buffer.

    ``buffer`` has shape ``[num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]`` if
    `kv_layout` is NHD, and ``[num_layers, num_pages, 2, num_kv_heads, page_size, head_dim]`` if
    it is HND. Index 0 of the third axis is K, 1 is V, so ``layer(i)[:, 0]`` is FlashInfer's K
    cache: ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
    ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND). With MLA the third axis has one
    entry (`kv_parts` 1), the latent rows, and `num_kv_heads` is 1.

    >>> cache = PagedKVCache(ModelConfig.from_name("tiny"), CacheConfig(page_size=4, num_pages=8))
    >>> cache.page_nbytes  # 2 (K,V) * 4 tokens * 4 kv heads * 8 dims * 4 bytes
    1024
    """

    def __init__(self, model: ModelConfig, cache: CacheConfig, device: str | torch.device = "cpu",
                 buffer: torch.Tensor | None = None) -> None:
        self.num_layers = model.num_layers
        self.kv_parts = model.kv_parts
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.page_size = cache.page_size
        self.num_pages = cache.num_pages
        self.kv_layout = cache.kv_layout
        shape = self.buffer_shape(model, cache)
        if buffer is None:  # else memory another process allocated and shares (S5a)
            buffer = allocate_kv_buffer(shape, cache.dtype, device, cache.memory)
        elif tuple(buffer.shape) != shape or buffer.dtype != cache.dtype:
            raise ConfigError(f"KV buffer {tuple(buffer.shape)} {buffer.dtype} is not the "
                              f"cache's {shape} {cache.dtype}")
        self.buffer = buffer
        self._scratch = GatherScratch(buffer[0])  # where gathers land (`gather_scratch.py`)

    @staticmethod
    def buffer_shape(model: ModelConfig, cache: CacheConfig) -> tuple[int, ...]:
        """The shape of the one tensor holding every layer (see the class docstring)."""
        heads, page, parts = model.num_kv_heads, cache.page_size, model.kv_parts
        page_shape = (parts, page, heads, model.head_dim) if cache.kv_layout == "NHD" else (
            parts, heads, page, model.head_dim)
        return (model.num_layers, cache.num_pages, *page_shape)

    def layer(self, layer_idx: int) -> torch.Tensor:
        """One layer's cache, ``[num_pages, 2, ...page dims]`` (a view, no copy)."""
        return self.buffer[layer_idx]

    @property
    def element_size(self) -> int:
        """Bytes per cached value."""
        return self.buffer.element_size()

    @property
    def geometry(self) -> PageGeometry:
        """Where heads sit in a page's bytes (`page_geometry.py`)."""
        return PageGeometry.of(self)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page of one layer, K and V together (or the latent rows)."""
        return self.geometry.page_nbytes(self.num_kv_heads)

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer: every page."""
        return self.num_pages * self.page_nbytes

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
              page_ids: torch.Tensor, page_offsets: torch.Tensor) -> None:
        """Store new tokens' K and V: token t goes to slot `page_offsets[t]` of `page_ids[t]`.

        `k` and `v` are ``[num_tokens, num_kv_heads, head_dim]``.
        """
        self._check_parts(2, "write")
        cache = self.buffer[layer_idx]
        # A cache kept in another precision than the model's (--kv-dtype) rounds on the way in.
        k, v = k.to(cache.dtype), v.to(cache.dtype)
        if self.kv_layout == "NHD":
            cache[page_ids, 0, page_offsets] = k
            cache[page_ids, 1, page_offsets] = v
        else:
            # Advanced indices around a slice put the indexed dim first: [num_tokens, heads, dim].
            cache[page_ids, 0, :, page_offsets] = k
            cache[page_ids, 1, :, page_offsets] = v

    def write_latent(self, layer_idx: int, latent: torch.Tensor, page_ids: torch.Tensor,
                     page_offsets: torch.Tensor) -> None:
        """Store new tokens' latent rows (MLA): `latent` is ``[num_tokens, head_dim]``."""
        self._check_parts(1, "write_latent")
        cache = self.buffer[layer_idx]
        latent = latent.to(cache.dtype)
        if self.kv_layout == "NHD":
            cache[page_ids, 0, page_offsets] = latent[:, None]
        else:
            cache[page_ids, 0, :, page_offsets] = latent[:, None]

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page `src` into page `dst`, every layer, K and V: a fork's own copy of the
        partly computed page it would otherwise share (`engine/forking.py`). The page axis is
        the second of `buffer` in both layouts, so one copy moves all of it."""
        for page_id in (src, dst):
            self._check_page(0, page_id)
        if src == dst:
            raise ValueError(f"cannot copy page {src} onto itself")
        self.buffer[:, dst] = self.buffer[:, src]  # [num_layers, 2, ...page dims]

    def gather(self, layer_idx: int, page_ids: torch.Tensor, num_tokens: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `num_tokens` cached tokens held by `page_ids`, in order.

        Returns K and V as ``[num_kv_heads, num_tokens, head_dim]`` (the shape attention wants),
        each a view of one gathered copy.
        """
        self._check_parts(2, "gather")
        k, v = self._gather(layer_idx, page_ids)
        return k[0, :, :num_tokens], v[0, :, :num_tokens]

    def gather_parts(self, layer_idx: int, page_ids: torch.Tensor, num_tokens: int
                     ) -> list[torch.Tensor]:
        """Every part the cache stores of the first `num_tokens` tokens of `page_ids`, each
        ``[num_kv_heads, num_tokens, head_dim]``: K and V, or the latent rows as one "head".
        What a reader of bytes needs (the KV checksum), whatever the attention."""
        return [part[0, :, :num_tokens] for part in self._gather(layer_idx, page_ids)]

    def part_rows(self, part: int, page_ids: torch.Tensor) -> PartRows:
        """Where part `part` (K, V or the latent rows) of each page lies, for a reader of
        bytes that walks the pages itself (the KV checksum's kernel): see `PartRows`."""
        elem, dim = self.element_size, self.head_dim
        first = self.buffer[0, 0, part]
        page_stride = self.buffer.stride(1) * elem
        addresses = first.data_ptr() + page_ids.to(torch.int64) * page_stride
        layer_stride = self.buffer.stride(0) * elem
        if self.kv_layout == "NHD":  # [page_size, heads, dim]
            return PartRows(addresses, layer_stride, self.num_kv_heads * dim * elem, dim * elem)
        # HND: [heads, page_size, dim]
        return PartRows(addresses, layer_stride, dim * elem, self.page_size * dim * elem)

    def gather_latent(self, layer_idx: int, page_ids: torch.Tensor, num_tokens: int
                      ) -> torch.Tensor:
        """The first `num_tokens` latent rows held by `page_ids` (MLA): ``[num_tokens, dim]``."""
        self._check_parts(1, "gather_latent")
        return self._gather(layer_idx, page_ids)[0][0, 0, :num_tokens]

    def gather_latent_batch(self, layer_idx: int, page_table: torch.Tensor) -> torch.Tensor:
        """Every request's latent rows: ``[num_seqs, max_pages * page_size, dim]`` (MLA)."""
        self._check_parts(1, "gather_latent_batch")
        return self._gather(layer_idx, page_table)[0][:, 0]

    def gather_batch(self, layer_idx: int, page_table: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's pages at once: `page_table` is ``[num_seqs, max_pages]``; returns K
        and V, each ``[num_seqs, num_kv_heads, max_pages * page_size, head_dim]``."""
        self._check_parts(2, "gather_batch")
        k, v = self._gather(layer_idx, page_table)
        return k, v

    def _gather(self, layer_idx: int, page_table: torch.Tensor) -> list[torch.Tensor]:
        """Every part (K and V, or the latent rows) of the pages in `page_table` (``[max_pages]``
        is one request, ``[num_seqs, max_pages]`` several), each
        ``[num_seqs, heads, max_pages * page_size, dim]``.

        Whole pages are copied with one `index_select` per part into the cache's gather buffers:
        the result is valid until the next gather (`gather_scratch.py`). In NHD
        a request's pages are then already its tokens in order, each token's heads together,
        and moving heads forward is a view. In HND a page holds each head's tokens in turn, so
        putting a head's tokens of every page side by side takes a second copy.
        """
        num_seqs, max_pages = (1, page_table.numel()) if page_table.dim() == 1 else page_table.shape
        heads, dim = self.num_kv_heads, self.head_dim
        ids, tokens = page_table.reshape(-1), max_pages * self.page_size
        layer = self.buffer[layer_idx]
        parts = []
        for part in range(self.kv_parts):
            pages = self._scratch.select(layer, part, ids)
            if self.kv_layout == "NHD":  # [pages, page_size, heads, dim]
                parts.append(pages.view(num_seqs, tokens, heads, dim).transpose(1, 2))
                continue
            # HND: [pages, heads, page_size, dim]
            pages = pages.view(num_seqs, max_pages, heads, self.page_size, dim).transpose(1, 2)
            parts.append(self._scratch.reordered(part, pages).view(num_seqs, heads, tokens, dim))
        return parts

    @property
    def shards(self) -> list[PagedKVCache]:
        """The per-rank memory regions: one, unsharded."""
        return [self]

    @property
    def sharding(self) -> Sharding:
        """One rank holding every head."""
        return Sharding(1, self.num_kv_heads)

    @property
    def device(self) -> torch.device:
        """Where the cache lives."""
        return self.buffer.device

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the cache."""
        return self.buffer.dtype

    # Byte geometry for transfers (S5, S7).

    def page_offset(self, layer_idx: int, page_id: int) -> int:
        """Byte offset of page `page_id` of layer `layer_idx` from the start of `buffer`."""
        self._check_page(layer_idx, page_id)
        return (layer_idx * self.num_pages + page_id) * self.page_nbytes

    def page_segments(self, layer_idx: int, page_id: int,
                      head_start: int = 0, head_end: int | None = None) -> list[Segment]:
        """Where heads `[head_start, head_end)` of one page live, as contiguous byte runs.

        A whole page is one run in both layouts; a head range takes the runs of
        `PageGeometry.run_segments` (one per K/V half in HND, one per token per half in NHD:
        the write-count lesson of S7), offset by where the page sits in `buffer`.

        >>> m, c = ModelConfig.from_name("tiny"), CacheConfig(page_size=4, num_pages=8)
        >>> len(PagedKVCache(m, c).page_segments(0, 3, 0, 2))  # NHD: 2 halves * 4 tokens
        8
        >>> len(PagedKVCache(m, CacheConfig(4, 8, "HND")).page_segments(0, 3, 0, 2))
        2
        """
        head_end = self.num_kv_heads if head_end is None else head_end
        if not 0 <= head_start < head_end <= self.num_kv_heads:
            raise ValueError(f"head range [{head_start}, {head_end}) is not inside "
                             f"[0, {self.num_kv_heads})")
        base = self.page_offset(layer_idx, page_id)
        if head_start == 0 and head_end == self.num_kv_heads:
            return [Segment(base, self.page_nbytes)]
        runs = self.geometry.run_segments(self.num_kv_heads, head_start, head_end - head_start)
        return [Segment(base + run.offset, run.nbytes) for run in runs]

    def is_contiguous(self, head_start: int = 0, head_end: int | None = None) -> bool:
        """Whether heads `[head_start, head_end)` of a page's K (or V) half are one run."""
        head_end = self.num_kv_heads if head_end is None else head_end
        whole = head_start == 0 and head_end == self.num_kv_heads
        return whole or self.kv_layout == "HND" or self.page_size == 1

    def _check_parts(self, parts: int, method: str) -> None:
        if self.kv_parts != parts:
            kind = "K/V" if parts == 2 else "latent (MLA)"
            raise TypeError(f"{method} is for a {kind} cache; this one has {self.kv_parts} "
                            "part(s) per token")

    def _check_page(self, layer_idx: int, page_id: int) -> None:
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer {layer_idx} out of range [0, {self.num_layers})")
        if not 0 <= page_id < self.num_pages:
            raise IndexError(f"page id {page_id} out of range [0, {self.num_pages})")


class KVCache(Protocol):
    """What the model and attention need from a paged cache, sharded or not."""

    num_layers: int
    kv_parts: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    kv_layout: str

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def shards(self) -> list[PagedKVCache]: ...

    @property
    def sharding(self) -> Sharding: ...

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
              page_ids: torch.Tensor, page_offsets: torch.Tensor) -> None: ...

    def copy_page(self, src: int, dst: int) -> None: ...

    def gather(self, layer_idx: int, page_ids: torch.Tensor, num_tokens: int
               ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather_batch(self, layer_idx: int, page_table: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write_latent(self, layer_idx: int, latent: torch.Tensor, page_ids: torch.Tensor,
                     page_offsets: torch.Tensor) -> None: ...

    def gather_latent(self, layer_idx: int, page_ids: torch.Tensor, num_tokens: int
                      ) -> torch.Tensor: ...

    def gather_latent_batch(self, layer_idx: int, page_table: torch.Tensor
                            ) -> torch.Tensor: ...
