"""The picture a reader of the write-up wants: TPS and TTFT versus load, both modes (S1, S9c).

`plot_sweep` draws what `sweep.load_sweep` measured: per-request decode speed, TTFT and the
worst inter-token gaps side by side (matplotlib with the Agg backend: no display needed).
"""

from __future__ import annotations

from pathlib import Path

from disagg.sim.sweep import Sweep
from disagg.utils.optional_deps import use_matplotlib


def plot_sweep(sweep: Sweep, path: Path, title: str) -> Path:
    """Three panels (TPS p50, TTFT p50 and p99, ITL p99) against offered QPS; returns `path`."""
    use_matplotlib("disagg simulate --plot")
    import matplotlib.pyplot as plt  # the optional `figures` extra: imported only to draw

    fig, (tps_ax, ttft_ax, itl_ax) = plt.subplots(1, 3, figsize=(13, 4.2))
    for label, rows in sweep.items():
        qps = [r["qps"] for r in rows]
        line, = tps_ax.plot(qps, [r["tps_per_request_p50"] for r in rows], "o-", label=label)
        color = line.get_color()
        ttft_ax.plot(qps, [r["ttft_ms_p50"] for r in rows], "o-", color=color,
                     label=f"{label} p50")
        ttft_ax.plot(qps, [r["ttft_ms_p99"] for r in rows], "--", color=color,
                     label=f"{label} p99")
        itl_ax.plot(qps, [r["itl_ms_p99"] for r in rows], "o-", color=color, label=label)
    for level in (50, 90):  # the write-up's two marks (S9c)
        tps_ax.axhline(level, color="grey", linewidth=0.8, linestyle=":")
    tps_ax.set(xlabel="offered load (QPS)", ylabel="decode tokens/s per request (p50)",
               title="decode speed")
    ttft_ax.set(xlabel="offered load (QPS)", ylabel="TTFT (ms)", title="time to first token",
                yscale="log")
    itl_ax.set(xlabel="offered load (QPS)", ylabel="inter-token gap p99 (ms)",
               title="stutter")
    for ax in (tps_ax, ttft_ax, itl_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
