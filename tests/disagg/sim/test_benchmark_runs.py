"""benchmarks/disagg_sim_runs.py: a `benchmarks/disagg.py --json` result as simulator runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from disagg.sim.hardware import Hardware
from disagg.sim.validate import compare_runs
from tests.benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[3]


convert = load_benchmark("disagg_sim_runs")


def _row(request_id: str, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    kind = request_id.split("-")[0]
    return {"request_id": request_id, "kind": kind, "node": 0, "state": "finished_length",
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "ttft_ms": 50.0, "tokens_per_s": 12.0, "itl_ms_max": 900.0}


def _mode(ttft_p99: float | None) -> dict[str, Any]:
    # Listed out of arrival order, as nothing promises the benchmark keeps it.
    rows = [_row("long-1", 512, 32), _row("short-0", 16, 80), _row("long-0", 512, 32),
            _row("short-1", 16, 80)]
    return {"per_request": rows, "ttft_ms": {"p50": 120.0, "p99": ttft_p99},
            "itl_ms": {"p50": 70.0, "p99": 800.0, "max": 900.0},
            "request_tokens_per_s": {"p50": 11.5, "min": 3.0}}


@pytest.fixture
def result() -> dict[str, Any]:
    """A small `benchmarks/disagg.py --json` object: 2 shorts, 2 longs, both modes."""
    workload = {"model": "smollm2-135m", "num_short": 2, "num_long": 2, "first_long_s": 1.0,
                "interval_s": 1.5, "chunk_size": 256, "page_size": 16, "cores": [0, 1]}
    return {"model": "smollm2-135m", "workload": workload,
            "modes": {"mixed": _mode(900.0), "disagg": _mode(None)}}


def test_arrivals_follow_the_benchmark_schedule(result: dict[str, Any]) -> None:
    """Shorts 50 ms apart from t=0, longs from `first_long_s` every `interval_s`, sorted."""
    mixed = convert.sim_runs(result)[0]
    assert mixed["arrivals"] == [
        {"time": 0.0, "prompt_len": 16, "output_len": 80},
        {"time": 0.05, "prompt_len": 16, "output_len": 80},
        {"time": 1.0, "prompt_len": 512, "output_len": 32},
        {"time": 2.5, "prompt_len": 512, "output_len": 32}]


def test_recorded_arrival_time_wins(result: dict[str, Any]) -> None:
    """A row carrying its own `arrival_s` is not recomputed from the workload."""
    result["modes"]["mixed"]["per_request"][0]["arrival_s"] = 9.0  # long-1
    times = [a["time"] for a in convert.sim_runs(result)[0]["arrivals"]]
    assert times == [0.0, 0.05, 1.0, 9.0]


def test_layout_per_mode(result: dict[str, Any]) -> None:
    """Mixed: one engine per pinned core; disagg: one prefiller, one decoder."""
    mixed, disagg = convert.sim_runs(result)
    assert (mixed["mode"], mixed["num_nodes"], mixed["chunk_size"]) == ("mixed", 2, 256)
    assert (disagg["mode"], disagg["prefillers"], disagg["decoders"]) == ("disagg", 1, 1)
    assert "num_nodes" not in disagg


def test_measured_percentiles_renamed_and_missing_left_out(result: dict[str, Any]) -> None:
    """The benchmark's nested percentiles become validate.py's flat names; None is dropped."""
    mixed, disagg = convert.sim_runs(result)
    assert mixed["measured"] == {"ttft_ms_p50": 120.0, "ttft_ms_p99": 900.0,
                                 "itl_ms_p50": 70.0, "itl_ms_p99": 800.0,
                                 "tps_per_request_p50": 11.5}
    assert "ttft_ms_p99" not in disagg["measured"]


def test_unknown_request_id_is_an_error(result: dict[str, Any]) -> None:
    """A row that is not from the benchmark's schedule has no arrival time to give."""
    result["modes"]["mixed"]["per_request"].append(_row("burst-0", 8, 8))
    with pytest.raises(ValueError, match="burst-0"):
        convert.sim_runs(result)


def test_records_replay_through_the_simulator(result: dict[str, Any], cpu_hw: Hardware) -> None:
    """validate.py accepts the records: one check per measured metric, each predicted."""
    checks = compare_runs(convert.sim_runs(result), cpu_hw)
    assert len(checks) == 5 + 4
    assert all(c.predicted > 0 for c in checks)


def test_cli_reads_a_result_file(result: dict[str, Any], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`python benchmarks/disagg_sim_runs.py bench.json` prints the list of records."""
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(result))
    convert.main([str(path)])
    assert json.loads(capsys.readouterr().out) == convert.sim_runs(result)
