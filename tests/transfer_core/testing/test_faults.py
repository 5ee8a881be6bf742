"""`FaultyTransferEngine` (issue 8): faults act on the request data path only (S5, issue 15).

A write without an immediate is a handshake's ownership proof (`ContextSlots.write_proof`):
posted as it is, and not counted as an operation, so a fault plan never stops a node joining.
"""

from __future__ import annotations

import threading

import numpy as np

from transfer_core.engine import TransferEngine
from transfer_core.testing.faults import FaultPlan, FaultyTransferEngine


def test_writes_without_an_immediate_bypass_the_fault_plan() -> None:
    """Every write carrying an imm fails (fail_write=1); one without lands, and leaves the
    operation count alone (stop_after still counts only data-path operations)."""
    plan = FaultPlan(seed=0, fail_write=1.0)
    with FaultyTransferEngine("tcp", faults=plan) as a, TransferEngine("tcp") as b:
        src, _ = a.register_memory(np.full(64, 9, np.uint8), remote_write=False)
        dst = np.zeros(64, np.uint8)
        _, desc = b.register_memory(dst)
        failed, landed = threading.Event(), threading.Event()
        a.submit_write(src, 0, 64, 1, desc, 0, on_error=lambda _error: failed.set())
        a.submit_write(src, 0, 64, None, desc, 0, on_done=landed.set)
        assert failed.wait(10.0) and landed.wait(10.0)
        assert a.injected["fail_write"] == 1 and a._ops == 1
        for _ in range(1000):  # the bytes are placed once the target's thread polled
            if dst.all():
                break
            threading.Event().wait(0.005)
        assert int(dst.min()) == 9


def test_domains_pass_through_the_fault_plan() -> None:
    """The same `domains` / `domain` parameters as the real engine, faults or none."""
    with (
        FaultyTransferEngine("tcp", num_domains=2, faults=FaultPlan()) as a,
        TransferEngine("tcp") as b,
    ):
        src, _ = a.register_memory(np.ones(4 * 64, np.uint8))
        _, desc = b.register_memory(np.zeros(4 * 64, np.uint8))
        paged, single = threading.Event(), threading.Event()
        pages = np.arange(4)
        a.submit_paged_writes(64, src, pages, 64, 0, desc, pages, 64, 0, 3, paged.set, domains=[1])
        a.submit_write(src, 0, 64, 3, desc, 0, single.set, domain=1)
        assert paged.wait(10.0)
        assert single.wait(10.0)
        assert [s.writes_completed for s in a.stats()] == [0, 5]
