"""`benchmarks/transfer_compare.py` lists `fi_rma_bw` among its contenders only when it found
the binary: a missing or unusable one is a note, never a contender that runs without one; and
every paged contender warms up and times as many batches as the others."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from tests.benchmark_modules import load_benchmark
from transfer_core.errors import ReferenceToolError

ARGS = argparse.Namespace(pages=8, small_pages=2, page_size=4096, warmup=3, iters=10)


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


def _flag(cmd: tuple[str, ...], *names: str) -> str | None:
    """The value after the first of `names` in `cmd`, None without any."""
    for name in names:
        if name in cmd:
            return cmd[cmd.index(name) + 1]
    return None


def test_every_paged_contender_warms_up_and_times_the_same_batches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    compare = load_benchmark("transfer_compare")
    monkeypatch.setattr(compare, "find_fi_rma_bw", lambda also: Path("/opt/fi_rma_bw"))
    monkeypatch.setattr(compare, "PEERS_PYTHON", Path(sys.executable))  # the peers listed
    args = argparse.Namespace(pages=8, small_pages=2, page_size=4096, warmup=4, iters=7)
    # fi_rma_bw's iterations are its own, per server/client pair
    paged = [c for c in compare.contenders(args, [])
             if c.pages is not None and not c.engine.startswith("fi_rma_bw")]
    assert {c.engine for c in paged} >= {"ours", "ours-small", "ours-1buf", "nixl-ucx",
                                         "nixl-ucx-small", "mooncake"}
    assert {(c.engine, _flag(c.cmd, "--warmup"), _flag(c.cmd, "--reps", "--iters"))
            for c in paged} == {(c.engine, "4", "7") for c in paged}


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


def test_the_peers_clock_is_set_beside_our_initiator_completions() -> None:
    """The peers stop at the sender's completions: ours at the same point is a ratio of its
    own, beside the one to the receiver's ack."""
    compare = load_benchmark("transfer_compare")
    ours = compare.Summary("ours-small", "tcp", 1, 1, 1, verified=True)
    ours.median |= {"gbps": 1.0, "gbps_initiator": 3.0}
    peer = compare.Summary("nixl-ucx-small", "tcp", 1, 1, 1, verified=True)
    peer.median["gbps"] = 4.0
    got = compare.ratios([ours, peer])["tcp"]["nixl-ucx-small"]
    assert got["gbps_ours_over_peer"] == pytest.approx(0.25)
    assert got["gbps_initiator_ours_over_peer"] == pytest.approx(0.75)


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
