"""The P:D planner: the Qwen3-Coder ratio of S9b, layouts, and refusing the impossible."""

from __future__ import annotations

import pytest

from disagg.errors import ConfigError
from disagg.sim.hardware import PRESETS as HW
from disagg.sim.models import PRESETS
from disagg.sim.planner import Target, plan_cluster

H200 = HW["h200"]


def test_qwen3_coder_wants_about_three_decoders_per_prefiller() -> None:
    """S9b: 8k/1k requests at 50 tok/s: TP8 decoders, roughly 3 per prefiller node."""
    plan = plan_cluster(PRESETS["qwen3-coder-480b"], H200, 8192, 1024, Target(50, 2000))
    ratio = plan.pools["prefill"].qps_per_node / plan.pools["decode TP"].qps_per_node
    assert 2.5 <= ratio <= 4.5
    assert plan.best.decoder_parallel.tp == 8
    assert 2.5 <= plan.best.decoders / plan.best.prefillers <= 4.5


def test_r1_at_90_tokens_per_second_prefers_tp_decoders() -> None:
    """S9c: TP gives lower latency, so a 90 tok/s target picks TP decoders and disaggregation."""
    plan = plan_cluster(PRESETS["deepseek-r1"], H200, 8192, 1024, Target(90, 2000))
    assert plan.best.prefillers >= 1
    assert plan.best.decoder_parallel.tp == 8
    assert plan.best.goodput_per_node > plan.pools["mixed"].qps_per_node


def test_r1_at_50_tokens_per_second_prefers_dp_decoders() -> None:
    """S9c: DP scales better with load: at a 50 tok/s target DP ranks carry more QPS."""
    plan = plan_cluster(PRESETS["deepseek-r1"], H200, 8192, 1024, Target(50, 2000))
    assert plan.pools["decode DP"].qps_per_node > plan.pools["decode TP"].qps_per_node
    assert plan.best.decoder_parallel.dp == 8


def test_reasoning_names_the_binding_terms() -> None:
    """Every pool line says which cost term binds; the last line names the choice."""
    plan = plan_cluster(PRESETS["qwen3-coder-480b"], H200, 8192, 1024, Target())
    assert all("binding" in line for line in plan.reasoning[:3])
    assert plan.reasoning[-1].startswith(f"best: {plan.best.label}")


def test_unreachable_target_is_an_error() -> None:
    """No layout decodes R1 at 10,000 tokens/s per request."""
    with pytest.raises(ConfigError, match="reaches"):
        plan_cluster(PRESETS["deepseek-r1"], H200, 8192, 1024, Target(10_000, 2000))
