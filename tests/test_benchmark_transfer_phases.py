"""`benchmarks/transfer_phases.py` runs end to end: a spawned receiver over shm, one rep of
each batch in each workers' mode, and every phase comes out as a span that is not negative (a
stamp missing on either side would make one hugely so); in the `due` mode both sides mark what
they wait for as due at once."""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import transfer_phases  # noqa: E402

from transfer_core.engine import TransferEngine  # noqa: E402

pytestmark = pytest.mark.fabric


def test_every_batch_gets_a_row_of_non_negative_phases() -> None:
    rows = transfer_phases.run_provider("shm", reps=1, warmup=0)
    assert [(row["workers"], row["batch"]) for row in rows] == [
        (mode, name) for mode in transfer_phases.WORKERS
        for name, _, _ in transfer_phases.BATCHES]
    for row in rows:
        spans = {name: row[name] for name, _ in transfer_phases.PHASES}
        assert all(span >= 0 for span in spans.values()), spans
        assert row["total"] > 0


def test_in_the_due_mode_both_sides_mark_their_waits_due_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    marked: list[tuple[int, bool]] = []
    expect_soon = TransferEngine.expect_soon

    def recording(self: TransferEngine, imm: int, at_once: bool = False) -> bool:
        marked.append((imm, at_once))
        return expect_soon(self, imm, at_once)

    monkeypatch.setattr(TransferEngine, "expect_soon", recording)
    parent, child = mp.Pipe()
    receiver = threading.Thread(target=transfer_phases._receiver_main, args=("shm", child))
    receiver.start()
    sender = transfer_phases.Sender("shm")
    try:
        dst = transfer_phases.MemoryRegionDescriptor.from_bytes(parent.recv())
        parent.send(sender.ack_desc.to_bytes())
        for imm, due in ((1, False), (2, True)):
            transfer_phases.run_rep(parent, sender, dst, imm, 4, 4096, due)
        parent.send(("stop",))
        receiver.join(30)
    finally:
        sender.engine.close()
    assert sorted(marked) == [(2, True), (2, True)]  # the receiver's counter, the sender's ack
