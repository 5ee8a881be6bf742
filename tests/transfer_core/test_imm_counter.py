"""Unit tests of `ImmCounterMap` (S4c): expected counts, early arrivals, exactly-once firing,
taps on arriving batches, and the bound on values nobody expects (S5); `random_imm`."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest

from transfer_core.imm_counter import Due, ImmCounterMap, random_imm


class _Recorder:
    """A callback that counts how often it ran."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_fires_once_when_expected_count_reached() -> None:
    """The callback runs at the n-th arrival, not before."""
    counters, hit = ImmCounterMap(), _Recorder()
    counters.expect(7, 3, hit)
    counters.on_imm(7)
    counters.on_imm(7)
    assert hit.calls == 0
    counters.on_imm(7)
    assert hit.calls == 1


def test_counter_is_removed_after_firing() -> None:
    """Later arrivals of the same value do not fire the old callback again."""
    counters, hit = ImmCounterMap(), _Recorder()
    counters.expect(7, 1, hit)
    counters.on_imm(7)
    counters.on_imm(7)
    assert hit.calls == 1
    assert counters.pending() == {}


def test_arrivals_before_expectation_count() -> None:
    """Writes that land before `expect` count towards it; reaching it fires at once."""
    counters, hit = ImmCounterMap(), _Recorder()
    counters.on_imm(9, 4)
    counters.expect(9, 4, hit)
    assert hit.calls == 1
    assert counters.counted(9) == 0


def test_partial_early_arrivals_then_rest() -> None:
    """Some writes before `expect`, the rest after: fires once at the total."""
    counters, hit = ImmCounterMap(), _Recorder()
    counters.on_imm(5, 2)
    counters.expect(5, 5, hit)
    counters.on_imm(5, 2)
    assert hit.calls == 0
    counters.on_imm(5)
    assert hit.calls == 1


def test_batched_arrivals_past_expectation_keep_surplus() -> None:
    """A batch overshooting the expectation fires once and keeps the surplus counted."""
    counters, hit = ImmCounterMap(), _Recorder()
    counters.expect(3, 2, hit)
    counters.on_imm(3, 5)
    assert hit.calls == 1
    assert counters.counted(3) == 3


def test_values_are_independent() -> None:
    """Arrivals of one value never advance another's counter."""
    counters, a, b = ImmCounterMap(), _Recorder(), _Recorder()
    counters.expect(1, 2, a)
    counters.expect(2, 2, b)
    counters.on_imm(1, 2)
    assert (a.calls, b.calls) == (1, 0)


def test_replacing_expectation_returns_previous_and_drops_it() -> None:
    """pplx semantics: re-expecting returns (counted, expected) and discards the old one."""
    counters, old, new = ImmCounterMap(), _Recorder(), _Recorder()
    assert counters.expect(4, 3, old) is None
    counters.on_imm(4)
    assert counters.expect(4, 2, new) == (1, 3)
    counters.on_imm(4, 2)
    assert (old.calls, new.calls) == (0, 1)


def test_remove_returns_state_and_forgets() -> None:
    """remove() reports (counted, expected), then neither callback nor count survive."""
    counters, hit = ImmCounterMap(), _Recorder()
    counters.expect(8, 3, hit)
    counters.on_imm(8)
    assert counters.remove(8) == (1, 3)
    counters.on_imm(8, 3)
    assert hit.calls == 0
    assert counters.remove(8) is None


@pytest.mark.parametrize("count", [0, -1])
def test_rejects_non_positive_count(count: int) -> None:
    """An expected count below one is a caller bug."""
    with pytest.raises(ValueError, match="expected count"):
        ImmCounterMap().expect(1, count, _Recorder())


def test_callbacks_go_through_fire_hook() -> None:
    """The engine routes callbacks to its thread via `fire`; nothing runs inline."""
    queued: list = []
    counters, hit = ImmCounterMap(fire=queued.append), _Recorder()
    counters.expect(1, 1, hit)
    counters.on_imm(1)
    assert hit.calls == 0
    assert len(queued) == 1
    queued[0]()
    assert hit.calls == 1


def test_taps_see_each_batch_first_in_order() -> None:
    """`on_imms` passes a batch through every tap, in the order added, and counts what the
    last one returns: a tap may drop arrivals (none of 5) or add some (3 become 6)."""
    counters, seen = ImmCounterMap(), []
    counters.tap(lambda batch: (seen.append(("first", list(batch))), batch)[1])
    counters.tap(lambda batch: [(imm, 2 * n) for imm, n in batch if imm != 5])
    counters.tap(lambda batch: (seen.append(("last", list(batch))), batch)[1])
    counters.on_imms([(5, 4), (6, 3)])
    assert seen == [("first", [(5, 4), (6, 3)]), ("last", [(6, 6)])]
    assert (counters.counted(5), counters.counted(6)) == (0, 6)


def test_concurrent_arrivals_fire_each_counter_once() -> None:
    """Four threads deliver shuffled arrivals of 50 values: every counter fires exactly once."""
    counters = ImmCounterMap()
    hits = {imm: _Recorder() for imm in range(50)}
    lock = threading.Lock()

    def locked(rec: _Recorder) -> Callable[[], None]:
        def fire() -> None:
            with lock:
                rec()

        return fire

    arrivals = [imm for imm in range(50) for _ in range(40)]
    random.Random(0).shuffle(arrivals)
    for imm in range(0, 50, 2):  # half expected up front, half after the arrivals started
        counters.expect(imm, 40, locked(hits[imm]))
    threads = [
        threading.Thread(target=lambda s=s: [counters.on_imm(i) for i in arrivals[s::4]])
        for s in range(4)
    ]
    for t in threads:
        t.start()
    for imm in range(1, 50, 2):
        counters.expect(imm, 40, locked(hits[imm]))
    for t in threads:
        t.join()
    assert all(h.calls == 1 for h in hits.values())
    assert counters.pending() == {}


# Immediates nobody expects (S5): kept for a while, bounded, then dropped and counted.


class _Clock:
    """A settable monotonic clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_unexpected_values_are_bounded_and_dropped() -> None:
    """At most `max_unarmed` distinct unexpected values are kept; arrivals of further values
    are dropped and counted. Armed values are never limited; a kept value still counts."""
    counters, hit = ImmCounterMap(max_unarmed=3), _Recorder()
    counters.expect(100, 2, hit)
    for imm in range(1, 11):
        counters.on_imm(imm, 2)
    assert (counters.unarmed(), counters.dropped) == (3, 14)
    assert [counters.counted(i) for i in (1, 2, 3, 4)] == [2, 2, 2, 0]
    counters.on_imm(2)  # a kept value keeps counting
    counters.on_imm(100, 2)  # an armed one is not limited
    assert (hit.calls, counters.counted(2)) == (1, 3)
    counters.expect(1, 2, hit)  # an early arrival that is later armed still counts
    assert (hit.calls, counters.unarmed()) == (2, 2)


def test_unexpected_values_expire() -> None:
    """Arrivals nobody armed within the TTL are dropped (and counted): a later expectation of
    that value starts from zero, and their slot is free again."""
    clock = _Clock()
    counters, hit = ImmCounterMap(max_unarmed=2, unarmed_ttl_s=10.0, clock=clock), _Recorder()
    counters.on_imm(7, 3)
    clock.now = 5.0
    counters.on_imm(8)
    clock.now = 12.0
    counters.on_imm(9)  # 7 expires, making room for 9
    assert (counters.counted(7), counters.counted(9), counters.dropped) == (0, 1, 3)
    counters.expect(8, 1, hit)  # 8 is 7 s old: still counts
    assert hit.calls == 1
    counters.expect(7, 3, hit)
    assert (hit.calls, counters.pending()) == (1, {7: (0, 3)})


def test_surplus_arrivals_are_bounded_too() -> None:
    """Arrivals past a fired expectation become unexpected ones, under the same bound."""
    counters, hit = ImmCounterMap(max_unarmed=1), _Recorder()
    counters.on_imm(1)
    counters.expect(2, 1, hit)
    counters.on_imm(2, 4)
    assert (hit.calls, counters.counted(2), counters.dropped) == (1, 0, 3)


def test_random_imm_is_never_zero_and_avoids_values_in_use() -> None:
    """Random 32-bit values, never 0, none that `in_use` claims; a full space raises."""
    values = {random_imm(lambda _: False) for _ in range(200)}
    assert len(values) == 200 and 0 not in values and max(values) <= 2**32 - 1
    assert max(values) > 2**24  # not sequential from 1
    taken = set(values)
    assert random_imm(taken.__contains__) not in taken
    with pytest.raises(RuntimeError, match="no free immediate"):
        random_imm(lambda _: True)


def test_soon_values_turn_the_hook_on_until_the_last_one_goes() -> None:
    """`on_soon(Due.SOON)` when the first armed value is marked soon, `on_soon(Due.IDLE)` when
    the last one leaves, whichever way: fired, removed or replaced by a new expectation."""
    seen: list[Due] = []
    counters = ImmCounterMap(on_soon=seen.append)
    for imm in (1, 2, 3):
        counters.expect(imm, 2, _Recorder())
    assert [counters.soon(imm) for imm in (1, 2, 3, 1)] == [True] * 4
    assert (seen, counters.soon_count()) == ([Due.SOON], 3)
    counters.on_imm(1, 2)  # fired
    counters.remove(2)
    assert (seen, counters.soon_count()) == ([Due.SOON], 1)
    counters.expect(3, 5, _Recorder())  # replaced: the new expectation is not soon
    assert (seen, counters.soon_count()) == ([Due.SOON, Due.IDLE], 0)


def test_the_hook_follows_the_most_urgent_value_due() -> None:
    """One value due at once among values due soon makes the engine poll (`Due.NOW`); once it
    fires, the others keep it at SOON; marking a value again never makes it less urgent."""
    seen: list[Due] = []
    counters = ImmCounterMap(on_soon=seen.append)
    for imm in (1, 2):
        counters.expect(imm, 1, _Recorder())
    counters.soon(1)
    counters.soon(2, Due.NOW)
    counters.soon(2)  # still NOW
    assert seen == [Due.SOON, Due.NOW]
    counters.on_imm(2)
    assert seen == [Due.SOON, Due.NOW, Due.SOON]
    counters.remove(1)
    assert seen == [Due.SOON, Due.NOW, Due.SOON, Due.IDLE]
    with pytest.raises(ValueError, match="not IDLE"):
        counters.soon(1, Due.IDLE)


def test_soon_ignores_a_value_with_no_expectation() -> None:
    """A value that fired already (its last writes came first) or was never armed changes
    nothing."""
    seen: list[bool] = []
    counters = ImmCounterMap(on_soon=seen.append)
    counters.expect(4, 1, _Recorder())
    counters.on_imm(4)
    assert (counters.soon(4), counters.soon(5), seen, counters.soon_count()) == (
        False, False, [], 0)


def test_the_due_levels_are_the_c_workers_levels() -> None:
    """`Due` is pure Python (the counter map imports no binding); the values it hands the
    engine's workers are the C shim's FABP_DUE_* levels."""
    from transfer_core.pyfabric import lib

    assert (Due.IDLE, Due.SOON, Due.NOW) == (0, lib.FABP_DUE_SOON, lib.FABP_DUE_NOW)
