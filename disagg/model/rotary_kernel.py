"""Rotate-half RoPE in one C call for CPU rows (X8c): `rotary.c`, bit for bit the PyTorch
rotation of `rope._rotate_half` (each product and the sum rounded to the rows' dtype in turn),
without its seven ops per call. `rope.RotaryAngles.rotate` calls it when `takes_kernel` holds.
"""

from __future__ import annotations

import torch

from disagg.errors import KernelError
from disagg.model.cpu_kernels import AVX512, DTYPE_CODES, lib, named_call, traced

PROFILER_NAME = "disagg::rotary"


def takes_kernel(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rotate_half(x, cos, sin)` runs in C: contiguous CPU rows ``[tokens, heads,
    dim]`` of float32 or bfloat16, an even dim above 0, angles in their dtype, no gradient to
    record."""
    return (AVX512 and x.dtype in DTYPE_CODES and cos.dtype == x.dtype and x.dim() == 3
            and x.shape[-1] % 2 == 0 and x.shape[-1] > 0 and x.is_cpu and x.is_contiguous()
            and not (torch.is_grad_enabled() and x.requires_grad) and not traced())


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` ``[tokens, heads, dim]`` rotated by `cos`, `sin` (``[tokens, 1, dim]`` or
    ``[tokens, dim]``, contiguous, in `x`'s dtype and on its device)."""
    return named_call(PROFILER_NAME, _run, x, cos, sin)


def _run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    tokens, heads, dim = x.shape
    for name, angle in (("cos", cos), ("sin", sin)):
        if (angle.dtype != x.dtype or angle.numel() != tokens * dim
                or not angle.is_contiguous() or angle.device != x.device):
            raise KernelError(f"rotary {name} {tuple(angle.shape)} {angle.dtype} does not fit "
                              f"{tokens} tokens of {dim} in {x.dtype}")
    out = torch.empty_like(x)
    status = lib.rot_rotate_half(DTYPE_CODES[x.dtype], x.data_ptr(), cos.data_ptr(),
                                 sin.data_ptr(), out.data_ptr(), tokens, heads, dim,
                                 torch.get_num_threads())
    if status != 0:  # takes_kernel rules every refusal out: a refusal here is a bug
        raise KernelError(f"rotary refused {tuple(x.shape)} {x.dtype}")
    return out
