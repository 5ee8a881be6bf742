"""The loopback's per-domain counts read back as the real engine's `Stats` (S5 surface)."""

from __future__ import annotations

from transfer_core.testing.loopback_counts import LoopbackCounts


def test_each_domain_counts_its_own_writes_immediates_and_bytes() -> None:
    counts = LoopbackCounts(2)
    counts.posted(1, 5)
    counts.completed(1, 3, nbytes=3 * 4096)
    counts.arrived(0, 7, dropped=False)
    first, second = counts.stats()
    assert (first.writes_posted, first.imms_received, first.inflight) == (0, 7, 0)
    assert (second.writes_posted, second.writes_completed, second.inflight,
            second.bytes_written) == (5, 3, 2, 3 * 4096)


def test_arrivals_a_hook_dropped_are_received_and_counted_as_dropped() -> None:
    counts = LoopbackCounts(1)
    counts.arrived(0, 4, dropped=True)
    counts.arrived(0, 2, dropped=False)
    assert counts.stats()[0].imms_received == 6
    assert counts.hook_dropped == 4
