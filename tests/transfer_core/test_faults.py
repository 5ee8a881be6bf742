"""`FaultyTransport`: faults injected over any `Transport`, on the request data path only (S5).

A write without an immediate is a handshake's ownership proof (`ContextSlots.write_proof`):
posted as it is, and not counted as an operation, so a fault plan never stops a node joining.
The receiver's faults act on the wrapped engine's arrivals (a tap on its counters, S4c).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from transfer_core.engine import TransferEngine
from transfer_core.errors import TransferTimeoutError
from transfer_core.faults import FaultPlan, FaultyTransport
from transfer_core.testing.loopback import LoopbackEngine, LoopbackFabric
from transfer_core.transport import PagedWrite, Transport

PAGE = 64


def _pair(plan: FaultPlan, faulty_side: str) -> tuple[Any, Any]:
    """Two loopback engines, one of them (`faulty_side`: "sender" or "receiver") wrapped."""
    fabric = LoopbackFabric()
    a = LoopbackEngine(fabric=fabric, deliver_inline=True)
    b = LoopbackEngine(fabric=fabric, deliver_inline=True)
    if faulty_side == "sender":
        return FaultyTransport(a, plan), b
    return a, FaultyTransport(b, plan)


def _paged(a: Transport, b: Transport, pages: int, imm: int) -> PagedWrite:
    src, _ = a.register_memory(np.ones(pages * PAGE, np.uint8))
    _, desc = b.register_memory(np.zeros(pages * PAGE, np.uint8))
    ids = np.arange(pages)
    return PagedWrite(src, ids, PAGE, 0, desc, ids, PAGE, 0, PAGE, imm)


def test_parse_reads_the_serve_flag() -> None:
    """`--faults seed=1,drop_imm=0.01,stop_after=50`: ints and floats; unknown names refused."""
    assert FaultPlan.parse("seed=1,drop_imm=0.01,stop_after=50") == FaultPlan(
        seed=1, drop_imm=0.01, stop_after=50
    )
    assert FaultPlan.parse("") == FaultPlan()
    with pytest.raises(ValueError, match="unknown fault 'lose'"):
        FaultPlan.parse("lose=1")


@pytest.mark.parametrize(("fault", "counted"), [("drop_imm", 0), ("duplicate_imm", 16)])
def test_receiver_faults_act_on_the_wrapped_engines_arrivals(fault: str, counted: int) -> None:
    """Every arrival dropped (none counted) or duplicated (twice the pages): the wrapper taps
    the inner engine's counters, whatever engine that is."""
    a, b = _pair(FaultPlan(seed=0, **{fault: 1.0}), "receiver")
    with a, b:
        a.post_paged_writes(_paged(a, b, 8, 5))
        assert b.imm_counted(5) == counted
        assert b.injected[fault] == 8
        assert b.inner.imm_counted(5) == counted  # the wrapper holds no counters of its own


def test_a_stopped_peer_swallows_operations_until_they_time_out() -> None:
    """stop_after=1: the first write goes through, the second is swallowed and its on_error
    hears a timeout after `timeout_s`; nothing of it lands."""
    a, b = _pair(FaultPlan(stop_after=1), "sender")
    with a, b:
        write = _paged(a, b, 2, 9)
        errors: list[BaseException] = []
        failed = threading.Event()
        a.post_paged_writes(write)
        a.post_paged_writes(
            write, on_error=lambda e: (errors.append(e), failed.set()), timeout_s=0.05
        )
        assert failed.wait(5.0)
        assert isinstance(errors[0], TransferTimeoutError)
        assert (a.operations, a.injected["swallowed"], b.imm_counted(9)) == (2, 1, 2)


def test_timeout_s_is_the_inner_engines() -> None:
    """A node's tests set `transfer.timeout_s`: the wrapped engine's deadline moves with it."""
    a, b = _pair(FaultPlan(), "sender")
    with a, b:
        a.timeout_s = 1.5
        assert a.inner.timeout_s == 1.5


def test_writes_without_an_immediate_bypass_the_fault_plan() -> None:
    """Every write carrying an imm fails (fail_write=1); one without lands, and leaves the
    operation count alone (stop_after still counts only data-path operations)."""
    plan = FaultPlan(seed=0, fail_write=1.0)
    with FaultyTransport(TransferEngine("tcp"), plan) as a, TransferEngine("tcp") as b:
        src, _ = a.register_memory(np.full(64, 9, np.uint8), remote_write=False)
        dst = np.zeros(64, np.uint8)
        _, desc = b.register_memory(dst)
        failed, landed = threading.Event(), threading.Event()
        a.post_write(src, 0, 64, 1, desc, 0, on_error=lambda _error: failed.set())
        a.post_write(src, 0, 64, None, desc, 0, on_done=landed.set)
        assert failed.wait(10.0)
        assert landed.wait(10.0)
        assert (a.injected["fail_write"], a.operations) == (1, 1)
        for _ in range(1000):  # the bytes are placed once the target's thread polled
            if dst.all():
                break
            threading.Event().wait(0.005)
        assert int(dst.min()) == 9


def test_domains_pass_through_the_fault_plan() -> None:
    """The same `domains` / `domain` parameters as the real engine, faults or none."""
    with (
        FaultyTransport(TransferEngine("tcp", num_domains=2), FaultPlan()) as a,
        TransferEngine("tcp") as b,
    ):
        src, _ = a.register_memory(np.ones(4 * 64, np.uint8))
        _, desc = b.register_memory(np.zeros(4 * 64, np.uint8))
        paged, single = threading.Event(), threading.Event()
        pages = np.arange(4)
        a.post_paged_writes(
            PagedWrite(src, pages, 64, 0, desc, pages, 64, 0, 64, 3, [1]), paged.set
        )
        a.post_write(src, 0, 64, 3, desc, 0, single.set, domain=1)
        assert paged.wait(10.0)
        assert single.wait(10.0)
        assert [s.writes_completed for s in a.stats()] == [0, 5]
