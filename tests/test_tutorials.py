"""The tutorials never rot: their code blocks run, and what they point at exists.

Convention for `docs/tutorials/NN-*.md`: a fenced block whose info string is `python` runs.
The runnable blocks of one tutorial run in order and share their names, like notebook cells,
so a later block may use what an earlier one defined. ```` ```python norun ```` shows Python
without running it; blocks marked `console`, `text` or nothing are shown only (commands,
outputs). Each tutorial's `examples/NN_*.py` and `../figures/*.png` references must exist.
"""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent.parent
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("[0-9][0-9]-*.md"))
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def runnable_blocks(markdown: str) -> list[tuple[int, str]]:
    """(line number, code) of every block fenced as ```python (not `python norun`)."""
    blocks = []
    for match in FENCE.finditer(markdown):
        info = match.group(1).split()
        if info[:1] == ["python"] and "norun" not in info[1:]:
            blocks.append((markdown.count("\n", 0, match.start()) + 2, match.group(2)))
    return blocks


def run_blocks(markdown: str, where: str, workdir: Path) -> dict[str, Any]:
    """Run the runnable blocks in order in one namespace; returns the final namespace."""
    namespace: dict[str, Any] = {}
    for line, code in runnable_blocks(markdown):
        # A file per block, so a traceback names the tutorial line the block starts on.
        script = workdir / f"{Path(where).stem}_line{line}.py"
        script.write_text(code)
        namespace = runpy.run_path(str(script), init_globals=namespace, run_name="__main__")
    return namespace


def test_parser_picks_python_blocks_only() -> None:
    """Only ```python blocks run; norun, console and bare blocks are shown only."""
    markdown = ("```python\nx = 1\n```\n\n```python norun\nboom()\n```\n"
                "```console\n$ boom\n```\n```\nboom\n```\n```python\ny = x + 1\n```\n")
    assert runnable_blocks(markdown) == [(2, "x = 1\n"), (15, "y = x + 1\n")]


def test_blocks_share_names_and_failures_surface(tmp_path: Path) -> None:
    """A later block sees an earlier block's names; a failing block fails the run."""
    assert run_blocks("```python\nx = 2\n```\n```python\ny = x * 3\n```\n", "t.md",
                      tmp_path)["y"] == 6
    with pytest.raises(ZeroDivisionError):
        run_blocks("```python\n1 / 0\n```\n", "t.md", tmp_path)


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_code_runs(path: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """Every runnable block of the tutorial runs without error."""
    run_blocks(path.read_text(), path.name, tmp_path)
    capsys.readouterr()


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_references_exist(path: Path) -> None:
    """The examples and figures a tutorial names are in the repository."""
    text = path.read_text()
    examples = re.findall(r"examples/\d\d_[\w]+\.py", text)
    figures = re.findall(r"\]\((\.\./figures/[\w.-]+\.png)\)", text)
    missing = [e for e in examples if not (ROOT / e).is_file()]
    missing += [f for f in figures if not (path.parent / f).is_file()]
    assert not missing, f"{path.name} points at missing files: {missing}"
