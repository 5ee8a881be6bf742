"""`name_current_thread`: the calling thread's name as the OS shows it (`top -H`, `ps -L`,
`perf`, `/proc/PID/task/TID/comm`).

Python's thread names stay inside Python (before 3.14); the transfer core's threads (the
counter poller, each domain's progress loop) share their process's cores with the work they
serve, and whoever measures who takes a core from whom (`/proc/.../schedstat` per thread) has
only the OS's names to go by. Linux keeps 15 bytes of a name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15
_NAME_BYTES = 15


def name_current_thread(name: str) -> bool:
    """Give the calling thread `name` (its first 15 bytes) in the OS; False where it cannot
    (not Linux, or the call failed): a name is a convenience, never a reason to fail."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    raw = name.encode("utf-8", "replace")[:_NAME_BYTES]
    return libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0
