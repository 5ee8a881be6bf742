"""`disagg figures`: the tutorials' pictures, drawn from real runs on this machine (S1-S7).

`runs.py` measures (one node with mixed batches, then a prefiller and a decoder process over
libfabric); `draw.py` and `layout.py` draw. Nothing is made up: every time drawn was measured.
Matplotlib (Agg), an optional extra: `pip install disagg[figures]`.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from disagg.apps.figures.runs import WORKLOAD, run_disaggregated, run_mixed, timeline_from_trace
from disagg.utils.optional_deps import use_matplotlib

logger = logging.getLogger(__name__)


def make_figures(out_dir: Path, model: str = "small") -> list[Path]:
    """Run both setups and write every PNG into `out_dir`; returns their paths."""
    # Before the runs (about a minute): a missing extra must fail fast, in one line.
    use_matplotlib("disagg figures")
    # draw and layout import matplotlib at module level: only here, never from the CLI's import.
    from disagg.apps.figures import draw as figures_draw
    from disagg.apps.figures import layout as figures_layout

    out_dir.mkdir(parents=True, exist_ok=True)
    mixed = run_mixed(model)
    with tempfile.TemporaryDirectory() as tmp:
        trace = run_disaggregated(model, Path(tmp) / "trace.json")
    disaggregated = timeline_from_trace(trace)
    paths = [
        figures_draw.draw_timelines([mixed, disaggregated], out_dir / "mixed-vs-disaggregated.png"),
        figures_draw.draw_lifecycle(trace, "req-1", out_dir / "request-lifecycle.png",
                                    f"request B, a {WORKLOAD[1][1]:,}-token prompt"),
        figures_draw.draw_layer_timeline(trace, "req-1", out_dir / "layer-streaming.png"),
        figures_layout.draw_layouts(out_dir / "nhd-vs-hnd.png"),
        figures_layout.draw_tp_mismatch(out_dir / "tp-mismatch.png"),
    ]
    for path in paths:
        logger.info("wrote %s (%d KB)", path, path.stat().st_size // 1024)
    return paths


def register(app: typer.Typer) -> None:
    """Add the `figures` command to the `disagg` app."""

    @app.command()
    def figures(
        out: Annotated[Path, typer.Option(help="Directory for the PNG files")] = Path("figures"),
        model: Annotated[str, typer.Option(help="Model for the runs: tiny, small, ...")] = "small",
    ) -> None:
        """Draw the tutorials' figures from real runs on this machine (about a minute)."""
        for path in make_figures(out, model):
            typer.echo(str(path))
