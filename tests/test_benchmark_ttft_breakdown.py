"""`benchmarks/ttft_breakdown.py` reads a request's spans into parts that tile its TTFT: a
disaggregated request's and a mixed node's, from synthetic traces with known gaps, and one
real run of both modes at tiny size."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import ttft_breakdown  # noqa: E402


def span(name: str, ts_ms: float, dur_ms: float = 0.0) -> dict:
    return {"name": name, "ph": "X", "ts": ts_ms * 1e3, "dur": dur_ms * 1e3,
            "args": {"request_id": "r"}}


def instant(name: str, ts_ms: float) -> dict:
    return {"name": name, "ph": "i", "ts": ts_ms * 1e3, "args": {"request_id": "r"}}


def test_a_disaggregated_request_s_parts_tile_its_ttft() -> None:
    events = [span("route", 2), span("request", 3, 500), span("admission", 3.5, 1),
              span("queue", 6, 0.5), span("prefill", 6.5, 90), span("kv_wait", 4.5, 100),
              instant("first_token_sent", 140), instant("first_token", 141)]
    parts = ttft_breakdown.breakdown(ttft_breakdown.spans_by_request(events)["r"],
                                     span("POST /v1/completions", 0, 600), ttft_ms=145)
    assert parts == pytest.approx({
        "front_door": 2, "to_node": 1, "admission": 1.5, "to_prefiller": 1.5,
        "prefill_queue": 0.5, "prefill": 90, "tail": 8, "first_step": 35.5, "back": 1,
        "client": 4})
    assert sum(parts.values()) == pytest.approx(145)


def test_a_mixed_node_s_prefill_is_one_part() -> None:
    events = [span("route", 1), span("request", 2, 80), instant("first_token_sent", 50),
              instant("first_token", 51)]
    parts = ttft_breakdown.breakdown(ttft_breakdown.spans_by_request(events)["r"],
                                     span("POST /v1/completions", 0, 90), ttft_ms=55)
    assert parts == pytest.approx({"front_door": 1, "to_node": 1, "node_prefill": 48,
                                   "back": 1, "client": 4})


@pytest.mark.slow
@pytest.mark.fabric
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins two nodes to two cores")
def test_both_modes_run_end_to_end(tmp_path: Path) -> None:
    """`--min-post-kib` reaches the prefiller's command line (0: each layer posted alone); the
    JSON holds the node threads' time, the prefiller's named transfer thread among them."""
    out = tmp_path / "ttft.json"
    summary = ttft_breakdown.main(["--model", "tiny", "--lengths", "8", "--reps", "1",
                                   "--min-post-kib", "0", "--json", str(out)])
    threads = {(t["mode"], t["thread"]) for t in json.loads(out.read_text())["threads"]}
    assert {("disagg", "prefill-0/main"), ("disagg", "prefill-0/tc-domain-0")} <= threads
    assert any(mode == "mixed" and t.endswith("/main") for mode, t in threads)
    assert {row["mode"] for row in summary} == {"disagg", "mixed"}
    for row in summary:
        parts = sum(row[p] for p in ttft_breakdown.PARTS)
        assert parts == pytest.approx(row["ttft_ms"], rel=1e-6)
        assert all(row[p] >= 0 for p in ttft_breakdown.PARTS if p != "client"), row


@pytest.mark.slow
@pytest.mark.fabric
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins two nodes to two cores")
def test_untraced_runs_over_the_provider_asked_for(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`--untraced` starts the cluster without tracing and reports the client's TTFT alone
    (and the threads' times); `--provider` reaches the disaggregated cluster, not the mixed."""
    started: list[tuple[list[str], Path | None]] = []
    real = ttft_breakdown.Server

    def server(args: object, flags: list[str], log: Path, trace: Path | None) -> object:
        started.append((flags, trace))
        return real(args, flags, log, trace)

    monkeypatch.setattr(ttft_breakdown, "Server", server)
    out = tmp_path / "ttft.json"
    summary = ttft_breakdown.main(["--model", "tiny", "--lengths", "8", "--reps", "1",
                                   "--untraced", "--provider", "shm", "--json", str(out)])
    assert [trace for _, trace in started] == [None, None]
    disagg, mixed = (flags for flags, _ in started)
    assert "--provider" in disagg and disagg[disagg.index("--provider") + 1] == "shm"
    assert "--provider" not in mixed
    assert {row["mode"] for row in summary} == {"disagg", "mixed"}
    assert all(set(row) == {"mode", "tokens", "reps", "ttft_ms"} and row["ttft_ms"] > 0
               for row in summary)
    threads = {(t["mode"], t["thread"]) for t in json.loads(out.read_text())["threads"]}
    assert ("disagg", "prefill-0/tc-domain-0") in threads
