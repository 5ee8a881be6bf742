"""Named counters that several threads add to (a messenger's engine, poller and completion
threads); read by the node's metrics."""

from __future__ import annotations

import threading
from collections.abc import Iterator


class Tally:
    """A fixed set of named integer counters, each `add` atomic."""

    def __init__(self, *names: str) -> None:
        self._values = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    def add(self, **amounts: int) -> None:
        """Add to the named counters (a name not declared is a `KeyError`)."""
        with self._lock:
            for name, amount in amounts.items():
                if name not in self._values:
                    raise KeyError(f"no counter {name!r}; there are {sorted(self._values)}")
                self._values[name] += amount

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)
