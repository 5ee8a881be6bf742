"""docs/deploy.md never rots: the blocks it marks as runnable on one machine run, and every
`disagg` command of the other blocks parses.

Convention: a block fenced ```` ```sh ci ```` runs as one bash script (`set -euo pipefail`),
in a fresh directory, with this venv's `disagg` and `ray` first on PATH; it must exit 0 and
leave no node or Ray process behind. The other `sh` blocks need several hosts or SLURM: each
`disagg ...` command in them (continuation lines joined, shell substitutions replaced by a
placeholder) runs with `--help` appended, which fails on an option that does not exist.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disagg.apps.cli import main
from tests.test_tutorials import FENCE

ROOT = Path(__file__).parent.parent
DEPLOY = ROOT / "docs" / "deploy.md"
LEFTOVERS = ("PR_SET_PDEATHSIG", "disagg serve", "raylet", "gcs_server")  # see test_ray_cluster
SUBSTITUTION = re.compile(r"\$\(\([^)]*\)\)|\$\([^)]*\)|\$\{[^}]*\}|\$\w+")

# A stand-in for machines without curl: what the blocks use of it (-s, -f, -H, -d, a URL).
CURL = r'''import sys, urllib.request
args, headers, data, url = sys.argv[1:], {}, None, None
while args:
    arg = args.pop(0)
    if arg == "-H":
        key, value = args.pop(0).split(":", 1); headers[key] = value.strip()
    elif arg == "-d":
        data = args.pop(0).encode()
    elif not arg.startswith("-"):
        url = arg
try:
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=30) as r:
        sys.stdout.write(r.read().decode() + "\n")
except OSError:
    sys.exit(22)
'''


def blocks(info: str) -> list[tuple[int, str]]:
    """(line, code) of every block whose info string is exactly `info`."""
    text = DEPLOY.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(2)) for m in FENCE.finditer(text)
            if m.group(1).strip() == info]


def _leftovers() -> list[str]:
    found = []
    for pattern in LEFTOVERS:
        lines = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True,
                               check=False).stdout.splitlines()
        found += [line for line in lines if "pgrep" not in line]
    return found


def test_deploy_doc_has_one_machine_and_several_host_blocks() -> None:
    """Three runnable blocks (by hand, a Ray cluster, a private Ray), the rest shown only."""
    assert len(blocks("sh ci")) == 3
    assert len(blocks("sh")) >= 4


@pytest.mark.slow  # each block starts processes: 15 to 40 s
@pytest.mark.fabric
@pytest.mark.serial  # another test's nodes would count as this block's leftovers
@pytest.mark.parametrize(("line", "code"), blocks("sh ci"), ids=lambda v: f"line{v}"
                         if isinstance(v, int) else "")
def test_one_machine_block_runs(line: int, code: str, tmp_path: Path) -> None:
    """The block exits 0, and no node, server or Ray process outlives it."""
    assert _leftovers() == [], "processes from before this test"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if shutil.which("curl") is None:
        (bin_dir / "curl").write_text(f"#!{sys.executable}\n{CURL}")
        (bin_dir / "curl").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}")
    env.pop("DISAGG_CLUSTER_SECRET", None)
    work = tmp_path / "work"
    work.mkdir()
    try:
        result = subprocess.run(["bash", "-c", "set -euo pipefail\n" + code], cwd=work, env=env,
                                capture_output=True, text=True, timeout=240, check=False)
    finally:
        if _leftovers():  # a failed block: do not let its processes hold the ports
            subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True,
                           check=False)
    assert result.returncode == 0, f"deploy.md line {line}:\n{result.stderr[-3000:]}"
    assert '"finish_reason":"length"' in result.stdout
    deadline = time.monotonic() + 20
    while _leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _leftovers() == []


def _commands(code: str) -> list[list[str]]:
    """Each `disagg ...` command of a block, its continuation lines joined."""
    joined = code.replace("\\\n", " ")
    return [shlex.split(SUBSTITUTION.sub("X", line.strip()))
            for line in joined.splitlines() if line.strip().startswith("disagg ")]


def test_several_host_commands_use_options_that_exist(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every `disagg` command of the blocks shown only parses (`--help` after its options)."""
    commands = [c for _, code in blocks("sh") for c in _commands(code)]
    assert len(commands) >= 5  # by hand (3), a Ray cluster, SLURM
    for command in commands:
        with pytest.raises(SystemExit) as exit_info:
            main([*command[1:], "--help"])
        assert exit_info.value.code in (0, None), (command, capsys.readouterr().err)
    capsys.readouterr()


def test_slurm_script_parses() -> None:
    [script] = [code for _, code in blocks("sh") if "#SBATCH" in code]
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0
