"""Each cost term against arithmetic done by hand, and the S1 asymmetry it produces."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagg.sim.cost_model import (
    BatchShape,
    Parallel,
    decode_shape,
    kv_transfer,
    roofline,
    step_cost,
    step_time,
    tokens_per_step,
)
from disagg.sim.hardware import PRESETS as HW
from disagg.sim.hardware import Hardware
from disagg.sim.models import PRESETS, SimModel

R1, QWEN, H200 = PRESETS["deepseek-r1"], PRESETS["qwen3-coder-480b"], HW["h200"]
TP8, ONE = Parallel(tp=8), Parallel(tp=1)
DECODE_4 = BatchShape.from_chunks([(1, 100)] * 4)  # 4 decodes over 100 cached tokens


def test_roofline_takes_the_larger_or_the_sum() -> None:
    """max(2 ms, 1 ms) when the two overlap, 3 ms when they add."""
    assert roofline(2e12, 1e9, 1e15, 1e12) == (pytest.approx(2e-3), "compute")
    assert roofline(2e12, 1e9, 1e15, 1e12, overlap=False)[0] == pytest.approx(3e-3)


def test_batch_shape_counts_causal_pairs() -> None:
    """A 4-token chunk after 10 cached tokens sees 4*10 + (1+2+3+4) query-key pairs."""
    shape = BatchShape.from_chunks([(4, 10), (1, 50)])
    assert shape.prefill_pairs == 50
    assert shape.decode_pairs == 51
    assert (shape.num_tokens, shape.num_seqs, shape.kv_tokens_read) == (5, 2, 65)


def test_dense_gemm_term(toy_model: SimModel, toy_hw: Hardware) -> None:
    """2 layers x 36,864 bf16 weights streamed once: 147,456 B at 50 GB/s (memory bound)."""
    cost = step_cost(toy_model, toy_hw, ONE, DECODE_4)
    assert cost.terms["dense_gemm"] == pytest.approx(2 * 36864 * 2 / 5e10)
    assert cost.bound["dense_gemm"] == "memory"


def test_attention_term_reads_the_kv(toy_model: SimModel, toy_hw: Hardware) -> None:
    """404 cached tokens x 64 KV elements x 2 B per layer, 2 layers, at 50 GB/s."""
    cost = step_cost(toy_model, toy_hw, ONE, DECODE_4)
    assert cost.terms["attention"] == pytest.approx(2 * 404 * 64 * 2 / 5e10)


def test_fixed_costs(toy_model: SimModel, toy_hw: Hardware) -> None:
    """10 kernels x 2 layers x 1 us, plus 1 ms per step; the LM head streams 6,400 weights."""
    cost = step_cost(toy_model, toy_hw, ONE, DECODE_4)
    assert cost.terms["kernel_overhead"] == pytest.approx(20e-6)
    assert cost.terms["host_overhead"] == pytest.approx(1e-3)
    assert cost.terms["lm_head"] == pytest.approx(6400 * 2 / 5e10)


def test_tp_allreduce_term(toy_model: SimModel, toy_hw: Hardware) -> None:
    """Two ring all-reduces per layer of 4 x 64 bf16 values over 4 ranks, 5 GB/s, 10 us each."""
    cost = step_cost(toy_model, toy_hw, Parallel(tp=4), DECODE_4)
    one = 1e-5 + 2 * 3 / 4 * (4 * 64 * 2) / 5e9
    assert cost.terms["tp_allreduce"] == pytest.approx(2 * 2 * one)


def test_moe_terms(toy_moe: SimModel, toy_hw: Hardware) -> None:
    """One token touches its 2 experts (3 x 64 x 32 weights each); DP4 pays two all-to-alls."""
    one_token = BatchShape.from_chunks([(1, 10)])
    cost = step_cost(toy_moe, toy_hw, ONE, one_token)
    assert cost.terms["moe_experts"] == pytest.approx(2 * 2 * 6144 * 2 / 5e10)
    cost = step_cost(toy_moe, toy_hw, Parallel(tp=1, dp=4), DECODE_4)
    exchanged = 4 * 2 * 64 * (1 + 2) * 3 / 4  # tokens x k x hidden x (fp8 + bf16) x remote
    assert cost.terms["ep_alltoall"] == pytest.approx(2 * (2 * 1e-5 + exchanged / 5e9))


def test_r1_single_decode_streams_eight_experts_per_layer() -> None:
    """TP8 on H200: 58 MoE layers x 8 fp8 experts / 8 GPUs at 4.8 TB/s x 0.9."""
    cost = step_cost(R1, H200, TP8, decode_shape(1, 1000))
    assert cost.terms["moe_experts"] == pytest.approx(58 * 8 * 3 * 7168 * 2048 / 8 / 4.32e12)
    assert cost.bound["moe_experts"] == "memory"


def test_mla_cache_is_not_split_by_tp_but_gqa_is() -> None:
    """S9a: every TP rank reads the whole MLA latent cache; GQA ranks read 1/8 each."""
    shape = decode_shape(64, 32_000)
    bytes_only = replace(H200, bf16_flops=1e30)  # so the attention term is its KV bytes
    for model, ratio in ((R1, 1.0), (QWEN, 8.0)):
        one = step_cost(model, bytes_only, ONE, shape).terms["attention"]
        eight = step_cost(model, bytes_only, TP8, shape).terms["attention"]
        assert one / eight == pytest.approx(ratio, rel=0.01)


def test_prefill_is_compute_bound_and_decode_memory_bound() -> None:
    """S1: an 8k-token chunk fills the GPU; a small decode batch only streams weights."""
    prefill = step_cost(R1, H200, TP8, BatchShape.from_chunks([(8192, 0)]))
    decode = step_cost(R1, H200, TP8, decode_shape(8, 4096))
    assert prefill.bound["moe_experts"] == prefill.bound["dense_gemm"] == "compute"
    assert decode.bound["moe_experts"] == decode.bound["dense_gemm"] == "memory"


def test_qo_len_matters_far_more_than_kv_len() -> None:
    """S1: one prefill chunk in the batch costs more than quadrupling every decode's context."""
    decodes = [(1, 2000)] * 16
    base = step_time(R1, H200, TP8, BatchShape.from_chunks(decodes))
    longer_context = step_time(R1, H200, TP8, BatchShape.from_chunks([(1, 8000)] * 16))
    with_prefill = step_time(R1, H200, TP8, BatchShape.from_chunks([*decodes, (4096, 0)]))
    assert with_prefill / base > 3 * (longer_context / base)
    assert with_prefill > 4 * base


def test_kv_transfer_tail_is_one_layer_of_the_last_chunk() -> None:
    """8,192 R1 tokens over 8 NICs (8 x 50 GB/s x 0.78): the tail is 1/61 of the stream."""
    cost = kv_transfer(R1, H200, 8192, 8192, num_nics=8)
    bandwidth = 8 * 50e9 * 0.78
    assert cost.nbytes == 8192 * 70272
    assert cost.stream_s == pytest.approx(8192 * 70272 / bandwidth + 10e-6)
    assert cost.tail_s == pytest.approx((8192 * 576 * 2 + 7168 * 2) / bandwidth + 10e-6)


def test_tokens_per_step_with_drafts() -> None:
    """No draft: 1 token; one draft accepted 85%: 1.85; two: 1 + 0.85 + 0.85^2."""
    assert tokens_per_step(0, 0.85) == 1
    assert tokens_per_step(2, 0.85) == pytest.approx(1 + 0.85 + 0.85**2)


def test_parallel_refuses_tp_and_dp_together() -> None:
    """Combined TP x DP instances are not modelled, so they are refused."""
    with pytest.raises(ValueError, match="choose tp or dp"):
        Parallel(tp=2, dp=4)
