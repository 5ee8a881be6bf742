"""`transfer_core/README.md`, the reference page, never rots: its example runs over tcp on
loopback (S5, S4c), and the protocol table names exactly the members of `Transport`."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from transfer_core.transport import Transport

README = Path(__file__).resolve().parents[2] / "transfer_core" / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def test_the_example_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Register, one paged write carrying 42, the receiver's counter fires."""
    blocks = FENCE.findall(README.read_text())
    assert len(blocks) == 1
    script = tmp_path / "readme_example.py"
    script.write_text(blocks[0])
    runpy.run_path(str(script), run_name="__main__")
    assert "counter for imm 42 fired: 3 pages landed" in capsys.readouterr().out


def test_the_table_names_every_protocol_member() -> None:
    """Each member of `Transport` appears in the protocol table, and nothing else does."""
    table = README.read_text().split("## The `Transport` protocol")[1].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`" in line]
    named = {m for row in rows for m in re.findall(r"`(\w+)", row.split("|")[2])}
    members = {n for n in vars(Transport) if not n.startswith("_")} | set(Transport.__annotations__)
    assert members <= named
    assert named - members <= {"MemoryRegion", "MemoryRegionDescriptor", "PagedWrite"}
