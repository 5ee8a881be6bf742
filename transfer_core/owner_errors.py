"""Errors of engine threads kept for the engine's owner (S5).

A user callback's exception, or a failure nobody listened for (no `on_error`), must not vanish
on an engine thread: it is logged, kept, and raised by the owner's next engine call. Both
`TransferEngine` and the loopback test double use this, so a messenger sees such failures the
same way on either.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class OwnerErrors:
    """Errors kept until `raise_first` (the owner's next call) raises them, oldest first."""

    def __init__(self, engine: str = "transfer engine") -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []

    def raise_first(self) -> None:
        with self._lock:
            if self._errors:
                raise self._errors.pop(0)

    def report(self, error: BaseException) -> None:
        logger.error("%s: %s", self._engine, error)
        with self._lock:
            self._errors.append(error)

    def guard(self, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback(*args)`; an exception is logged and kept for the owner."""
        try:
            callback(*args)
        except Exception as exc:
            logger.exception("%s callback failed", self._engine)
            self.report(exc)
