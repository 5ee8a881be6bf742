"""SwiGLU's activation, silu(gate) * up, with a C loop for a decode's rows (X8e).

A decode step's layers can run in one C call (`decode_layers.py`), and that call computes the
activation itself; for its hidden state to have the bits of the PyTorch loop, the loop
computes the same rows with the same C function (`decode_layers.c`'s `dl_silu_mul`, each op
rounded as PyTorch's `F.silu(gate).mul_(up)` rounds it; only the exponential may differ from
PyTorch's vectorised one by its last bit). More rows than a decode step's, and everything the
kernels do not take, run PyTorch's two ops, the reference the kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disagg.errors import KernelError
from disagg.model.cpu_kernels import AVX512, DTYPE_CODES, lib, named_call, traced
from disagg.model.linear import KERNEL_ROWS

PROFILER_NAME = "disagg::silu_mul"


def takes_kernel(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `silu_mul(gate, up)` runs in C: at most `KERNEL_ROWS` contiguous CPU rows of
    float32 or bfloat16, `up` alike, no gradient to record."""
    return (AVX512 and gate.dtype in DTYPE_CODES and up.dtype == gate.dtype
            and gate.shape == up.shape and gate.dim() >= 1 and gate.shape[-1] > 0
            and gate.numel() <= KERNEL_ROWS * gate.shape[-1]
            and gate.is_cpu and up.is_cpu and gate.is_contiguous() and up.is_contiguous()
            and not torch.is_grad_enabled() and not traced())


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; without autograd, in place in `gate` (a prefill's largest tensor
    per layer is not made twice more)."""
    if takes_kernel(gate, up):
        return named_call(PROFILER_NAME, _kernel, gate, up)
    if torch.is_grad_enabled():
        return F.silu(gate) * up
    return F.silu(gate, inplace=True).mul_(up)


def _kernel(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    status = lib.dl_silu_mul(DTYPE_CODES[gate.dtype], gate.data_ptr(), up.data_ptr(),
                             gate.numel())
    if status != 0:  # takes_kernel rules every refusal out: a refusal here is a bug
        raise KernelError(f"silu_mul refused {tuple(gate.shape)} {gate.dtype}")
    return gate
