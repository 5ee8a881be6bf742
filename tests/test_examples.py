"""Every example script runs to the end on the CPU (they are the tutorials' code)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("[0-9][0-9]_*.py"))


# Examples that take several seconds (they run real processes) stay out of the inner loop.
SLOW = {"05_request_lifecycle", "06_sharding_and_layouts", "08_failure_handling",
        "11_prefix_caching", "12_latent_attention_and_experts",  # 06 and 12 start TP ranks
        "13_engine_speed"}  # 132 MB of weights, decoded twice


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW else p for p in EXAMPLES
], ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The example exits cleanly and prints something."""
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out.strip()
