"""Optional dependencies: import them where they are used, and say which extra installs them.

matplotlib is only in the `figures` extra (plots are a side feature; servers and benchmarks
must not pull in a GUI toolkit's dependencies). A command that draws calls `use_matplotlib`
before any slow work, so a missing extra is one line and exit code 2, not a traceback after a
minute of measurements.
"""

from __future__ import annotations

from types import ModuleType

from disagg.errors import ConfigError

FIGURES_EXTRA = "disagg[figures]"


def use_matplotlib(what: str) -> ModuleType:
    """matplotlib with the Agg backend (no display needed); `ConfigError` naming the extra
    that installs it when it is missing. `what` names the command, for the message."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(f"{what} needs matplotlib: pip install '{FIGURES_EXTRA}'") from None
    matplotlib.use("Agg")
    return matplotlib
