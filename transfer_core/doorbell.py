"""`Doorbell`: what a counter's writer on a CPU thread rings after each bump, so that a
`CounterPoller` sleeps until then instead of waking on a timer (S3b).

A poller that naps wakes its core thousands of times a second; on a core it shares with a
forward, those wake-ups alone made a SmolLM2 prefill 14% slower. With a doorbell the poller
sleeps on a futex and the writer's ring (an atomic add and a FUTEX_WAKE, a microsecond) wakes
it; `tc_bell_wait`'s comment says why no ring is lost. A GPU kernel cannot ring: counters
bumped inside a CUDA graph are polled as before.
"""

from __future__ import annotations

from typing import Any

from transfer_core._poller import ffi, lib


class Doorbell:
    """A 32-bit futex word: `ring()` after each bump of the counters a poller watches."""

    def __init__(self) -> None:
        self._word = ffi.new("uint32_t *")

    def ring(self) -> None:
        lib.tc_ring(self._word)

    @property
    def word(self) -> Any:
        """The C word `tc_bell_wait` sleeps on."""
        return self._word
