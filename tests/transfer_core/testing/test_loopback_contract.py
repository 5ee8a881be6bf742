"""Contract: the loopback engine and the real `TransferEngine` (tcp on loopback) observe alike.

One scenario, run on both: register, parse the destination descriptor from bytes as a peer
would, refuse bad page ids with the same errors, count paged writes into shuffled pages one
immediate per page, fire `expect_imm_count` exactly once at the expected count (not before),
keep early arrivals, `remove_imm_count`, stripe over two domains, and answer a write to a
closed peer with exactly one callback. The records must be equal: that is what lets messenger
tests trust `LoopbackEngine` (S5, S4c).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from transfer_core.engine import TransferEngine
from transfer_core.errors import BoundsError, TransferError
from transfer_core.memory import MemoryRegionDescriptor
from transfer_core.testing.loopback import LoopbackEngine, LoopbackFabric
from transfer_core.transport import PagedWrite

PAGE = 512
NUM_PAGES = 32
WAIT_S = 20.0
Factory = Callable[[int], Any]


def _until(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _raises(call: Callable[[], None]) -> str:
    """`type: message` of what `call` raises (it must raise)."""
    try:
        call()
    except (BoundsError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("no exception")


class _Fired:
    """How often a counter callback ran, and on which kind of thread."""

    def __init__(self) -> None:
        self.calls = 0
        self.event = threading.Event()
        self.on_main = False

    def __call__(self) -> None:
        self.calls += 1
        self.on_main = threading.current_thread() is threading.main_thread()
        self.event.set()


def scenario(make: Factory) -> dict[str, Any]:
    """Run the contract on two engines from `make(num_domains)`; return what was observed."""
    rec: dict[str, Any] = {}
    a, b = make(2), make(1)
    try:
        rng = np.random.default_rng(7)
        src = rng.integers(0, 256, (NUM_PAGES, PAGE), dtype=np.uint8)
        dst = np.zeros_like(src)
        smr, _ = a.register_memory(src, name="src")
        _, local = b.register_memory(dst, name="dst")
        desc = MemoryRegionDescriptor.from_bytes(local.to_bytes())
        rec["descriptor_round_trip"] = desc == local and desc.name == "dst"

        def paged(s: Any, d: Any, imm: int | None, on_done: Any = None, on_error: Any = None,
                  timeout_s: float | None = None) -> None:
            write = PagedWrite(smr, s, PAGE, 0, desc, d, PAGE, 0, PAGE, imm)
            a.post_paged_writes(write, on_done, on_error, timeout_s=timeout_s)

        rec["errors"] = [
            _raises(lambda: paged([0, 1, 2], [0, NUM_PAGES, 1], 1)),
            _raises(lambda: paged([0, -1], [0, 1], 1)),
            _raises(lambda: paged([0, 1, 2], [0, 1], 1)),
            _raises(lambda: paged([0], [0], 2**32)),
            _raises(lambda: a.post_write(smr, 0, 2 * PAGE, None, desc, (NUM_PAGES - 1) * PAGE)),
        ]
        rec["after_errors"] = (b.pending_imm_counts(), b.imm_counted(1))

        slots = rng.permutation(NUM_PAGES)
        fired, first = _Fired(), threading.Event()
        b.expect_imm_count(7, 12, fired)
        paged(np.arange(8), slots[:8], 7, on_done=first.set)
        assert first.wait(WAIT_S)
        rec["striped"] = [s.writes_completed for s in a.stats()]
        _until(lambda: b.imm_counted(7) == 8)
        time.sleep(0.05)  # nothing else may arrive: the count must stay short of 12
        rec["part_way"] = (b.imm_counted(7), b.pending_imm_counts(), fired.calls)
        paged(np.arange(8, 12), slots[8:12], 7)
        assert fired.event.wait(WAIT_S)
        time.sleep(0.05)  # a second firing would show now
        rec["reached"] = (fired.calls, fired.on_main, b.pending_imm_counts(), b.imm_counted(7))
        rec["data"] = bool((dst[slots[:12]] == src[:12]).all()) and not dst[slots[12:]].any()

        early, sent = _Fired(), threading.Event()
        paged([12, 13, 14], [0, 1, 2], 11, on_done=sent.set)
        assert sent.wait(WAIT_S)
        _until(lambda: b.imm_counted(11) == 3)
        rec["early_counted"] = b.imm_counted(11)
        b.expect_imm_count(11, 3, early)
        assert early.event.wait(WAIT_S)
        rec["early"] = (early.calls, early.on_main, b.imm_counted(11))

        # Two requests' pages in one write, each page counted under its own value.
        mixed = {21: _Fired(), 22: _Fired()}
        b.expect_imm_count(21, 2, mixed[21])  # striped [21, 21] | [22]: each slice its own
        b.expect_imm_count(22, 1, mixed[22])
        a.post_paged_writes(PagedWrite(smr, [15, 16, 17], PAGE, 0, desc, slots[15:18], PAGE, 0,
                                       PAGE, None, imms=[21, 21, 22]))
        assert mixed[21].event.wait(WAIT_S) and mixed[22].event.wait(WAIT_S)
        time.sleep(0.05)
        rec["per_page_imms"] = (mixed[21].calls, mixed[22].calls, b.imm_counted(21),
                                b.imm_counted(22), bool((dst[slots[15:18]] == src[15:18]).all()))

        paged([0, 1], [3, 4], 9)
        b.expect_imm_count(9, 5, _Fired())
        _until(lambda: b.pending_imm_counts().get(9, (0, 0))[0] == 2)
        rec["removed"] = (b.remove_imm_count(9), b.pending_imm_counts(), b.imm_counted(9))
        rec["removed_again"] = b.remove_imm_count(9)

        # A write to a peer that closed: exactly one callback. Which one is not part of the
        # contract: tcp may report success for bytes that only reached a socket (notes G5).
        b.close()
        calls: list[BaseException | None] = []
        finished = threading.Event()

        def on_error(error: BaseException) -> None:
            calls.append(error)
            finished.set()

        paged([0], [0], 3, on_done=lambda: (calls.append(None), finished.set()),
              on_error=on_error, timeout_s=1.0)  # fmt: skip
        assert finished.wait(WAIT_S)
        time.sleep(0.05)
        rec["closed_peer"] = [len(calls), all(isinstance(c, TransferError | None) for c in calls)]
    finally:
        a.close()
        b.close()
    return rec


def _real(num_domains: int) -> TransferEngine:
    return TransferEngine("tcp", num_domains=num_domains)


def _loopback_factory() -> Factory:
    fabric = LoopbackFabric()
    return lambda num_domains: LoopbackEngine(num_domains=num_domains, fabric=fabric)


@pytest.fixture(
    params=[pytest.param("tcp", marks=pytest.mark.fabric), "loopback"], scope="module"
)
def record(request: pytest.FixtureRequest) -> dict[str, Any]:
    return scenario(_real if request.param == "tcp" else _loopback_factory())


def test_contract_counts(record: dict[str, Any]) -> None:
    """Counting: not before 12, exactly once at 12, on an engine thread; early arrivals
    count; a write's per-page values each count apart; remove_imm_count returns (counted,
    expected) and forgets them."""
    assert record["descriptor_round_trip"]
    assert record["after_errors"] == ({}, 0)
    assert record["striped"] == [4, 4]
    assert record["part_way"] == (8, {7: (8, 12)}, 0)
    assert record["reached"] == (1, False, {}, 0)
    assert record["data"]
    assert record["early_counted"] == 3
    assert record["early"] == (1, False, 0)
    assert record["per_page_imms"] == (1, 1, 0, 0, True)
    assert record["removed"] == ((2, 5), {}, 0)
    assert record["removed_again"] is None
    assert record["closed_peer"] == [1, True]


def test_contract_errors(record: dict[str, Any]) -> None:
    """Bad page ids, mismatched lists, a too-wide imm and a write past the end: same errors."""
    assert record["errors"] == [
        f"BoundsError: region 'dst' ({NUM_PAGES * PAGE} bytes): page {NUM_PAGES} (entry 1) of "
        f"{PAGE} bytes at offset {NUM_PAGES * PAGE} falls outside it",
        f"BoundsError: region 'src' ({NUM_PAGES * PAGE} bytes): page -1 (entry 1) of {PAGE} "
        f"bytes at offset {-PAGE} falls outside it",
        "ValueError: 3 source pages but 2 destination pages",
        f"ValueError: imm_data must fit in 32 bits, got {2**32}",
        f"BoundsError: region 'dst' ({NUM_PAGES * PAGE} bytes): access of {2 * PAGE} bytes at "
        f"offset {(NUM_PAGES - 1) * PAGE} falls outside it",
    ]


@pytest.mark.fabric
def test_real_and_loopback_records_are_equal() -> None:
    """The whole record, side by side: the two engines cannot be told apart by it."""
    assert scenario(_real) == scenario(_loopback_factory())
