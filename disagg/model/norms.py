"""RMSNorm, the one normalisation every supported architecture uses (S3b; one call, X8c).

On a CPU with AVX-512, rows of float32 or bfloat16 are normalised by `rms_norm.c` in one call;
everything else (other dtypes and devices, autograd, `DISAGG_CPU_KERNELS=0`) runs the PyTorch
reference, `reference_rms_norm`, which equals transformers' LlamaRMSNorm bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disagg.errors import KernelError
from disagg.model.cpu_kernels import AVX512, DTYPE_CODES, lib, named_call, traced

PROFILER_NAME = "disagg::rms_norm"


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def takes_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm(x, weight, eps)` runs in C: contiguous CPU rows in the weight's dtype
    (float32 or bfloat16) and no gradient to record."""
    return (AVX512 and x.dtype in DTYPE_CODES and weight.dtype == x.dtype
            and x.is_cpu and weight.is_cpu
            and x.is_contiguous() and weight.is_contiguous() and x.dim() >= 1
            and weight.dim() == 1 and weight.shape[0] == x.shape[-1] > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not traced())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over `x`'s last axis, in float32, then rounded
    to `x`'s dtype before the weight's product, as transformers computes it."""
    if not takes_kernel(x, weight):
        return reference_rms_norm(x, weight, eps)
    return named_call(PROFILER_NAME, _kernel, x, weight, eps)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' x * rsqrt(mean(x^2) + eps) in float32, as one op instead of five (the
    # same bits: tests/disagg/model/test_norms.py), then its rounding and weight.
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def _kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    width = x.shape[-1]
    status = lib.rn_rms_norm(DTYPE_CODES[x.dtype], x.data_ptr(), weight.data_ptr(),
                             out.data_ptr(), x.numel() // width, width, eps,
                             torch.get_num_threads())
    if status != 0:  # takes_kernel rules every refusal out: a refusal here is a bug
        raise KernelError(f"rms_norm refused rows of {width} in {x.dtype}")
    return out
