"""Ray is the optional `ray` extra: without `--ray` nothing imports it, and `--ray` without it
installed is one line naming the extra.

The checks run in one fresh interpreter (this one may have imported ray already), where
`ray` is None in `sys.modules` and every `import ray...` is recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

SCRIPT = r'''
import builtins, contextlib, io, json, sys

# None in sys.modules: `import ray` fails as on a machine without it. The wrapper around
# __import__ records every attempt, so an eager import that someone catches still shows.
sys.modules["ray"] = None
attempts, real_import = [], builtins.__import__

def recording_import(name, *args, **kwargs):
    if name.partition(".")[0] == "ray":
        attempts.append(name)
    return real_import(name, *args, **kwargs)

builtins.__import__ = recording_import
from disagg.apps.cli import main
report = {"import": list(attempts)}
for key, argv in (("help", ["--help"]), ("refused", ["--model", "tiny", "--decoders", "0"]),
                  ("ray", ["--model", "tiny", "--ray", "local"])):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main(["serve", "cluster", *argv])
        except SystemExit as exit_info:
            report[key] = {"code": exit_info.code or 0, "stderr": err.getvalue(),
                           "attempts": list(attempts)}
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
    assert report["help"]["code"] == 0
    assert report["refused"]["code"] == 2
    assert report["refused"]["attempts"] == []


def test_ray_without_the_extra_is_one_line_naming_it(report: dict[str, Any]) -> None:
    outcome = report["ray"]
    assert outcome["code"] == 2, outcome["stderr"]
    assert outcome["attempts"] == ["ray"]
    assert "pip install 'disagg[ray]'" in outcome["stderr"]
    assert len(outcome["stderr"].strip().splitlines()) == 1
