"""Shared fixtures for the simulator tests: toy hardware and a toy model with round numbers,
so each cost term can be checked against arithmetic written out in the test; a CPU preset and
a `benchmarks/disagg.py`-shaped run for the validation hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from disagg.sim.hardware import Hardware
from disagg.sim.models import SimModel

BenchmarkRun = Callable[[str], dict[str, Any]]


@pytest.fixture
def toy_hw() -> Hardware:
    """1 TFLOP/s bf16, 100 GB/s HBM, every efficiency 0.5, small fixed costs."""
    return Hardware(name="toy", devices_per_node=8, bf16_flops=1e12, fp8_flops=2e12,
                    hbm_bandwidth=1e11, hbm_capacity=1e12, nvlink_bandwidth=1e10,
                    nic_bandwidth=1e9, nics_per_node=8, nic_latency_s=1e-5,
                    gemm_efficiency=0.5, attention_efficiency=0.5, memory_efficiency=0.5,
                    comm_efficiency=0.5, collective_latency_s=1e-5, kernel_overhead_s=1e-6,
                    step_overhead_s=1e-3)


@pytest.fixture
def toy_model() -> SimModel:
    """A 2-layer dense GQA model: 12,288 attention + 24,576 MLP weights per layer, bf16."""
    return SimModel(name="toy", num_layers=2, hidden_size=64, vocab_size=100, num_heads=4,
                    num_kv_heads=2, head_dim=16, intermediate_size=128, num_dense_layers=2,
                    weight_bytes=2, kv_bytes=2, lm_head_bytes=2, kernels_per_layer=10)


@pytest.fixture
def toy_moe(toy_model: SimModel) -> SimModel:
    """The toy model with 8 experts (top-2, 32 wide) in both layers."""
    from dataclasses import replace

    return replace(toy_model, name="toy-moe", num_dense_layers=0, num_experts=8,
                   num_experts_per_token=2, moe_intermediate_size=32)


@pytest.fixture
def cpu_hw() -> Hardware:
    """Round numbers of the size `disagg calibrate` measures on a 2-core VM (one thread)."""
    return Hardware(name="cpu-test", devices_per_node=1, bf16_flops=8e10, fp8_flops=8e10,
                    hbm_bandwidth=1.2e10, hbm_capacity=8e9, nvlink_bandwidth=1.2e10,
                    nic_bandwidth=6e9, nics_per_node=1, nic_latency_s=5e-5, gemm_efficiency=1.0,
                    attention_efficiency=0.5, memory_efficiency=1.0, comm_efficiency=1.0,
                    collective_latency_s=0.0, kernel_overhead_s=2e-5, step_overhead_s=2e-4,
                    seq_overhead_s=5e-5, seq_layer_overhead_s=7e-5,
                    overlap_compute_memory=False, kv_read_passes=5.0)


@pytest.fixture
def benchmark_run() -> BenchmarkRun:
    """Factory: `make(mode)` -> a run record (shorts decoding from t=0, then long prompts)."""
    def make(mode: str) -> dict[str, Any]:
        arrivals = [{"time": 0.05 * i, "prompt_len": 32, "output_len": 120} for i in range(4)]
        arrivals += [{"time": 1.0 + i, "prompt_len": 768, "output_len": 4} for i in range(3)]
        return {"mode": mode, "model": "smollm2-135m", "chunk_size": 256, "num_nodes": 2,
                "prefillers": 1, "decoders": 1, "arrivals": arrivals,
                "measured": {"itl_ms_p99": 100.0, "ttft_ms_p50": 50.0}}
    return make
