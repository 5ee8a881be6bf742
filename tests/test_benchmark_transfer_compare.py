"""`benchmarks/transfer_compare.py` lists `fi_rma_bw` among its contenders only when it found
the binary: a missing or unusable one is a note, never a contender that runs without one."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.benchmark_modules import load_benchmark
from transfer_core.errors import ReferenceToolError

ARGS = argparse.Namespace(pages=8, small_pages=2, page_size=4096)


def _fi_rma_bw_contenders(monkeypatch: pytest.MonkeyPatch, find: object) -> tuple[list, list]:
    compare = load_benchmark("transfer_compare")
    monkeypatch.setattr(compare, "find_fi_rma_bw", find)
    monkeypatch.setattr(compare, "PEERS_PYTHON", Path("/nonexistent/python"))  # no peers
    notes: list[str] = []
    found = [c for c in compare.contenders(ARGS, notes)
             if c.engine.startswith(("fi_rma_bw", "ours-1buf"))]
    return found, notes


def test_a_found_fi_rma_bw_runs_at_both_sizes_beside_ours_on_its_pattern(
        monkeypatch: pytest.MonkeyPatch) -> None:
    found, _ = _fi_rma_bw_contenders(monkeypatch, lambda also: Path("/opt/fi_rma_bw"))
    names = ("fi_rma_bw", "fi_rma_bw-small", "ours-1buf", "ours-1buf-small")
    assert {(c.engine, c.transport) for c in found} == {
        (name, p) for name in names for p in ("tcp", "shm")}
    assert all("/opt/fi_rma_bw" in c.cmd for c in found if c.engine.startswith("fi_rma_bw"))
    assert all("--one-buffer" in c.cmd for c in found if c.engine.startswith("ours"))


def test_fi_rma_bw_is_set_beside_ours_on_its_one_buffer_pattern() -> None:
    compare = load_benchmark("transfer_compare")

    def summary(engine: str, gbps: float) -> object:
        s = compare.Summary(engine, "tcp", 1, 1, 1, verified=True)
        s.median["gbps"] = gbps
        return s

    got = compare.ratios([summary("ours-small", 1.0), summary("ours-1buf-small", 3.0),
                          summary("fi_rma_bw-small", 4.0)])["tcp"]
    assert got["fi_rma_bw-small"]["gbps_ours_over_peer"] == pytest.approx(0.25)
    assert got["fi_rma_bw-small vs ours-1buf-small"]["gbps_ours_over_peer"] == pytest.approx(0.75)


def test_a_missing_fi_rma_bw_is_a_note_not_a_contender(
        monkeypatch: pytest.MonkeyPatch) -> None:
    found, notes = _fi_rma_bw_contenders(monkeypatch, lambda also: None)
    assert found == []
    assert any("fi_rma_bw not found" in n for n in notes)


def test_an_unusable_fi_rma_bw_is_a_note_not_a_contender(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(also: object) -> Path:
        raise ReferenceToolError("/tmp/x is not an executable fi_rma_bw")

    found, notes = _fi_rma_bw_contenders(monkeypatch, refuse)
    assert found == []
    assert any("is not an executable" in n for n in notes)
