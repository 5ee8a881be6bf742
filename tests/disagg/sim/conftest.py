"""Shared fixtures for the simulator tests: toy hardware and a toy model with round numbers,
so each cost term can be checked against arithmetic written out in the test."""

from __future__ import annotations

import pytest

from disagg.sim.hardware import Hardware
from disagg.sim.models import SimModel


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
