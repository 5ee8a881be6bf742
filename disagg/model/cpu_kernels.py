"""The model's compiled CPU kernels, and which of them this process may run (X8).

`_cpu_kernels` is built from the C files `_cpu_kernels_build.py` lists when the project is
installed. Each kernel has a PyTorch reference beside it that runs whenever the kernel cannot:
the module was not built, the CPU lacks the instructions, or `DISAGG_CPU_KERNELS=0` was set
before import (to compare the two paths).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.profiler import record_function

try:
    from disagg.model._cpu_kernels import lib
except ImportError:  # not built (a source checkout without `pip install -e .`)
    lib = None

ENABLED = lib is not None and os.environ.get("DISAGG_CPU_KERNELS", "1") != "0"
# Whether the CPU multiplies bfloat16 natively (AVX-512 BF16; AMX comes with it), whatever
# DISAGG_CPU_KERNELS says: PyTorch's own bfloat16 GEMMs are slow without it (`linear.widens`).
# Unknown without the module: taken as no.
NATIVE_BF16 = lib is not None and bool(lib.sl_has_avx512_bf16())
# What the CPU offers the kernels: AVX-512 (F, BW, VL) for every kernel's float32 and
# bfloat16 (the projections' bfloat16 sums with AVX-512 BF16's dot products where it has them).
AVX512 = bool(ENABLED and lib.sl_has_avx512())
AVX512_BF16 = ENABLED and NATIVE_BF16

# torch dtype -> the C side's flag for it (0 float32, 1 bfloat16).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_profiling = torch._C._autograd._profiler_enabled  # a C call: ~0.1 us per kernel call
T = TypeVar("T")


def traced() -> bool:
    """Whether torch.compile or the JIT tracer is recording: a cffi call would be invisible to
    either (a graph break or a constant), so every kernel's caller runs PyTorch then."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def named_call(name: str, kernel: Callable[..., T], *args: object) -> T:
    """`kernel(*args)`; while torch.profiler records, as a span called `name`: a cffi call is
    no torch op, and would otherwise vanish into the profile's time outside ops."""
    if _profiling():
        with record_function(name):
            return kernel(*args)
    return kernel(*args)
