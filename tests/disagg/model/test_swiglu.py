"""SwiGLU's activation (`disagg.model.swiglu`, X8e): the C loop against PyTorch's two ops, in
place, and PyTorch's ops wherever the kernel does not take the rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.model import swiglu
from disagg.model.cpu_kernels import AVX512
from disagg.model.linear import KERNEL_ROWS
from disagg.model.swiglu import silu_mul, takes_kernel
from tests.disagg.model.counting_lib import CountingLib

needs_kernel = pytest.mark.skipif(not AVX512, reason="no AVX-512 (or the kernels are not built)")


def _pair(rows: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    # Wide enough that silu's both tails (x/(1+e^-x) near 0 and near x) are exercised.
    return (torch.randn(rows, width) * 8).to(dtype), torch.randn(rows, width).to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_matches_pytorchs_silu_times_up(dtype: torch.dtype) -> None:
    gate, up = _pair(3, 200, dtype)
    expected = F.silu(gate) * up
    with torch.inference_mode():
        assert takes_kernel(gate, up)
        got = silu_mul(gate.clone(), up)
    # Each op rounds as PyTorch's: only the exponential may differ, by its last bit, and so
    # silu's rounding in a rare element (bfloat16: one unit of 2^-7; a missing rounding of
    # silu before the product would move about a quarter of them).
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got, expected, rtol=2 ** -7, atol=1e-5)
        assert (got != expected).float().mean() < 0.02


@needs_kernel
def test_the_result_is_written_over_gate() -> None:
    gate, up = _pair(2, 64, torch.float32)
    with torch.inference_mode():
        assert silu_mul(gate, up).data_ptr() == gate.data_ptr()


@needs_kernel
def test_a_decode_steps_rows_run_in_c_and_a_prefills_in_pytorch(monkeypatch) -> None:
    counting = CountingLib(swiglu.lib, "dl_silu_mul", slice(3, 4))  # elements
    monkeypatch.setattr(swiglu, "lib", counting)
    with torch.inference_mode():
        silu_mul(*_pair(KERNEL_ROWS, 16, torch.float32))
        gate, up = _pair(KERNEL_ROWS + 1, 16, torch.float32)
        expected = F.silu(gate) * up
        assert torch.equal(silu_mul(gate, up), expected)
    assert counting.calls == [(KERNEL_ROWS * 16,)]


def test_with_autograd_gate_keeps_its_values() -> None:
    gate, up = _pair(2, 8, torch.float32)
    gate.requires_grad_(True)
    before = gate.detach().clone()
    out = silu_mul(gate, up)
    out.sum().backward()
    assert torch.equal(gate.detach(), before)
    assert gate.grad is not None
