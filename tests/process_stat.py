"""What /proc/PID/stat says of a process, for tests that check who forked whom and whether a
process (no child of theirs) has ended."""

from __future__ import annotations

import time
from pathlib import Path


def stat_fields(pid: int) -> list[str]:
    """The fields after the command name (which may hold spaces): state, ppid, pgrp, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent_of(pid: int) -> int:
    return int(stat_fields(pid)[1])


def ended_within(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` is gone or a zombie within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if stat_fields(pid)[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False
