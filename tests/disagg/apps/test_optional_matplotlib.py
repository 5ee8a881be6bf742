"""matplotlib is the optional `figures` extra: the CLI works without it, and the two commands
that draw refuse in one line that names the extra, before any slow work.

The checks run in one fresh interpreter (importing torch costs seconds, so once), because this
process may have matplotlib imported already and an import cannot be undone. There a
`sys.meta_path` finder makes every `import matplotlib...` raise ImportError, as on a machine
without the extra, and records the attempt, so an eager import that is caught still shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXTRA_HINT = "needs matplotlib: pip install 'disagg[figures]'"

SCRIPT = r'''
import contextlib, io, json, sys

attempts = []

class NoMatplotlib:
    """Finder that refuses matplotlib and its submodules, as if the extra were missing."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "matplotlib":
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoMatplotlib())
report = {}

import disagg.apps.cli
from disagg.apps.cli import main
from disagg.apps.figures import commands
from disagg.errors import ConfigError

report["import_attempts"] = list(attempts)


def run_cli(argv):
    err = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exit_info:
            code = exit_info.code or 0
        except Exception as error:  # an escaped ImportError: record it, check the rest
            code = f"{type(error).__name__}: {error}"
    return {"code": code, "stderr": err.getvalue()}


report["help"] = [run_cli(argv)["code"] for argv in
                  (["--help"], ["figures", "--help"], ["simulate", "--help"])]

def refuse(*args, **kwargs):
    raise AssertionError("measured before checking matplotlib")

commands.run_mixed = commands.run_disaggregated = refuse
try:
    commands.make_figures(__import__("pathlib").Path("out"), "tiny")
    report["make_figures"] = "no error"
except ConfigError as error:
    report["make_figures"] = "ConfigError: " + str(error)
except Exception as error:
    report["make_figures"] = f"{type(error).__name__}: {error}"
report["figures"] = run_cli(["figures", "--out", "out", "--model", "tiny"])
report["simulate"] = run_cli(["simulate", "--plot", "sweep.png", "--duration", "5"])
print(json.dumps(report))
'''


pytestmark = pytest.mark.slow  # a child interpreter without matplotlib: about 2 s


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the interpreter without matplotlib saw; its cwd is an empty directory."""
    cwd = tmp_path_factory.mktemp("no-matplotlib")
    # A bound, so a regression that runs the measurements first cannot hang the suite.
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=cwd, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return {**json.loads(result.stdout.splitlines()[-1]), "files": sorted(
        str(p.relative_to(cwd)) for p in Path(cwd).rglob("*"))}


def test_importing_the_cli_does_not_try_matplotlib(report: dict[str, Any]) -> None:
    """`import disagg.apps.cli` (every command registered) never tries to import matplotlib."""
    assert report["import_attempts"] == []


def test_help_works_without_matplotlib(report: dict[str, Any]) -> None:
    """`disagg --help`, `disagg figures --help` and `disagg simulate --help` exit 0."""
    assert report["help"] == [0, 0, 0]


def test_make_figures_raises_config_error_naming_the_extra(report: dict[str, Any]) -> None:
    """The library entry point raises ConfigError (not ImportError) before measuring."""
    assert report["make_figures"] == f"ConfigError: disagg figures {EXTRA_HINT}"


@pytest.mark.parametrize("command", ["figures", "simulate"])
def test_drawing_commands_exit_2_with_one_line(command: str, report: dict[str, Any]) -> None:
    """`disagg figures` and `disagg simulate --plot`: exit code 2 and one line naming the
    extra (brackets included: the CLI must not read them as rich markup), nothing written."""
    outcome = report[command]
    assert outcome["code"] == 2, outcome["stderr"]
    assert EXTRA_HINT in outcome["stderr"]
    assert len(outcome["stderr"].strip().splitlines()) == 1
    assert report["files"] == []  # refused before measuring or writing anything
