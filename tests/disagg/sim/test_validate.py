"""The benchmark hook: replay a `benchmarks/disagg.py`-shaped run through the simulator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from disagg.errors import ConfigError
from disagg.sim.hardware import Hardware
from disagg.sim.validate import compare_runs, engine_model, load_runs, predict_run

# Round numbers of the size `disagg calibrate` measures on a 2-core VM (one thread).
CPU = Hardware(name="cpu-test", devices_per_node=1, bf16_flops=8e10, fp8_flops=8e10,
               hbm_bandwidth=1.2e10, hbm_capacity=8e9, nvlink_bandwidth=1.2e10,
               nic_bandwidth=6e9, nics_per_node=1, nic_latency_s=5e-5, gemm_efficiency=1.0,
               attention_efficiency=0.5, memory_efficiency=1.0, comm_efficiency=1.0,
               collective_latency_s=0.0, kernel_overhead_s=2e-5, step_overhead_s=2e-4,
               seq_overhead_s=5e-5, seq_layer_overhead_s=7e-5, overlap_compute_memory=False,
               kv_read_passes=5.0)


def _run(mode: str) -> dict[str, Any]:
    """Shorts decoding from t=0 and long prompts arriving while they decode."""
    arrivals = [{"time": 0.05 * i, "prompt_len": 32, "output_len": 120} for i in range(4)]
    arrivals += [{"time": 1.0 + i, "prompt_len": 768, "output_len": 4} for i in range(3)]
    return {"mode": mode, "model": "smollm2-135m", "chunk_size": 256, "num_nodes": 2,
            "prefillers": 1, "decoders": 1, "arrivals": arrivals,
            "measured": {"itl_ms_p99": 100.0, "ttft_ms_p50": 50.0}}


def test_disagg_removes_the_stalls_the_mixed_nodes_see() -> None:
    """S1 on this machine's scale: mixed decodes stall behind 256-token chunks."""
    mixed, disagg = predict_run(_run("mixed"), CPU), predict_run(_run("disagg"), CPU)
    assert mixed["itl_ms_max"] > 2 * mixed["itl_ms_p50"]
    assert disagg["itl_ms_p99"] < mixed["itl_ms_p99"]


def test_compare_lists_only_measured_metrics() -> None:
    """One check per metric the run measured, with its prediction."""
    checks = compare_runs([_run("mixed")], CPU)
    assert {c.metric for c in checks} == {"itl_ms_p99", "ttft_ms_p50"}
    assert all(c.predicted > 0 for c in checks)


def test_runs_file_holds_one_or_many(tmp_path: Path) -> None:
    """A single object and a list both load as a list."""
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(_run("mixed")))
    assert len(load_runs(path)) == 1
    path.write_text(json.dumps([_run("mixed"), _run("disagg")]))
    assert len(load_runs(path)) == 2


def test_bad_run_records() -> None:
    """Missing arrivals or an unknown model are ConfigErrors."""
    with pytest.raises(ConfigError, match="benchmark run"):
        predict_run({"mode": "mixed"}, CPU)
    with pytest.raises(ConfigError, match="unknown model"):
        engine_model("gpt-5")
