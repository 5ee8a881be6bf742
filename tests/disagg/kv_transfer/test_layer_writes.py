"""A layer's writes grouped per rank pair move exactly the plan's bytes (S3b, S6).

Each grouped write is expanded back into (source rank, destination rank, source byte,
destination byte, size, domains) and compared with the plan's writes taken page by page, as
the streamer posted them before grouping: the same set, write for write.
"""

from __future__ import annotations

import random

import pytest

from disagg.kv_transfer.layer_writes import layer_writes
from disagg.kv_transfer.transfer_plan import plan_request
from disagg.model.page_geometry import PageGeometry
from disagg.model.sharding import Sharding

SRC_PAGES, DST_PAGES = [7, 2, 9], [0, 4, 1]


def _page_by_page(plan, geometry_src: int, geometry_dst: int) -> list[tuple]:
    return sorted((w.src_rank, w.dst_rank, s * geometry_src + w.src_offset,
                   d * geometry_dst + w.dst_offset, w.nbytes, w.domains)
                  for w in plan for s, d in zip(SRC_PAGES, DST_PAGES, strict=True))


def _grouped(groups) -> list[tuple]:
    return sorted((g.src_rank, g.dst_rank, int(s), int(d), g.nbytes, g.domains)
                  for g in groups for s, d in zip(g.src_offsets, g.dst_offsets, strict=True))


@pytest.mark.parametrize(("src_tp", "dst_tp", "layout", "domains"), [
    (1, 1, "NHD", None), (1, 8, "NHD", None), (8, 1, "NHD", None), (1, 2, "HND", None),
    (2, 4, "NHD", [(0, 1), (2, 3)]), (4, 2, "HND", [(0,), (1,), (2,), (3,)]),
])
def test_grouped_writes_are_the_plans_writes(src_tp: int, dst_tp: int, layout: str,
                                             domains: list[tuple[int, ...]] | None) -> None:
    geometry = PageGeometry(layout, page_size=4, head_dim=8, element_size=2)
    ours, theirs = Sharding(src_tp, 8), Sharding(dst_tp, 8)
    plan = plan_request(ours, theirs, geometry, random.Random(3), domains)
    src_page, dst_page = geometry.page_nbytes(8 // src_tp), geometry.page_nbytes(8 // dst_tp)
    groups = layer_writes(plan, SRC_PAGES, DST_PAGES, src_page, dst_page)
    assert _grouped(groups) == _page_by_page(plan, src_page, dst_page)


def test_a_page_cut_into_many_writes_costs_one_call_per_rank_pair() -> None:
    """TP 1 -> 8, NHD: 256 writes per page (a segment per token, K and V, rank), 8 calls."""
    geometry = PageGeometry("NHD", page_size=16, head_dim=128, element_size=2)
    plan = plan_request(Sharding(1, 8), Sharding(8, 8), geometry, random.Random(0))
    groups = layer_writes(plan, SRC_PAGES, DST_PAGES, geometry.page_nbytes(8),
                          geometry.page_nbytes(1))
    assert (len(plan), len(groups)) == (256, 8)
    assert sum(g.num_writes for g in groups) == 256 * len(SRC_PAGES)
