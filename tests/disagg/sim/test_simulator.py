"""The discrete-event cluster: determinism, accounting, and the S1 mechanism in miniature."""

from __future__ import annotations

import math

import numpy as np
import pytest

from disagg.errors import ConfigError
from disagg.sim.cost_model import Parallel, kv_capacity_tokens, prefill_time
from disagg.sim.hardware import PRESETS as HW
from disagg.sim.models import PRESETS
from disagg.sim.results import SimResult
from disagg.sim.simulator import ClusterSimulator, SimClusterConfig
from disagg.sim.workload import Workload, poisson_arrivals

R1, H200 = PRESETS["deepseek-r1"], HW["h200"]
SHORT = Workload(qps=2.0, duration_s=20, warmup_s=2, length_sigma=0, prompt_len=4096,
                 output_len=128)


def _run(config: SimClusterConfig, workload: Workload = SHORT, seed: int = 0) -> SimResult:
    return ClusterSimulator(R1, H200, config, seed=seed).run(
        poisson_arrivals(workload), workload.warmup_s, horizon_s=1000)


@pytest.mark.parametrize("mode", ["mixed", "disagg"])
def test_same_seed_same_result(mode: str) -> None:
    """A seed fixes the whole history; another seed changes the MTP acceptance draws."""
    config = SimClusterConfig(mode=mode)  # type: ignore[arg-type]
    first, again, other = _run(config), _run(config), _run(config, seed=1)
    assert first.summary() == again.summary()
    assert first.summary() != other.summary()


@pytest.mark.parametrize("mode", ["mixed", "disagg"])
def test_every_request_gets_all_its_tokens(mode: str) -> None:
    """Each measured request finishes with exactly its output length, after it arrived."""
    result = _run(SimClusterConfig(mode=mode))  # type: ignore[arg-type]
    assert result.requests
    for request in result.requests:
        assert request.generated == request.output_len
        assert request.arrival < request.first_token <= request.last_token == request.finish


def test_disagg_ttft_covers_prefill_and_first_decode_step() -> None:
    """TTFT >= prefilling all but the last prompt token, and the KV lands before it."""
    result = _run(SimClusterConfig(mode="disagg"))
    prefill = prefill_time(R1, H200, Parallel(tp=8), SHORT.prompt_len - 1, 8192)
    for request in result.requests:
        assert request.ttft >= prefill
        assert request.prefill_start <= request.kv_ready < request.first_token


def test_prefill_stalls_show_in_mixed_not_disagg() -> None:
    """S1: mixed decodes wait out whole prefill steps; disaggregated decodes never do."""
    mixed = _run(SimClusterConfig(mode="mixed", num_nodes=1))
    disagg = _run(SimClusterConfig(mode="disagg", prefillers=1, decoders=1))
    assert mixed.itl_gaps.max() > 4 * float(sum(mixed.itl_gaps) / len(mixed.itl_gaps))
    assert disagg.itl_gaps.max() < 2 * float(sum(disagg.itl_gaps) / len(disagg.itl_gaps))


def test_dp_decoders_are_one_instance_per_gpu() -> None:
    """A DP decoder node is 8 ranks, each with one NIC."""
    sim = ClusterSimulator(R1, H200, SimClusterConfig(decoders=2,
                                                      decoder_parallel=Parallel(tp=1, dp=8)))
    assert len(sim.decoders) == 16
    assert {d.nics for d in sim.decoders} == {1}
    assert {p.nics for p in sim.prefillers} == {8}


def test_model_that_does_not_fit_is_refused() -> None:
    """671 GB of R1 weights on one H200 cannot leave room for a cache."""
    with pytest.raises(ConfigError, match="does not fit"):
        kv_capacity_tokens(R1, H200, Parallel(tp=1), 0.9)


def test_summary_of_nothing_is_nan() -> None:
    """No measured requests: percentiles are NaN, counts zero."""
    summary = SimResult(requests=[], itl_gaps=np.array([])).summary()
    assert summary["finished"] == 0
    assert math.isnan(summary["ttft_ms_p50"])


def test_bad_cluster_config() -> None:
    """Unknown modes and DP prefillers are refused."""
    with pytest.raises(ConfigError, match="unknown mode"):
        SimClusterConfig(mode="hybrid")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="TP groups"):
        SimClusterConfig(prefill_parallel=Parallel(tp=1, dp=8))
