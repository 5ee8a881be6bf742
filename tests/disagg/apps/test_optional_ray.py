"""Ray is the optional `ray` extra: without `--ray` nothing imports it, and `--ray` without it
installed is one line naming the extra.

As in test_optional_matplotlib.py, the checks run in one fresh interpreter whose
`sys.meta_path` refuses `ray` and records every attempt, so even a caught eager import shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

SCRIPT = r'''
import contextlib, io, json, sys

attempts = []

class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ray":
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoRay())
from disagg.apps.cli import main

def run_cli(argv):
    err = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exit_info:
            code = exit_info.code or 0
    return {"code": code, "stderr": err.getvalue()}

report = {"import": list(attempts)}
report["help"] = run_cli(["serve", "cluster", "--help"])["code"]
report["refused"] = run_cli(["serve", "cluster", "--model", "tiny", "--decoders", "0"])
report["before_ray"] = list(attempts)
report["ray"] = run_cli(["serve", "cluster", "--model", "tiny", "--ray", "local"])
print(json.dumps(report))
'''

pytestmark = pytest.mark.slow  # a child interpreter: about 2 s


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_cli_and_serve_cluster_without_ray_never_import_it(report: dict[str, Any]) -> None:
    """Importing the CLI, `serve cluster --help` and a refused `serve cluster`: no attempt."""
    assert report["import"] == []
    assert report["help"] == 0
    assert report["refused"]["code"] == 2
    assert report["before_ray"] == []


def test_ray_without_the_extra_is_one_line_naming_it(report: dict[str, Any]) -> None:
    outcome = report["ray"]
    assert outcome["code"] == 2, outcome["stderr"]
    assert "pip install 'disagg[ray]'" in outcome["stderr"]
    assert len(outcome["stderr"].strip().splitlines()) == 1
