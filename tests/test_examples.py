"""Every example script runs to the end on the CPU (they are the tutorials' code)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The example exits cleanly and prints something."""
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out.strip()
