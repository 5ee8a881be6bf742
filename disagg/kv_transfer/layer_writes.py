"""A chunk's writes of one layer, as few paged writes as its plan allows (S3b, S6).

A request's plan (`transfer_plan.plan_request`) may cut a page into many writes: with
mismatched TP, each destination rank gets its heads of K and of V, and with NHD a segment per
token (256 writes per page for TP 1 -> 8). Write s of the plan reads `src_offset_s` bytes into
the source page and lands `dst_offset_s` bytes into the destination page. The writes that
share their ranks, size and domains go out as ONE paged write per layer: its "page ids" are
byte offsets inside the layer with a stride of 1, so write (page p, segment s) reads
`p * src_page_nbytes + src_offset_s` and lands at `p * dst_page_nbytes + dst_offset_s`. The
bytes moved and the immediates the decoder counts are the plan's, write for write; what
shrinks is the number of calls the layer poller makes per layer (S3b), from one per write of
the plan to one per rank pair. The offsets are computed once per chunk, not per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from disagg.kv_transfer.transfer_plan import PageWrite


@dataclass(frozen=True, slots=True, eq=False)  # arrays inside: compared by identity
class LayerWrite:
    """`num_writes` writes of `nbytes` from source rank `src_rank`'s KV region to destination
    rank `dst_rank`'s, at these byte offsets inside a layer (int64, page-major)."""

    src_rank: int
    dst_rank: int
    nbytes: int
    domains: tuple[int, ...] | None
    src_offsets: np.ndarray
    dst_offsets: np.ndarray

    @property
    def num_writes(self) -> int:
        return len(self.src_offsets)


def layer_writes(page_writes: Sequence[PageWrite], src_page_ids: Sequence[int],
                 dst_page_ids: Sequence[int], src_page_nbytes: int, dst_page_nbytes: int
                 ) -> list[LayerWrite]:
    """The plan's writes of these pages, grouped by (ranks, size, domains), in plan order.

    >>> plan = [PageWrite(0, 0, 0, 0, 8), PageWrite(0, 64, 0, 32, 8), PageWrite(0, 8, 1, 0, 8)]
    >>> a, b = layer_writes(plan, [2, 5], [0, 1], 128, 64)
    >>> a.src_offsets.tolist(), a.dst_offsets.tolist()  # page 2 (K, V), then page 5
    ([256, 320, 640, 704], [0, 32, 64, 96])
    >>> b.dst_rank, b.src_offsets.tolist(), b.num_writes
    (1, [264, 648], 2)
    """
    groups: dict[tuple[int, int, int, tuple[int, ...] | None], list[PageWrite]] = {}
    for w in page_writes:
        groups.setdefault((w.src_rank, w.dst_rank, w.nbytes, w.domains), []).append(w)
    src_pages = np.asarray(src_page_ids, dtype=np.int64)[:, None] * src_page_nbytes
    dst_pages = np.asarray(dst_page_ids, dtype=np.int64)[:, None] * dst_page_nbytes
    out = []
    for (src_rank, dst_rank, nbytes, domains), writes in groups.items():
        src = src_pages + np.array([w.src_offset for w in writes], dtype=np.int64)
        dst = dst_pages + np.array([w.dst_offset for w in writes], dtype=np.int64)
        out.append(LayerWrite(src_rank, dst_rank, nbytes, domains, src.ravel(), dst.ravel()))
    return out
