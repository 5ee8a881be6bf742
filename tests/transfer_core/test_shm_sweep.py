"""The sweep of shm endpoint files left by killed processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transfer_core.shm_sweep import sweep_dead_shm_files


def test_only_files_of_dead_processes_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    files = {name: tmp_path / name for name in (f"{dead.pid}:0:0", f"{os.getpid()}:0:0",
                                                "not-an-endpoint", f"{dead.pid}-x")}
    for path in files.values():
        path.write_bytes(b"x")
    assert sweep_dead_shm_files(tmp_path) == [f"{dead.pid}:0:0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{os.getpid()}:0:0", "not-an-endpoint", f"{dead.pid}-x"])


@pytest.mark.fabric
@pytest.mark.slow  # a real child process that imports the engine: about 0.4 s
def test_a_killed_shm_process_leaves_a_file_the_sweep_removes() -> None:
    """SIGKILL leaves `/dev/shm/<pid>:0:0` (libfabric cannot unlink it); the sweep does."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from transfer_core.engine import TransferEngine\n"
        "engine = TransferEngine('shm')\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "up"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    left = Path(f"/dev/shm/{child.pid}:0:0")
    deadline = time.monotonic() + 5
    while not left.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left.exists(), "libfabric's shm file is not where the sweep looks"
    assert f"{child.pid}:0:0" in sweep_dead_shm_files()
    assert not left.exists()
