"""Leftovers of the shm provider: `/dev/shm/<pid>:<ep>:<n>` files of processes that are gone.

libfabric's shm provider (1.17) backs each endpoint with a file named after its process id and
unlinks it when the endpoint closes cleanly. A process killed with SIGKILL cannot: its 16 MiB
file stays until reboot, and enough of them fill /dev/shm. `sweep_dead_shm_files` removes the
files whose process no longer exists; a node calls it before it opens a shm endpoint. Names
it did not write (another program's, a pid no process can have) never make it raise (X5).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from transfer_core.leftovers import dead_leftover

logger = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"([0-9]+):[0-9]+:[0-9]+", re.ASCII)


def sweep_dead_shm_files(directory: Path = SHM_DIR) -> list[str]:
    """Remove shm endpoint files of dead processes owned by this user; returns their names.
    Never raises: other users' and programs' names there are left alone (`dead_leftover`)."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed  # no /dev/shm here: nothing to sweep
    for path in entries:
        match = _NAME.fullmatch(path.name)
        if match is None or not dead_leftover(path, match.group(1)):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # another sweep was first
        except OSError as error:
            logger.warning("could not remove shm file %s: %s", path, error)
            continue
        removed.append(path.name)
    if removed:
        logger.info("removed %d shm file(s) of dead processes: %s", len(removed),
                    ", ".join(removed[:8]))
    return removed
