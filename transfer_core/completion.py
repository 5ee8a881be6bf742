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
    """Fires exactly one of `on_done` / `on_error` for a transfer made of `parts` ops."""

    def __init__(
        self,
        parts: int,
        on_done: OnDone | None,
        on_error: OnError | None,
        report: Callable[[BaseException], None],
    ) -> None:
        self._left = parts
        self._failed = False
        self._lock = threading.Lock()
        self._on_done = on_done
        self._on_error = on_error
        self._report = report

    def part_finished(self, error: TransferError | None) -> None:
        with self._lock:
            if self._failed:
                return
            if error is None:
                self._left -= 1
                if self._left:
                    return
            else:
                self._failed = True
        if error is None:
            if self._on_done is not None:
                self._on_done()
        elif self._on_error is not None:
            self._on_error(error)
        else:
            self._report(error)  # nobody listens: surface it on the owner's next call
