"""The greedy token of one logits row, in `logits_argmax.c` where it can run (X8g).

`torch.argmax` over a vocabulary's row is a general reduction carrying an index per element:
~180 us for SmolLM2's 49,152 bfloat16 logits here, as long as a few of its decode layers. The
kernel gives the same index (a NaN counts as the largest, ties go to the first) in two
vectorised passes. Anything else (another dtype or device, a batch of rows, no AVX-512, a
trace) runs `torch.argmax`, which is also the reference the kernel is tested against.
"""

from __future__ import annotations

import torch

from disagg.errors import KernelError
from disagg.model.cpu_kernels import AVX512, DTYPE_CODES, lib, traced


def takes_kernel(logits: torch.Tensor) -> bool:
    """Whether `argmax(logits)` runs in C: one contiguous non-empty CPU row of float32 or
    bfloat16 on a CPU with AVX-512."""
    return (AVX512 and logits.dtype in DTYPE_CODES and logits.is_cpu and logits.dim() == 1
            and logits.numel() > 0 and logits.is_contiguous() and not traced())


def argmax(logits: torch.Tensor) -> int:
    """The index of the largest of ``[vocab_size]`` logits, as `int(torch.argmax(logits))`."""
    if not takes_kernel(logits):
        return int(torch.argmax(logits))
    index = lib.la_argmax(DTYPE_CODES[logits.dtype], logits.data_ptr(), logits.numel())
    if index < 0:  # the checks above rule every refusal out; a refusal is a bug here
        raise KernelError(f"logits_argmax refused a {logits.dtype} row of {logits.numel()}")
    return int(index)
