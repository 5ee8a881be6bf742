"""Arrival streams: seeded Poisson arrivals, lognormal lengths, trace files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from disagg.errors import ConfigError
from disagg.sim.workload import Workload, load_trace, poisson_arrivals


def test_same_seed_same_stream() -> None:
    """Two draws with one seed are identical; another seed differs."""
    workload = Workload(qps=5, duration_s=60)
    assert poisson_arrivals(workload) == poisson_arrivals(workload)
    assert poisson_arrivals(workload) != poisson_arrivals(Workload(qps=5, duration_s=60, seed=1))


def test_rate_and_mean_lengths() -> None:
    """Over 2,000 s at 5 QPS: about 10,000 arrivals, lengths averaging their targets."""
    arrivals = poisson_arrivals(Workload(qps=5, duration_s=2000, prompt_len=4000,
                                         output_len=500))
    assert len(arrivals) == pytest.approx(10_000, rel=0.05)
    assert np.mean([a.prompt_len for a in arrivals]) == pytest.approx(4000, rel=0.03)
    assert np.mean([a.output_len for a in arrivals]) == pytest.approx(500, rel=0.03)


def test_sigma_zero_gives_fixed_lengths() -> None:
    """length_sigma=0: every request has exactly the mean lengths."""
    arrivals = poisson_arrivals(Workload(qps=2, duration_s=60, length_sigma=0))
    assert {(a.prompt_len, a.output_len) for a in arrivals} == {(8192, 1024)}


def test_trace_round_trip(tmp_path: Path) -> None:
    """JSON lines are read and sorted by time."""
    path = tmp_path / "trace.jsonl"
    path.write_text('{"time": 2.0, "prompt_len": 10, "output_len": 5}\n\n'
                    '{"time": 1.0, "prompt_len": 20, "output_len": 6}\n')
    assert [(a.time, a.prompt_len) for a in load_trace(path)] == [(1.0, 20), (2.0, 10)]


def test_bad_trace_line_is_named(tmp_path: Path) -> None:
    """A malformed record is reported with its line number."""
    path = tmp_path / "trace.jsonl"
    path.write_text('{"time": 1.0, "prompt_len": 20, "output_len": 6}\n{"time": 2}\n')
    with pytest.raises(ConfigError, match="trace.jsonl:2"):
        load_trace(path)


def test_bad_workload_values() -> None:
    """Non-positive rates and a warm-up longer than the run are refused."""
    with pytest.raises(ConfigError, match="qps"):
        Workload(qps=0)
    with pytest.raises(ConfigError, match="warmup_s"):
        Workload(duration_s=10, warmup_s=20)
