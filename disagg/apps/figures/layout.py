"""Drawing where KV bytes live and who sends them: NHD versus HND, TP mismatch (S6, S7).

`draw_layouts` lays out one page of the `tiny` model in both layouts and brackets the byte
runs `PagedKVCache.page_segments` returns for a TP=2 rank's heads (the writes that rank
needs), next to whole-request write counts. `draw_tp_mismatch` draws, from the transfer
planner, which prefiller rank writes which heads to which decoder rank when the two sides
shard differently. The numbers are computed by the project's own code, never typed in.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from disagg.apps.figures.draw import DECODE_COLOR, PREFILL_COLOR, save_png
from disagg.config import CacheConfig, ModelConfig
from disagg.kv_transfer.transfer_plan import plan_page_writes
from disagg.model.kv_cache import PagedKVCache
from disagg.model.page_geometry import PageGeometry
from disagg.model.sharding import Sharding

RANK_COLORS = ["#2a9d8f", "#b8860b", "#8e44ad", "#c0392b"]


def _cell_order(kv_layout: str, page_size: int, num_heads: int) -> list[tuple[int, int, int]]:
    """(kv, token, head) of each head-of-a-token cell, in memory order."""
    if kv_layout == "NHD":
        return [(kv, t, h) for kv in range(2) for t in range(page_size) for h in range(num_heads)]
    return [(kv, t, h) for kv in range(2) for h in range(num_heads) for t in range(page_size)]


def _draw_page(ax: plt.Axes, kv_layout: str, y: float) -> int:
    """One page of layer 0 as a strip of cells; rank 0's runs bracketed below it."""
    model = ModelConfig.from_name("tiny")  # 4 KV heads
    cache = PagedKVCache(model, CacheConfig(page_size=4, num_pages=1, kv_layout=kv_layout))
    cell = model.head_dim * cache.element_size  # bytes of one head of one token
    for i, (_, token, head) in enumerate(_cell_order(kv_layout, 4, model.num_kv_heads)):
        rank = head // 2
        ax.add_patch(Rectangle((i, y), 1, 1, facecolor=RANK_COLORS[rank] if rank == 0
                               else "#eeeeee", edgecolor="white"))
        ax.text(i + 0.5, y + 0.5, f"t{token}\nh{head}", ha="center", va="center", fontsize=7)
    for kv, name in enumerate("KV"):
        ax.text(16 * kv + 8, y + 1.15, f"{name} half", ha="center", fontsize=8)
    runs = cache.page_segments(0, 0, head_start=0, head_end=2)
    for number, run in enumerate(runs, start=1):
        first, count = run.offset // cell, run.nbytes // cell
        ax.plot([first + 0.1, first + count - 0.1], [y - 0.25, y - 0.25], color="black",
                linewidth=2.5)
        ax.text(first + count / 2, y - 0.6, str(number), ha="center", fontsize=7)
    ax.text(-0.5, y + 0.5, kv_layout, ha="right", va="center", fontsize=11, weight="bold")
    ax.text(32.5, y + 0.5, f"{len(runs)} writes", va="center", fontsize=10)
    return len(runs)


def draw_layouts(path: Path) -> Path:
    """NHD versus HND: one page's bytes and TP=2 rank 0's writes; then whole-request counts."""
    fig, (strip, bars) = plt.subplots(2, 1, figsize=(12, 6.6), height_ratios=[1.5, 1])
    _draw_page(strip, "NHD", 3.0)
    _draw_page(strip, "HND", 0.6)
    strip.set_xlim(-2.5, 36)
    strip.set_ylim(-0.3, 4.5)
    strip.axis("off")
    strip.set_title("One page of one layer in memory order (tiny model: 4 KV heads, 4-token "
                    "pages; t = token, h = head).\nColoured: heads 0-1, the share of a TP=2 rank; "
                    "each bracket is one contiguous run, so one RDMA write", loc="left",
                    fontsize=10)
    # A 4,000-token prompt on a 30-layer model with 8 KV heads, 16-token pages (S7): a
    # prefiller holding whole pages sends each decoder rank its heads.
    model = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=30,
                        num_heads=8, num_kv_heads=8, head_dim=128, name="example")
    pages = -(-4000 // 16)
    labels, counts = [], {"NHD": [], "HND": []}
    for tp in (1, 2, 4, 8):
        labels.append(f"decoder TP={tp}")
        for kv_layout in ("NHD", "HND"):
            cache = PagedKVCache(model, CacheConfig(page_size=16, num_pages=1,
                                                    kv_layout=kv_layout))
            per_rank = sum(len(cache.page_segments(0, 0, r * 8 // tp, (r + 1) * 8 // tp))
                           for r in range(tp))
            counts[kv_layout].append(per_rank * pages * model.num_layers)
    xs = range(len(labels))
    for offset, (kv_layout, color) in zip((-0.2, 0.2), (("NHD", PREFILL_COLOR),
                                                        ("HND", DECODE_COLOR)), strict=True):
        heights = counts[kv_layout]
        bars.bar([x + offset for x in xs], heights, width=0.4, color=color, label=kv_layout)
        for x, h in zip(xs, heights, strict=True):
            bars.text(x + offset, h * 1.15, f"{h:,}", ha="center", fontsize=8)
    bars.set_yscale("log")
    bars.set_ylim(1e3, 1e8)
    bars.set_xticks(list(xs), labels)
    bars.set_ylabel("writes per request")
    bars.legend(frameon=False, fontsize=9)
    bars.set_title("Writes to move a 4,000-token prompt from whole pages to each decoder rank's "
                   "heads (30 layers, 8 KV heads, 16-token pages)", loc="left", fontsize=10)
    return save_png(fig, path)


def _mismatch_panel(ax: plt.Axes, src: Sharding, dst: Sharding, case: str) -> None:
    geometry = {layout: PageGeometry(layout, page_size=16, head_dim=128, element_size=2)
                for layout in ("NHD", "HND")}
    plans = {layout: plan_page_writes(src, dst, g) for layout, g in geometry.items()}
    for side, sharding, x in (("prefiller", src, 0.0), ("decoder", dst, 3.0)):
        for rank in range(sharding.tp):
            y = (sharding.tp - 1 - rank) * 4 / sharding.tp + 2 / sharding.tp
            heads = sharding.heads_of(rank)
            ax.add_patch(Rectangle((x - 0.5, y - 0.35), 1.0, 0.7, facecolor="#f4f4f4",
                                   edgecolor="#555555"))
            ax.text(x, y, f"rank {rank}\nheads {heads.start}-{heads.stop - 1}", ha="center",
                    va="center", fontsize=8)
        ax.text(x, 4.3, f"{side} TP={sharding.tp}", ha="center", fontsize=9, weight="bold")
    pairs = sorted({(w.src_rank, w.dst_rank) for w in plans["HND"]})
    for src_rank, dst_rank in pairs:
        y0 = (src.tp - 1 - src_rank) * 4 / src.tp + 2 / src.tp
        y1 = (dst.tp - 1 - dst_rank) * 4 / dst.tp + 2 / dst.tp
        ax.annotate("", xy=(2.5, y1), xytext=(0.5, y0),
                    arrowprops={"arrowstyle": "->", "color": RANK_COLORS[src_rank % 4],
                                "linewidth": 1.6})
        moved = [h for h in dst.heads_of(dst_rank) if h in src.heads_of(src_rank)]
        n = {layout: sum(1 for w in plan if (w.src_rank, w.dst_rank) == (src_rank, dst_rank))
             for layout, plan in plans.items()}
        # The label sits just above its arrow, before the arrowheads crowd together.
        ax.text(1.4, y0 + (y1 - y0) * 0.45 + 0.16,
                f"heads {moved[0]}-{moved[-1]}: {n['HND']} | {n['NHD']}", ha="center",
                fontsize=7, color=RANK_COLORS[src_rank % 4],
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    ax.set_title(f"{case}\n{len(plans['HND'])} writes per page in HND, {len(plans['NHD'])} in NHD",
                 fontsize=9)
    ax.set_xlim(-0.8, 3.8)
    ax.set_ylim(-0.2, 4.6)
    ax.axis("off")


def draw_tp_mismatch(path: Path) -> Path:
    """Who writes what when prefiller and decoder shard 8 KV heads differently (S6a, S6b)."""
    cases = [(Sharding(2, 8), Sharding(2, 8), "same sharding: rank i to rank i (S6a)"),
             (Sharding(4, 8), Sharding(2, 8), "more prefiller shards: pages rebuilt (S6b)"),
             (Sharding(2, 8), Sharding(4, 8), "more decoder shards: pages split (S6b)")]
    fig, axes = plt.subplots(1, len(cases), figsize=(12, 4.6))
    for ax, (src, dst, case) in zip(axes, cases, strict=True):
        _mismatch_panel(ax, src, dst, case)
    fig.suptitle("TP mismatch, from the transfer planner: arrows are rank pairs, labelled "
                 "'heads moved: writes per page HND | NHD' (8 KV heads, 16-token pages)",
                 x=0.01, y=1.06, ha="left", fontsize=10)
    return save_png(fig, path)
