"""Replay a run of `benchmarks/disagg.py` through the simulator and compare, metric by metric.

The hook for the CPU validation of S1 (mixed versus disaggregated on this machine). Input is
one JSON object per served mode (or a list of them)::

    {"mode": "mixed" | "disagg", "model": "smollm2-135m", "chunk_size": 256,
     "num_nodes": 2,                      # mixed: single-node engines behind the router
     "prefillers": 1, "decoders": 1,      # disagg
     "arrivals": [{"time": 0.0, "prompt_len": 64, "output_len": 200}, ...],
     "measured": {"ttft_ms_p50": ..., "ttft_ms_p99": ..., "itl_ms_p50": ...,
                  "itl_ms_p99": ..., "tps_per_request_p50": ...}}

The same arrivals go through `ClusterSimulator` on the calibrated `cpu` preset (one core per
node, fp32 weights as the engine runs them); each measured metric gets its prediction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.config import PRESETS as ENGINE_PRESETS
from disagg.errors import ConfigError
from disagg.sim.cost_model import Parallel
from disagg.sim.hardware import Hardware
from disagg.sim.models import PRESETS, SimModel, from_model_config, with_dtype
from disagg.sim.simulator import ClusterSimulator, SimClusterConfig
from disagg.sim.workload import Arrival

METRICS = ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "tps_per_request_p50")


@dataclass(frozen=True, slots=True)
class MetricCheck:
    """One metric of one mode: predicted by the simulator, measured by the benchmark."""

    mode: str
    metric: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """Relative error of the prediction."""
        return self.predicted / self.measured - 1 if self.measured else float("nan")


def engine_model(name: str) -> SimModel:
    """The simulator's view of a model as our CPU engine runs it (fp32 weights and cache)."""
    if name in ENGINE_PRESETS:
        return from_model_config(ENGINE_PRESETS[name])
    if name in PRESETS:
        return with_dtype(PRESETS[name], weight_bytes=4, kv_bytes=4)
    raise ConfigError(f"unknown model {name!r} in the benchmark run")


def predict_run(run: dict[str, Any], hw: Hardware) -> dict[str, float | int]:
    """Simulate one benchmark run (same arrivals, same layout) and return its summary."""
    try:
        arrivals = [Arrival(float(a["time"]), int(a["prompt_len"]), int(a["output_len"]))
                    for a in run["arrivals"]]
        one_core = Parallel(tp=1)
        config = SimClusterConfig(mode=run["mode"], num_nodes=int(run.get("num_nodes", 2)),
                                  prefillers=int(run.get("prefillers", 1)),
                                  decoders=int(run.get("decoders", 1)),
                                  decoder_parallel=one_core, prefill_parallel=one_core,
                                  chunk_size=int(run.get("chunk_size", 256)), spec_tokens=0)
        model = engine_model(str(run.get("model", "smollm2-135m")))
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(f"not a benchmark run record: {error!r}") from error
    horizon = max(a.time for a in arrivals) * 10 + 3600
    result = ClusterSimulator(model, hw, config).run(arrivals, warmup_s=0.0, horizon_s=horizon)
    return result.summary()


def compare_runs(runs: list[dict[str, Any]], hw: Hardware) -> list[MetricCheck]:
    """Every metric the benchmark measured, next to its prediction."""
    checks = []
    for run in runs:
        predicted = predict_run(run, hw)
        for metric in METRICS:
            if metric in run.get("measured", {}):
                checks.append(MetricCheck(run["mode"], metric, float(predicted[metric]),
                                          float(run["measured"][metric])))
    return checks


def load_runs(path: Path) -> list[dict[str, Any]]:
    """One run object or a list of them from a JSON file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read benchmark runs from {path}: {error}") from error
    return data if isinstance(data, list) else [data]
