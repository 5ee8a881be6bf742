"""The TP leaders' sweep of the shared temporary directory never raises on a foreign name
and removes only this user's directories of dead leaders (X5)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.parallel.ranks import WORKDIR_PREFIX, sweep_dead_workdirs


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def _workdir(root: Path, pid_text: str) -> Path:
    path = root / f"{WORKDIR_PREFIX}{pid_text}-decode-0-abc"
    path.mkdir()
    (path / "store").write_text("x")
    return path


@pytest.mark.parametrize("pid_text", ["99999999999999999999", "", "0", "0042", "\u00b2",
                                      "\u0664\u0662", "4194305"])
def test_a_name_no_leader_wrote_is_left_alone(tmp_path: Path, pid_text: str) -> None:
    """An impossible pid (huge: OverflowError in os.kill; a superscript digit: ValueError in
    int) neither raises nor stops the sweep of a real dead leader's directory."""
    foreign = _workdir(tmp_path, pid_text)
    dead = _workdir(tmp_path, str(_dead_pid()))
    assert sweep_dead_workdirs(str(tmp_path)) == [dead.name]
    assert foreign.exists() and not dead.exists()


def test_another_users_directory_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead leader's directory owned by another uid is not ours to remove."""
    path = _workdir(tmp_path, str(_dead_pid()))
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    assert sweep_dead_workdirs(str(tmp_path)) == []
    assert path.exists()


def test_a_symlink_or_file_under_a_dead_pid_is_kept(tmp_path: Path) -> None:
    """Only real directories: a symlink named like a workdir is never followed to remove
    what it points at, and a plain file of that name stays."""
    dead = _dead_pid()
    root, target = tmp_path / "tmp", tmp_path / "precious"
    root.mkdir()
    target.mkdir()
    (target / "data").write_text("keep me")
    (root / f"{WORKDIR_PREFIX}{dead}-a-b").symlink_to(target, target_is_directory=True)
    (root / f"{WORKDIR_PREFIX}{dead}-c-d").write_text("a file")
    assert sweep_dead_workdirs(str(root)) == []
    assert (target / "data").read_text() == "keep me"
    assert len(list(root.iterdir())) == 2


def test_a_missing_root_sweeps_nothing(tmp_path: Path) -> None:
    """A temporary directory that cannot be listed is reported, not raised."""
    assert sweep_dead_workdirs(str(tmp_path / "absent")) == []
