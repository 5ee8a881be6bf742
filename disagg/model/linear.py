"""The model's projections, with a small C kernel for the few rows of a decode step (X8a).

A decode step multiplies one row per sequence by every weight once: its time is the time to
stream the weights. PyTorch's CPU matrix-vector products read them at a third to a half of the
rate `torch.sum` reaches on the same buffer (`benchmarks/profile_engine.py`, measured on this
machine), so for up to `KERNEL_ROWS` rows of float32 or bfloat16 on a CPU with AVX-512 the
product runs in `small_linear.c`, which streams each weight row once into the rows'
accumulators (`MAX_ROWS` of them at a time, in registers; more rows go in groups over each
chunk of weight rows while it is in the cache). bfloat16 takes AVX-512 BF16's dot products
where the CPU has them and the same sums from float32 FMAs where it does not (PyTorch's own
bfloat16 products are slowest there).
Everything else, prefill chunks, other dtypes and devices, autograd, runs `F.linear`, which
is also the reference the kernel is tested against; on a CPU without AVX-512 BF16 a bfloat16
prefill chunk's product runs it in float32 (`widens`).
Set `DISAGG_CPU_KERNELS=0` before import to run the reference everywhere (for comparison).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disagg.errors import KernelError
from disagg.model.cpu_kernels import AVX512, DTYPE_CODES, NATIVE_BF16, lib, named_call, traced

# The token rows one pass over a weight row keeps in registers (`small_linear.c`'s SL_MAX_ROWS).
MAX_ROWS = 8
# The most rows the projections' kernel takes, in groups of MAX_ROWS (`small_linear.c`'s
# SL_MAX_TOKEN_ROWS): beyond, oneDNN's GEMM is as fast. Also the most decode rows the other
# decode kernels take and the layers' one C call runs (`decode_layers.py`), so that a batch's
# rows meet the same kernels either way.
KERNEL_ROWS = 32
# How the kernel's calls appear in torch.profiler's tables (`benchmarks/profile_engine.py`).
PROFILER_NAME = "disagg::small_linear"

# dtype -> the C side's code for it, when this CPU has the ISA (the C side picks bfloat16's
# instructions).
_KERNELS: dict[torch.dtype, int] = dict(DTYPE_CODES) if AVX512 else {}


def takes_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear(x, weight, bias)` runs in C: a CPU tensor of at most `KERNEL_ROWS` rows
    in the weight's dtype, a plain contiguous 2-D weight, and no gradient to record."""
    return (weight.dtype in _KERNELS and x.dtype == weight.dtype
            and x.is_cpu and weight.is_cpu
            and weight.dim() == 2 and weight.is_contiguous()
            and x.dim() >= 1 and x.shape[-1] == weight.shape[1]
            and 0 < x.numel() // weight.shape[1] <= KERNEL_ROWS
            and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()
                                  and bias.is_cpu
                                  and bias.shape == weight.shape[:1]))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
            and not traced())


def widens(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a bfloat16 product on this CPU runs in float32 (`linear`): many rows on a CPU
    without AVX-512 BF16, whose PyTorch bfloat16 GEMMs are several times slower than float32's
    (a 512 x 576 by 576 x 1536 product on an Ice Lake Xeon: 18 ms against 5, widening
    included). Both sum float32 products of the same bfloat16 values and round once."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and not NATIVE_BF16
            and x.is_cpu and weight.is_cpu and x.numel() > KERNEL_ROWS * weight.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` over `x`'s last axis, like `F.linear`."""
    if takes_kernel(x, weight, bias):
        return named_call(PROFILER_NAME, _kernel, x, weight, bias)
    if widens(x, weight):
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)
    return F.linear(x, weight, bias)


def _kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = weight.shape
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    out = x.new_empty((rows.shape[0], n))
    status = lib.sl_linear(_KERNELS[weight.dtype], rows.data_ptr(), weight.data_ptr(),
                           0 if bias is None else bias.data_ptr(), out.data_ptr(),
                           rows.shape[0], n, k, torch.get_num_threads())
    if status != 0:  # the checks above rule every refusal out; a refusal is a bug here
        raise KernelError(f"small_linear refused {tuple(rows.shape)} x {tuple(weight.shape)}")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state-dict names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
