"""Leftovers of the shm provider: `/dev/shm/<pid>:<ep>:<n>` files of processes that are gone.

libfabric's shm provider (1.17) backs each endpoint with a file named after its process id and
unlinks it when the endpoint closes cleanly. A process killed with SIGKILL cannot: its 16 MiB
file stays until reboot, and enough of them fill /dev/shm. `sweep_dead_shm_files` removes the
files whose process no longer exists; a node calls it before it opens a shm endpoint.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^(\d+):\d+:\d+$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive, and not ours to judge
    return True


def sweep_dead_shm_files(directory: Path = SHM_DIR) -> list[str]:
    """Remove shm endpoint files of dead processes owned by this user; returns their names."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed  # no /dev/shm here: nothing to sweep
    for path in entries:
        match = _NAME.match(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
            path.unlink()
        except OSError:
            continue  # gone meanwhile, or not ours to remove
        removed.append(path.name)
    if removed:
        logger.info("removed %d shm file(s) of dead processes: %s", len(removed),
                    ", ".join(removed[:8]))
    return removed
