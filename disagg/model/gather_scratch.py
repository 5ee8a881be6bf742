"""The reused output buffers of a paged cache's gathers (S7).

Attention reads a request's pages by copying them out of the cache, every layer of every step.
Copied into fresh tensors, each gather of more than a few hundred kilobytes is a new mapping
from the allocator and a page fault per 4 KiB on first touch: at decode batch 32 in float32
that made the gathers several times slower than the copy itself. So a cache gathers into
buffers of its own, made once per thread that gathers (one layer's pages, the most a gather
holds unpadded) and reused: what a gather returns is valid until the same thread's next
gather from that cache. Each part (K, V) is selected into a buffer of its own, so that it is
contiguous and NHD's tokens stay a view. Every reader uses a gather at once (attention in the
same layer, the KV checksum in its loop); a thread that reads a cache beside its engine (a
test's checker, say) has buffers of its own. A padded batch larger than the buffer gets a
fresh tensor, as before.
"""

from __future__ import annotations

import threading

import torch


class GatherScratch:
    """Output buffers for one cache, per thread: its selected pages, and (HND) their
    reordering."""

    def __init__(self, layer_like: torch.Tensor) -> None:
        self._like = layer_like  # [num_pages, parts, ...page dims] of one layer
        self._local = threading.local()  # .pages, .reordered: this thread's buffers

    def select(self, layer: torch.Tensor, part: int, page_ids: torch.Tensor) -> torch.Tensor:
        """Part `part` of `layer`'s pages `page_ids`: ``[len(page_ids), ...page dims]``."""
        n = page_ids.numel()
        if n > self._like.shape[0]:
            return layer[:, part].index_select(0, page_ids)
        pages = getattr(self._local, "pages", None)
        if pages is None:  # [parts, num_pages, ...page dims]
            pages = self._local.pages = self._empty(self._like.shape[1], *self._like.shape[:1],
                                                    *self._like.shape[2:])
        out = pages[part, :n]
        torch.index_select(layer[:, part], 0, page_ids, out=out)
        return out

    def reordered(self, part: int, view: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `view` (one part's pages, rearranged) in part `part`'s buffer."""
        if view.numel() > self._like[:, 0].numel():
            return view.contiguous()
        reordered = getattr(self._local, "reordered", None)
        if reordered is None:  # [parts, every element of one part]
            reordered = self._local.reordered = self._empty(self._like.shape[1],
                                                            self._like[:, 0].numel())
        out = reordered[part, :view.numel()].view(view.shape)
        out.copy_(view)
        return out

    def _empty(self, *shape: int) -> torch.Tensor:
        # A plain tensor even when first needed inside a forward's inference mode: an
        # inference tensor could not be written outside it (the KV checksum gathers there).
        with torch.inference_mode(False):
            return torch.empty(shape, dtype=self._like.dtype, device=self._like.device)
