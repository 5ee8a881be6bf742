"""`disagg plan`: what one page costs to move between two shardings, NHD against HND (S6, S7).

Pure arithmetic over `transfer_plan.plan_page_writes`: per (source rank, destination rank)
pair the writes and bytes of one page of one layer, and for a whole prompt the totals in both
layouts, so the lesson of S7 (HND moves a rank's heads in one write) shows as numbers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from disagg.config import ModelConfig
from disagg.kv_transfer.transfer_plan import num_pages, plan_page_writes
from disagg.model.page_geometry import PageGeometry
from disagg.model.sharding import Sharding


def plan_report(model: ModelConfig, prefill: Sharding, decode: Sharding, kv_layout: str,
                page_size: int, element_size: int, prompt_tokens: int) -> dict[str, Any]:
    """The plan of one page, per rank pair, plus totals for a prompt in NHD and in HND."""
    pairs: Counter[tuple[int, int]] = Counter()
    nbytes: Counter[tuple[int, int]] = Counter()
    geometry = PageGeometry(kv_layout, page_size, model.head_dim, element_size, model.kv_parts)
    for write in plan_page_writes(prefill, decode, geometry):
        pairs[(write.src_rank, write.dst_rank)] += 1
        nbytes[(write.src_rank, write.dst_rank)] += write.nbytes
    pages = num_pages(max(prompt_tokens - 1, 1), page_size)
    totals = {}
    for layout in ("NHD", "HND"):
        per_page = len(plan_page_writes(prefill, decode, PageGeometry(
            layout, page_size, model.head_dim, element_size, model.kv_parts)))
        totals[layout] = {"writes_per_page": per_page,
                          "writes_per_prompt": per_page * pages * model.num_layers}
    return {
        "model": model.name, "kv_layout": kv_layout, "page_size": page_size,
        "prefill": {"tp": prefill.tp, "replicated": prefill.replicated},
        "decode": {"tp": decode.tp, "replicated": decode.replicated},
        "num_kv_heads": model.num_kv_heads, "prompt_tokens": prompt_tokens,
        "pages": pages, "num_layers": model.num_layers,
        "pairs": [{"src_rank": s, "dst_rank": d, "writes": pairs[(s, d)],
                   "bytes": nbytes[(s, d)]} for s, d in sorted(pairs)],
        "layouts": totals,
    }
