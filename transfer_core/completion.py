"""How a transfer's end reaches its caller (S5): the callback types, and `Completion`, which
folds the ops of one transfer (one per domain it was striped over) into exactly one
`on_done` or `on_error`. Shared by the libfabric engine (`write_router.py`) and the loopback
test double; the `Transport` protocol names the same types.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from transfer_core.errors import TransferError

OnFinish = Callable[[TransferError | None], None]
OnDone = Callable[[], None]
OnError = Callable[[TransferError], None]


class Completion:
    """Fires exactly one of `on_done` / `on_error` for a transfer made of `parts` ops, once
    every part has finished: a failed part's error waits for the others, because until they
    end the provider may still read the transfer's source memory, which the caller frees when
    it hears of the end (the first error is the one reported)."""

    def __init__(
        self,
        parts: int,
        on_done: OnDone | None,
        on_error: OnError | None,
        report: Callable[[BaseException], None],
    ) -> None:
        self._left = parts
        self._error: TransferError | None = None
        self._lock = threading.Lock()
        self._on_done = on_done
        self._on_error = on_error
        self._report = report

    def part_finished(self, error: TransferError | None) -> None:
        with self._lock:
            self._left -= 1
            self._error = self._error or error
            if self._left:
                return
            error = self._error
        if error is None:
            if self._on_done is not None:
                self._on_done()
        elif self._on_error is not None:
            self._on_error(error)
        else:
            self._report(error)  # nobody listens: surface it on the owner's next call
