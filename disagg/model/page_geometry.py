"""Where a page's heads sit in its bytes, NHD and HND: the one page geometry (S6, S7).

A page of one layer, on a rank holding H heads, is K then V, each ``[page_size, H, head_dim]``
if `kv_layout` is NHD and ``[H, page_size, head_dim]`` if it is HND. An MLA cache has one part
(the latent row, one "head") instead of two (`ModelConfig.kv_parts`). `PageGeometry` turns a head
range into the contiguous byte runs that hold it. The cache (`kv_cache.py`, `page_segments`),
the transfer planner (`kv_transfer/transfer_plan.py`) and the figures all take their offsets
from here. It knows no buffer and no sharding: offsets are inside one page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch


class PagedCache(Protocol):
    """What a geometry is read from: any paged cache, sharded or not (`kv_cache.KVCache`),
    named here so this file imports nothing of the cache's."""

    kv_layout: str
    page_size: int
    head_dim: int
    kv_parts: int

    @property
    def dtype(self) -> torch.dtype: ...


class Segment(NamedTuple):
    """A contiguous run of bytes: `[offset, offset + nbytes)`."""

    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """What a page's byte offsets depend on besides its heads.

    >>> g = PageGeometry("NHD", page_size=4, head_dim=8, element_size=4)
    >>> g.page_nbytes(4)  # 2 (K, V) * 4 tokens * 4 heads * 8 dims * 4 bytes
    1024
    >>> len(g.run_segments(4, 0, 2)), len(PageGeometry("HND", 4, 8, 4).run_segments(4, 0, 2))
    (8, 2)
    """

    kv_layout: str
    page_size: int
    head_dim: int
    element_size: int
    kv_parts: int = 2  # K and V; 1 for MLA's latent row

    @staticmethod
    def of(cache: PagedCache) -> PageGeometry:
        """The geometry of `cache`'s pages."""
        return PageGeometry(cache.kv_layout, cache.page_size, cache.head_dim,
                            cache.dtype.itemsize, cache.kv_parts)

    def page_nbytes(self, num_heads: int) -> int:
        """Bytes of one page (K and V, or the latent) on a rank holding `num_heads` heads."""
        return self.kv_parts * self.page_size * num_heads * self.head_dim * self.element_size

    def run_segments(self, num_heads: int, first: int, count: int) -> list[Segment]:
        """The runs of heads `[first, first + count)` of a page holding `num_heads` heads,
        offsets from the page's start: one per K/V half in HND (heads come before tokens), one
        per token per half in NHD (a token's heads sit between other heads of the same token),
        which is the write-count lesson of S7. Never merged, even for every head: a whole
        page is one run of `page_nbytes`, and the caller that may write it so knows it."""
        if not 0 <= first < first + count <= num_heads:
            raise ValueError(f"head range [{first}, {first + count}) is not inside "
                             f"[0, {num_heads})")
        row = self.head_dim * self.element_size  # bytes of one head of one token
        half = self.page_nbytes(num_heads) // self.kv_parts
        if self.kv_layout == "HND":
            return [Segment(kv * half + first * self.page_size * row, count * self.page_size * row)
                    for kv in range(self.kv_parts)]
        return [Segment(kv * half + (token * num_heads + first) * row, count * row)
                for kv in range(self.kv_parts) for token in range(self.page_size)]
