"""Qwen3-MoE's routing of a decode step's rows in C (`moe_route.c`, X8e) against PyTorch's
softmax and topk (`moe_routing.softmax_top_k`'s reference path): the same experts, the same
weights to float32's rounding; ties to the lower expert, a NaN logit poisoning its row."""

from __future__ import annotations

import pytest
import torch

from disagg.model import moe_routing
from disagg.model.cpu_kernels import ENABLED
from disagg.model.linear import KERNEL_ROWS
from disagg.model.moe_routing import softmax_top_k, takes_kernel
from tests.disagg.model.counting_lib import CountingLib

needs_kernel = pytest.mark.skipif(not ENABLED, reason="the CPU kernels are not built")


def _reference(logits: torch.Tensor, top_k: int, normalise: bool,
               monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    with monkeypatch.context() as patch:
        patch.setattr(moe_routing, "ENABLED", False)
        return softmax_top_k(logits, top_k, normalise)


@needs_kernel
@pytest.mark.parametrize("normalise", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_picks_and_weighs_as_pytorch(monkeypatch: pytest.MonkeyPatch,
                                                 dtype: torch.dtype, normalise: bool) -> None:
    torch.manual_seed(0)
    # 8 rows: with more, two bfloat16 logits tie within a row's top 8, whose order
    # torch.topk leaves open (the kernel's is the next test's).
    logits = (torch.randn(8, 64) * 3).to(dtype)
    assert takes_kernel(logits)
    weights, experts = softmax_top_k(logits, 8, normalise)
    want_weights, want_experts = _reference(logits, 8, normalise, monkeypatch)
    assert torch.equal(experts, want_experts)
    assert weights.dtype == dtype
    # One float32 rounding apart before the cast (the exponentials' and the sums' order).
    tolerance = {"rtol": 1e-6, "atol": 0.0} if dtype == torch.float32 else {"rtol": 8e-3,
                                                                             "atol": 0.0}
    torch.testing.assert_close(weights, want_weights, **tolerance)


@needs_kernel
def test_ties_go_to_the_lower_expert_and_a_nan_poisons_only_its_row() -> None:
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    assert softmax_top_k(tied, 2, False)[1].tolist() == [[1, 2]]
    poisoned = torch.tensor([[1.0, 2.0, float("nan"), 0.0], [1.0, 2.0, 3.0, 0.0]])
    weights, experts = softmax_top_k(poisoned, 2, True)
    assert weights[0].isnan().all()  # as PyTorch's softmax poisons the row
    assert experts[1].tolist() == [2, 1] and not weights[1].isnan().any()


@needs_kernel
def test_a_decode_steps_rows_run_in_c_and_a_prefills_in_pytorch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingLib(moe_routing.lib, "mr_softmax_top_k", slice(2, 5))  # rows, E, k
    monkeypatch.setattr(moe_routing, "lib", counting)
    softmax_top_k(torch.randn(KERNEL_ROWS, 16), 2, True)
    softmax_top_k(torch.randn(KERNEL_ROWS + 1, 16), 2, True)
    assert counting.calls == [(KERNEL_ROWS, 16, 2)]
