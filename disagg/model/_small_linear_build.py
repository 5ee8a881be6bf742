"""cffi out-of-line API-mode builder for `disagg.model._small_linear`, the decode projections'
kernel (X8a: the decode step streams the weights; `linear.py` says when it runs).

The C is `small_linear.c` beside this file; cffi releases the GIL around each call, and the
kernel splits its rows over OpenMP threads. Built by setuptools through setup.py's
`cffi_modules`, or in place with `python disagg/model/_small_linear_build.py` from the
repository root.
"""

from __future__ import annotations

import pathlib

import cffi

CDEF = """
int sl_has_avx512(void);
int sl_has_avx512_bf16(void);
int sl_linear(int dtype, uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m,
              int64_t n, int64_t k, int threads);
"""

_HERE = pathlib.Path(__file__).resolve().parent

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "disagg.model._small_linear",
    (_HERE / "small_linear.c").read_text(),
    # -fopenmp links libgomp.so.1, the soname of the runtime torch loads first, so the kernel
    # and torch's own operators share one thread pool.
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-fopenmp"],
    extra_link_args=["-fopenmp"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(_HERE.parent.parent), verbose=False)
