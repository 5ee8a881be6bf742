"""`benchmarks/transfer_phases.py` runs end to end: a spawned receiver over shm, one rep of
each batch, and every phase comes out as a span that is not negative (a stamp missing on
either side would make one hugely so)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import transfer_phases  # noqa: E402

pytestmark = pytest.mark.fabric


def test_every_batch_gets_a_row_of_non_negative_phases() -> None:
    rows = transfer_phases.run_provider("shm", reps=1, warmup=0)
    assert [row["batch"] for row in rows] == [name for name, _, _ in transfer_phases.BATCHES]
    for row in rows:
        spans = {name: row[name] for name, _ in transfer_phases.PHASES}
        assert all(span >= 0 for span in spans.values()), spans
        assert row["total"] > 0
