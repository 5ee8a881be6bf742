"""Sweeps of shared directories never raise on foreign names and take only this user's
leftovers of dead processes (X5)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer_core.leftovers import PID_LIMIT, dead_leftover, pid_in_name
from transfer_core.shm_sweep import sweep_dead_shm_files

FOREIGN_PIDS = ["99999999999999999999", "-5", "0", "0042", "\u0664\u0662", "\u00b2", "+7",
                " 7", "4194305", ""]


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


@pytest.mark.parametrize("text", FOREIGN_PIDS)
def test_names_no_process_wrote_carry_no_pid(text: str) -> None:
    """Huge, negative, zero, zero-padded, non-ASCII or signed: not a pid."""
    assert pid_in_name(text) is None


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=30))
def test_any_name_is_judged_without_raising(text: str) -> None:
    """Whatever the text, the answer is a pid in range or None, and a leftover check says
    no for a path that does not exist."""
    pid = pid_in_name(text)
    assert pid is None or 0 < pid <= PID_LIMIT
    assert not dead_leftover(Path("/nonexistent-dir-of-this-test") / "x", text)


def test_foreign_shm_names_are_left_and_never_raise(tmp_path: Path) -> None:
    """Among names with impossible pids, only the dead process's endpoint file goes."""
    dead = _dead_pid()
    foreign = [f"{text}:0:0" for text in FOREIGN_PIDS if text] + [f"{dead}:0", f"{dead}:x:0"]
    for name in [*foreign, f"{dead}:0:0"]:
        (tmp_path / name).write_bytes(b"x")
    assert sweep_dead_shm_files(tmp_path) == [f"{dead}:0:0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(foreign)


def test_another_users_shm_file_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead process's file owned by another uid is not ours to remove."""
    name = f"{_dead_pid()}:0:0"
    (tmp_path / name).write_bytes(b"x")
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)  # the file now belongs to someone else
    assert sweep_dead_shm_files(tmp_path) == []
    assert (tmp_path / name).exists()


def test_a_symlink_or_directory_under_a_dead_pid_is_kept(tmp_path: Path) -> None:
    """Only regular files: a symlink is never followed out of the directory, nor removed."""
    dead = _dead_pid()
    shm, outside = tmp_path / "shm", tmp_path / "outside"
    shm.mkdir()
    outside.write_bytes(b"keep me")
    (shm / f"{dead}:0:0").symlink_to(outside)
    (shm / f"{dead}:0:1").mkdir()
    assert sweep_dead_shm_files(shm) == []
    assert outside.read_bytes() == b"keep me"
    assert sorted(p.name for p in shm.iterdir()) == [f"{dead}:0:0", f"{dead}:0:1"]


def test_a_missing_directory_sweeps_nothing(tmp_path: Path) -> None:
    """No /dev/shm (macOS, a container without it): nothing to do, no error."""
    assert sweep_dead_shm_files(tmp_path / "absent") == []
