"""Drawing the measured runs of `runs.py`: timelines, a request's lifecycle, layer streaming
(S1, S2, S3, S4).

Each function takes what a run recorded (a `Timeline`, or a merged trace from `trace_merge`)
and writes one PNG. Nothing here measures or computes serving behaviour; it only lays out
times that were measured.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from disagg.apps.figures.runs import Timeline

PREFILL_COLOR = "#e8833a"  # a step holding prefill tokens
DECODE_COLOR = "#3a7bd5"  # a step of decodes only
WAIT_COLOR = "#d9d9d9"
REQUEST_COLORS = ["#2a9d8f", "#8e44ad", "#c0392b"]
DPI = 100


def save_png(fig: plt.Figure, path: Path) -> Path:
    """Write `fig` as a PNG at the figures' resolution and close it."""
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _gap_summary(request_ms: list[float]) -> str:
    gaps = [b - a for a, b in zip(request_ms, request_ms[1:], strict=False)]
    if not gaps:
        return ""
    return (f"{len(request_ms)} tokens, last at {request_ms[-1]:.0f} ms; gaps: median "
            f"{statistics.median(gaps):.0f} ms, longest {max(gaps):.0f} ms")


def draw_timelines(timelines: list[Timeline], path: Path) -> Path:
    """One panel per run: each request's wait and tokens, then each node's steps."""
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 2.1 * len(timelines) + 1.2),
                             sharex=True, squeeze=False)
    for ax, timeline in zip(axes[:, 0], timelines, strict=True):
        labels = []
        rows = [*[r.name for r in timeline.requests], *timeline.lanes]
        for row, request in enumerate(timeline.requests):
            y = len(rows) - 1 - row
            first = request.token_ms[0] if request.token_ms else request.submit_ms
            ax.broken_barh([(request.submit_ms, first - request.submit_ms)], (y - 0.3, 0.6),
                           color=WAIT_COLOR)
            ax.vlines(request.token_ms, y - 0.3, y + 0.3, color=REQUEST_COLORS[row % 3],
                      linewidth=1)
            ax.text(max(request.token_ms or [first]) + 15, y, _gap_summary(request.token_ms),
                    va="center", fontsize=8)
            labels.append(f"request {request.name}")
        for lane_index, (lane, steps) in enumerate(timeline.lanes.items()):
            y = len(timeline.lanes) - 1 - lane_index
            bars = [(s.start_ms, max(s.end_ms - s.start_ms, 0.3)) for s in steps]
            colors = [PREFILL_COLOR if s.prefill_tokens else DECODE_COLOR for s in steps]
            ax.broken_barh(bars, (y - 0.3, 0.6), color=colors, edgecolor="white",
                           linewidth=0.3)
            labels.append(f"{lane} steps")
        ax.set_yticks(range(len(rows) - 1, -1, -1), labels)
        ax.set_title(timeline.title, fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    end = max(max(r.token_ms, default=0) for t in timelines for r in t.requests)
    axes[-1, 0].set_xlim(-end * 0.01, end * 1.62)  # room for the summaries on the right
    axes[-1, 0].set_xlabel("ms since the three requests arrived")
    fig.legend(handles=[Patch(color=WAIT_COLOR, label="waiting for its first token"),
                        Patch(color=PREFILL_COLOR, label="step with prefill tokens"),
                        Patch(color=DECODE_COLOR, label="step of decodes only")],
               loc="lower center", bbox_to_anchor=(0.5, -0.06), ncols=3, fontsize=9,
               frameon=False)
    fig.suptitle("Three requests arrive together, measured on this machine: each tick is a "
                 "token reaching the client", x=0.01, ha="left", fontsize=11)
    return save_png(fig, path)


def _spans(trace: dict[str, Any], name: str, request_id: str) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["name"] == name and e["ph"] != "M"
            and e.get("args", {}).get("request_id") == request_id]


def _one(trace: dict[str, Any], name: str, request_id: str) -> dict[str, Any]:
    found = _spans(trace, name, request_id)
    if not found:
        raise ValueError(f"the trace has no {name!r} event for {request_id}")
    return found[0]


def _overlapping(trace: dict[str, Any], start: float, end: float) -> list[dict[str, Any]]:
    """Spans (ph X) that overlap `[start, end]`."""
    return [e for e in trace["traceEvents"] if e["ph"] == "X"
            and e["ts"] <= end and e["ts"] + e["dur"] >= start]


def draw_lifecycle(trace: dict[str, Any], request_id: str, path: Path, label: str = "") -> Path:
    """A sequence diagram of one request across router, decoder and prefiller, each step
    labelled with its measured time (ms since submission). Rows are in order, not to scale."""
    t0 = _one(trace, "submit", request_id)["ts"]
    kv_wait = _one(trace, "kv_wait", request_id)
    queue = _one(trace, "queue", request_id)
    prefill = _one(trace, "prefill", request_id)
    tail = _one(trace, "transfer_tail", request_id)
    first = _one(trace, "first_token", request_id)
    done = _one(trace, "done", request_id)
    writes = max((e["args"].get(request_id, 0) for e in trace["traceEvents"]
                  if e["name"] == "kv_writes_landed"), default=0)
    prefill_end = prefill["ts"] + prefill["dur"]
    chunks = sum(1 for e in _overlapping(trace, prefill["ts"], prefill_end)
                 if e["name"] == "step" and _process(trace, e).startswith("prefill"))

    def ms(ts: float) -> str:
        return f"{(ts - t0) / 1e3:.0f} ms"

    x = {"router": 0.0, "decoder": 1.0, "prefiller": 2.0}
    steps = [  # (from, to, label); to == from: something happening on one node
        ("router", "decoder", f"1  Submit: the router picks the least-loaded decoder ({ms(t0)})"),
        ("decoder", "prefiller", "2  decoder pins pages, arms a counter for "
         f"{writes} writes, sends KVRequest ({ms(kv_wait['ts'])})"),
        ("prefiller", "prefiller", "3  prefiller queues it until its scheduler takes a first "
         f"chunk: {queue['dur'] / 1e3:.0f} ms"),
        ("prefiller", "decoder", f"4  prefill in {chunks} chunks; after each layer its pages "
         f"are RDMA-written ({ms(prefill['ts'])} to {ms(prefill_end)})"),
        ("prefiller", "decoder", "5  last pages + context slot written; tail "
         f"{tail['dur'] / 1e3:.1f} ms; prefiller frees its pages"),
        ("decoder", "decoder", f"6  counter reaches {writes}: request joins the decode batch "
         f"({ms(kv_wait['ts'] + kv_wait['dur'])})"),
        ("decoder", "router", f"7  first token (TTFT {ms(first['ts'])})"),
        ("decoder", "router", f"8  last token, done ({ms(done['ts'])})"),
    ]
    fig, ax = plt.subplots(figsize=(11, 5.2))
    for name, pos in x.items():
        ax.plot([pos, pos], [0.3, len(steps) + 0.7], color="#999999", linewidth=1, zorder=0)
        ax.text(pos, len(steps) + 0.9, name, ha="center", fontsize=11, weight="bold")
    for row, (src, dst, text) in enumerate(steps):
        y = len(steps) - row
        if src == dst:
            ax.plot([x[src]], [y], marker="o", color=PREFILL_COLOR if src == "prefiller"
                    else DECODE_COLOR, markersize=9)
        elif row == 3:  # the streamed writes: many of them, while the prefill runs
            for dy in (-0.24, -0.12, 0.0, 0.12, 0.24):
                ax.annotate("", xy=(x[dst], y + dy), xytext=(x[src], y + dy),
                            arrowprops={"arrowstyle": "->", "linewidth": 0.8,
                                        "color": PREFILL_COLOR})
        else:
            ax.annotate("", xy=(x[dst], y), xytext=(x[src], y),
                        arrowprops={"arrowstyle": "->", "linewidth": 1.5,
                                    "color": "#333333"})
        ax.text(2.15, y, text, va="center", fontsize=9)
    ax.set_xlim(-0.2, 6.4)
    ax.set_ylim(0.2, len(steps) + 1.2)
    ax.axis("off")
    ax.set_title(f"One request's life: {label or request_id} (times measured from its "
                 "submission; rows in order, not to scale)", loc="left", fontsize=11)
    return save_png(fig, path)


def _process(trace: dict[str, Any], event: dict[str, Any]) -> str:
    for meta in trace["traceEvents"]:
        if meta["name"] == "process_name" and meta["pid"] == event["pid"]:
            return meta["args"]["name"]
    return ""


def draw_layer_timeline(trace: dict[str, Any], request_id: str, path: Path) -> Path:
    """Per layer, the prefiller's forward (cut at the counter bumps) and the moment that
    layer's writes were posted, over the forwards that prefilled `request_id`."""
    prefill = _one(trace, "prefill", request_id)
    kv_wait = _one(trace, "kv_wait", request_id)
    start, end = prefill["ts"], prefill["ts"] + prefill["dur"]
    layers = [e for e in _overlapping(trace, start, end) if e.get("cat") == "layer"]
    posts = [e for e in trace["traceEvents"] if e["name"] == "layer_writes_posted"
             and any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] + 1 for s in layers)]
    if not layers:
        raise ValueError(f"the trace has no per-layer spans during {request_id}'s prefill")
    start = min(e["ts"] for e in layers)
    forwards = sorted({e["args"]["forward"] for e in layers})
    num_layers = 1 + max(e["args"]["layer"] for e in layers)
    fig, ax = plt.subplots(figsize=(11, 3.6))
    for e in layers:
        color = REQUEST_COLORS[forwards.index(e["args"]["forward"]) % 2]
        ax.broken_barh([((e["ts"] - start) / 1e3, e["dur"] / 1e3)],
                       (e["args"]["layer"] - 0.35, 0.7), color=color, alpha=0.75)
    ax.scatter([(e["ts"] - start) / 1e3 for e in posts], [e["args"]["layer"] for e in posts],
               marker="v", color="black", s=18, zorder=3, label="that layer's page writes posted")
    landed = (kv_wait["ts"] + kv_wait["dur"] - start) / 1e3
    ax.axvline(landed, color=DECODE_COLOR, linestyle="--", linewidth=1.2)
    last = max((e["ts"] + e["dur"] - start) / 1e3 for e in layers)
    ax.set_xlim(-0.02 * max(landed, last), 1.03 * max(landed, last))
    ax.text(landed, -0.5, "decoder's counter full: request ready to decode ",
            color=DECODE_COLOR, fontsize=8, va="bottom", ha="right")
    ax.set_yticks(range(num_layers), [f"layer {i}" for i in range(num_layers)])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms since the first forward holding {request_id} began ({len(forwards)} "
                  "forwards, alternating colours; bars cut at the layer-counter bumps)")
    ax.set_title("Layer by layer: each layer's pages leave as soon as its attention is done",
                 loc="left", fontsize=11)
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.06), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return save_png(fig, path)
