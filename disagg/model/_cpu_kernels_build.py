"""cffi out-of-line API-mode builder for `disagg.model._cpu_kernels`, the CPU kernels (X8): the
decode projections (`small_linear.c`, used by `linear.py`), paged decode attention
(`decode_attention.c`, used by `decode_attention.py`), RMSNorm (`rms_norm.c`, `norms.py`) and
RoPE (`rotary.c`, `rope.py`), a decode step's layers in one call, SwiGLU's activation and
Qwen3-MoE's routing (`decode_layers.c`, `moe_route.c`; `decode_layers.py`, `swiglu.py` and
`moe_routing.py`), the greedy token's argmax (`logits_argmax.c`, `disagg/engine/sampling.py`),
and the KV checksum's weighted lane sum (`kv_lane_sum.c`, used by
`disagg/kv_transfer/kv_checksum.py`, X4c).

cffi releases the GIL around each call, and each kernel splits its work over OpenMP threads.
Built by setuptools through setup.py's `cffi_modules`, or in place with
`python disagg/model/_cpu_kernels_build.py` from the repository root.
"""

from __future__ import annotations

import pathlib

import cffi

_HERE = pathlib.Path(__file__).resolve().parent
# The entry points, declared once for the C files and for cffi.
CDEF = (_HERE / "cpu_kernels.h").read_text()
SOURCES = ("small_linear.c", "decode_attention.c", "rms_norm.c", "rotary.c", "kv_lane_sum.c",
           "moe_route.c", "decode_layers.c", "logits_argmax.c")

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "disagg.model._cpu_kernels",
    # One translation unit: the kernels share bf16.h's helpers and the ISA checks.
    "\n".join((_HERE / name).read_text() for name in SOURCES),
    include_dirs=[str(_HERE)],
    # -fopenmp links libgomp.so.1, the soname of the runtime torch loads first, so the kernels
    # and torch's own operators share one thread pool.
    # No contraction of a product and a sum into an FMA: the norm and RoPE round each op as
    # PyTorch does (the kernels that want FMAs ask for them by intrinsic).
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-fopenmp", "-ffp-contract=off"],
    extra_link_args=["-fopenmp"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(_HERE.parent.parent), verbose=False)
