"""The benchmark hook: replay a `benchmarks/disagg.py`-shaped run through the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.errors import ConfigError
from disagg.sim.hardware import Hardware
from disagg.sim.validate import compare_runs, engine_model, load_runs, predict_run
from tests.disagg.sim.conftest import BenchmarkRun


def test_disagg_removes_the_stalls_the_mixed_nodes_see(cpu_hw: Hardware,
                                                       benchmark_run: BenchmarkRun) -> None:
    """S1 on this machine's scale: mixed decodes stall behind 256-token chunks."""
    mixed = predict_run(benchmark_run("mixed"), cpu_hw)
    disagg = predict_run(benchmark_run("disagg"), cpu_hw)
    assert mixed["itl_ms_max"] > 2 * mixed["itl_ms_p50"]
    assert disagg["itl_ms_p99"] < mixed["itl_ms_p99"]


def test_compare_lists_only_measured_metrics(cpu_hw: Hardware,
                                            benchmark_run: BenchmarkRun) -> None:
    """One check per metric the run measured, with its prediction."""
    checks = compare_runs([benchmark_run("mixed")], cpu_hw)
    assert {c.metric for c in checks} == {"itl_ms_p99", "ttft_ms_p50"}
    assert all(c.predicted > 0 for c in checks)


def test_runs_file_holds_one_or_many(tmp_path: Path, benchmark_run: BenchmarkRun) -> None:
    """A single object and a list both load as a list."""
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(benchmark_run("mixed")))
    assert len(load_runs(path)) == 1
    path.write_text(json.dumps([benchmark_run("mixed"), benchmark_run("disagg")]))
    assert len(load_runs(path)) == 2


def test_bad_run_records(cpu_hw: Hardware) -> None:
    """Missing arrivals or an unknown model are ConfigErrors."""
    with pytest.raises(ConfigError, match="benchmark run"):
        predict_run({"mode": "mixed"}, cpu_hw)
    with pytest.raises(ConfigError, match="unknown model"):
        engine_model("gpt-5")
