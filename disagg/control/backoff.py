"""Waits between reconnection attempts to a lost peer: doubling from `FIRST_S` up to `MAX_S`
(X4d; the router's decoders and a decoder's prefillers both use it)."""

from __future__ import annotations

from dataclasses import dataclass

FIRST_S = 0.5
MAX_S = 8.0


@dataclass
class Backoff:
    """The next wait, doubling after each failed attempt, never over `max_s`."""

    first_s: float = FIRST_S
    max_s: float = MAX_S
    wait_s: float = 0.0

    def __post_init__(self) -> None:
        self.wait_s = self.wait_s or self.first_s

    def next(self) -> float:
        """The wait before this attempt; the one after it doubles."""
        wait, self.wait_s = self.wait_s, min(2 * self.wait_s, self.max_s)
        return wait
