"""What a `LoopbackEngine` counts per domain (S5 surface): writes posted and completed,
immediates received, bytes that landed, and arrivals a test's `drop_imm` hook lost; read back
as the real engine's `Stats` (no EAGAIN, no posts pending in a provider here)."""

from __future__ import annotations

import threading

from transfer_core.pyfabric import Stats


class LoopbackCounts:
    """Per-domain counters, safe from any thread (writes complete on the sender's delivery
    thread, immediates arrive on the receiver's)."""

    def __init__(self, num_domains: int) -> None:
        self._lock = threading.Lock()
        self._rows = [[0, 0, 0, 0] for _ in range(num_domains)]  # posted, done, imms, bytes
        self._hook_dropped = 0

    def posted(self, domain: int, n: int) -> None:
        with self._lock:
            self._rows[domain][0] += n

    def completed(self, domain: int, n: int, nbytes: int = 0) -> None:
        """`n` writes done at the sender, `nbytes` of them landed (0: none did)."""
        with self._lock:
            self._rows[domain][1] += n
            self._rows[domain][3] += nbytes

    def arrived(self, domain: int, count: int, dropped: bool) -> None:
        """`count` immediates reached `domain`; `dropped`: a test hook lost them."""
        with self._lock:
            self._rows[domain][2] += count
            self._hook_dropped += count if dropped else 0

    @property
    def hook_dropped(self) -> int:
        return self._hook_dropped

    def stats(self) -> list[Stats]:
        with self._lock:
            return [Stats(p, c, 0, i, 0, 0, p - c, b) for p, c, i, b in self._rows]
