"""Who takes part when a request is forked into its `n` parallel samples (S8, X6c): every KV
cache copies the partly computed last page, and whatever keeps per-request state (the token
chooser's grammar, an MTP head's position) starts the forks' own.

The scheduler forks (`forking.py`); the engine's parts and its plug-ins register here when
they are built, before the first step, so the scheduler calls one place and knows none of them.
"""

from __future__ import annotations

from collections.abc import Callable

from disagg.engine.forking import CopyPage
from disagg.engine.request import Request

OnFork = Callable[[Request, list[Request]], None]  # (parent, its forks in index order)


class ForkHooks:
    """The page copiers and fork listeners of one engine."""

    def __init__(self) -> None:
        self._copiers: list[CopyPage] = []
        self._listeners: list[OnFork] = []

    def add(self, copy_page: CopyPage | None = None, on_fork: OnFork | None = None) -> None:
        """Register a KV cache's page copy and/or a listener (at build time)."""
        if copy_page is not None:
            self._copiers.append(copy_page)
        if on_fork is not None:
            self._listeners.append(on_fork)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page `src` to `dst` in every registered cache."""
        for copy in self._copiers:
            copy(src, dst)

    def on_fork(self, parent: Request, forks: list[Request]) -> None:
        """Tell every listener, in registration order, before any fork samples."""
        for listener in self._listeners:
            listener(parent, forks)
