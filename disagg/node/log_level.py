"""How loudly a process logs: `--log-level` of the serve commands, and the environment
variable that carries it to every node process they start (S2).

A node process gets its `NodeConfig` on stdin and its environment from its parent, so the
level travels as `DISAGG_LOG_LEVEL` (as the cluster secret does), and no config grows a
field that has nothing to do with serving.
"""

from __future__ import annotations

import logging
import os

from disagg.errors import ConfigError

LOG_LEVEL_ENV = "DISAGG_LOG_LEVEL"
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"


def check_log_level(name: str) -> int:
    """The `logging` level `name` stands for, or a `ConfigError` naming it.

    >>> check_log_level("warning") == logging.WARNING
    True
    """
    if name.lower() not in LOG_LEVELS:
        raise ConfigError(f"unknown log level {name!r}: expected one of {', '.join(LOG_LEVELS)}")
    return logging.getLevelNamesMapping()[name.upper()]


def node_log_level() -> int:
    """The level a node process logs at: its parent's `DISAGG_LOG_LEVEL`, else info."""
    return check_log_level(os.environ.get(LOG_LEVEL_ENV) or DEFAULT_LOG_LEVEL)
