"""What a command is waiting for, on stderr, while weights load and nodes start (S2).

`StartupProgress` takes `LocalCluster`'s node events (`on_node(name, "starting" | "ready")`)
and the commands' own phases (`phase("loading smollm2-135m")`). On a terminal it is a rich
status line naming what is still pending, and a line per node once ready; elsewhere (a pipe,
a log file, CI) the same lines without the spinner: `prefill-0 ready (12.3 s)`. Never stdout,
which carries what scripts parse (`READY ...`, `--json`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType

from rich.console import Console
from rich.status import Status


class StartupProgress:
    """Startup progress on `console` (stderr's by default): nodes and phases, each timed.
    Once every node of `expect` is ready the status line goes (the command serves on).
    `title` is printed when the first thing begins (not if a check fails before)."""

    def __init__(self, console: Console | None = None, expect: Sequence[str] = (),
                 title: str | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._title = title
        self._status: Status | None = None
        self._pending: dict[str, float] = {}  # what is under way -> when it began
        self._expect = set(expect)

    def __enter__(self) -> StartupProgress:
        if self.console.is_terminal:
            self._status = self.console.status("starting")
            self._status.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop the status line (what is printed stays)."""
        if self._status is not None:
            self._status.stop()
            self._status = None

    def on_node(self, name: str, event: str) -> None:
        """A `LocalCluster` event: node `name` is "starting" (loading its model) or "ready"."""
        if event == "starting":
            self.begin(f"{name} loading its model")
        elif event == "ready":
            self.end(f"{name} loading its model", f"[green]✓[/green] {name} ready")
            self._expect.discard(name)
            if not self._expect and not self._pending:
                self.close()

    @contextmanager
    def phase(self, text: str, done: str | None = None) -> Iterator[None]:
        """A step of the command's own (`loading smollm2-135m`), timed; `done` is printed
        when it ends (nothing if None)."""
        self.begin(text)
        try:
            yield
        finally:
            self.end(text, done)

    def begin(self, what: str) -> None:
        """`what` is under way (shown until `end(what)`)."""
        if self._title is not None:
            self.console.print(self._title, highlight=False)
            self._title = None
        self._pending[what] = time.monotonic()
        self._show()

    def end(self, what: str, line: str | None = None) -> None:
        """`what` is done: print `line` with the seconds it took (nothing if None)."""
        began = self._pending.pop(what, time.monotonic())
        if line is not None:
            self.console.print(f"{line} ({time.monotonic() - began:.1f} s)", highlight=False)
        self._show()

    def _show(self) -> None:
        if self._status is not None and self._pending:
            self._status.update("; ".join(self._pending) + " ...")
