"""`docs/transfer-core.md`, the reference page, never rots: its examples run (tcp on loopback,
the poller, fault injection over the loopback; S5, S4c, S3b), the protocol table names exactly
the members of `Transport`, and `transfer_core/README.md`, the distribution's readme, points
at it."""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from typing import Any

import pytest

from transfer_core.transport import Transport

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "transfer-core.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def test_the_examples_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In order, sharing names: the paged write's counter fires, the poller reports the
    counter's moves, the dropped immediates keep a counter from firing."""
    blocks = FENCE.findall(PAGE.read_text())
    assert len(blocks) == 3
    namespace: dict[str, Any] = {}
    for i, block in enumerate(blocks):
        script = tmp_path / f"reference_block{i}.py"
        script.write_text(block)
        namespace = runpy.run_path(str(script), init_globals=namespace, run_name="__main__")
    out = capsys.readouterr().out
    assert "counter for imm 42 fired: 3 pages landed" in out
    assert "the poller reported [" in out
    assert "immediates dropped: the counter stands at" in out


def test_the_table_names_every_protocol_member() -> None:
    """Each member of `Transport` appears in the protocol table, and nothing else does."""
    table = PAGE.read_text().split("## The `Transport` protocol")[1].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`" in line]
    named = {m for row in rows for m in re.findall(r"`(\w+)", row.split("|")[2])}
    members = {n for n in vars(Transport) if not n.startswith("_")} | set(Transport.__annotations__)
    assert members <= named
    assert named - members <= {"MemoryRegion", "MemoryRegionDescriptor", "PagedWrite"}


def test_the_distribution_readme_points_at_the_reference() -> None:
    """The short readme links the reference page and the example, and repeats no section."""
    readme = (ROOT / "transfer_core" / "README.md").read_text()
    assert "(../docs/transfer-core.md)" in readme
    assert (ROOT / "transfer_core" / "examples" / "two_process.py").exists()
    assert "## " not in readme and "```python" not in readme
