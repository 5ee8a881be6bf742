"""A TP leader's private directory (Unix socket, rendezvous file) never outlives it for long:
one killed with SIGKILL cannot remove it, so the next leader does (S5a)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from disagg.parallel.ranks import WORKDIR_PREFIX, sweep_dead_workdirs


def test_a_dead_leaders_directory_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    """A leader killed with SIGKILL leaves its socket directory; the next leader removes it
    (the pid in its name is gone) and leaves a live leader's alone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{WORKDIR_PREFIX}{gone.pid}-decode-0-abc"
    live = tmp_path / f"{WORKDIR_PREFIX}{os.getpid()}-decode-1-def"
    other = tmp_path / "disagg-trace-123"
    for directory in (dead, live, other):
        directory.mkdir()
        (directory / "store").write_text("x")
    assert sweep_dead_workdirs(str(tmp_path)) == [dead.name]
    assert not dead.exists() and live.exists() and other.exists()
