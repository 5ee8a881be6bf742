"""Whether a file or directory named after a process is a leftover this process may remove (X5).

Killed processes leave files named after their pid (libfabric's shm endpoints in `/dev/shm`, a
TP leader's directory in `/tmp`), and the next process sweeps them. Those directories are
shared with every user and program of the machine, so a sweep meets names it did not write: a
pid of twenty digits, a negative one, non-ASCII digits. `dead_leftover` says yes only to a
name whose pid is spelled as `str(pid)` spells it, whose process is gone, and to an entry of
the expected kind (not a symlink) owned by this user; it never raises on a foreign name.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PID_LIMIT = 2**22  # Linux's PID_MAX_LIMIT: no process id is larger on any system we run on


def pid_in_name(text: str) -> int | None:
    """The process id `text` spells, or None when no process could have written it.

    >>> pid_in_name("4242"), pid_in_name("99999999999999999999"), pid_in_name("-5")
    (4242, None, None)
    >>> pid_in_name("0042"), pid_in_name("\u0664\u0662"), pid_in_name("0")
    (None, None, None)
    """
    # ASCII only: str.isdigit and int() also take other scripts' digits, which no pid has.
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(PID_LIMIT)):
        return None
    pid = int(text)
    return pid if str(pid) == text and 0 < pid <= PID_LIMIT else None


def process_is_gone(pid: int) -> bool:
    """Whether no process has id `pid` (one we may not signal is someone else's: alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # EPERM: it exists under another user
    return False


def owned_by_us(path: Path, directory: bool) -> bool:
    """Whether `path` is a regular file (or, with `directory`, a directory) of this user; a
    symlink never is, so a sweep never follows one out of its directory."""
    try:
        info = os.lstat(path)
    except OSError:
        return False  # gone meanwhile
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    return kind_ok and info.st_uid == os.getuid()


def dead_leftover(path: Path, pid_text: str, directory: bool = False) -> bool:
    """Whether `path`, whose name carries `pid_text`, is this user's and its process gone."""
    pid = pid_in_name(pid_text)
    return pid is not None and owned_by_us(path, directory) and process_is_gone(pid)
