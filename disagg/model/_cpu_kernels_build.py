"""cffi out-of-line API-mode builder for `disagg.model._cpu_kernels`, the CPU kernels (X8): the
decode projections (`small_linear.c`, used by `linear.py`), paged decode attention
(`decode_attention.c`, used by `decode_attention.py`), RMSNorm (`rms_norm.c`, `norms.py`) and
RoPE (`rotary.c`, `rope.py`), a decode step's layers in one call, SwiGLU's activation and
Qwen3-MoE's routing (`decode_layers.c`, `moe_route.c`; `decode_layers.py`, `swiglu.py` and
`moe_routing.py`), and the KV checksum's weighted lane
sum (`kv_lane_sum.c`, used by `disagg/kv_transfer/kv_checksum.py`, X4c).

cffi releases the GIL around each call, and each kernel splits its work over OpenMP threads.
Built by setuptools through setup.py's `cffi_modules`, or in place with
`python disagg/model/_cpu_kernels_build.py` from the repository root.
"""

from __future__ import annotations

import pathlib

import cffi

CDEF = """
int sl_has_avx512(void);
int sl_has_avx512_bf16(void);
int sl_linear(int dtype, uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m,
              int64_t n, int64_t k, int threads);
int da_decode_attention(int bf16, int layout, uintptr_t q, uintptr_t layer, uintptr_t table,
                        uintptr_t kv_lens, uintptr_t out, int64_t batch, int64_t max_pages,
                        int64_t num_pages, int64_t page_size, int64_t cache_heads,
                        int64_t head_dim, int64_t head_start, int64_t num_kv_heads,
                        int64_t group, float scale, int threads);
int rn_rms_norm(int dtype, uintptr_t x, uintptr_t weight, uintptr_t out, int64_t rows,
                int64_t width, float eps, int threads);
int rot_rotate_half(int dtype, uintptr_t x, uintptr_t cos, uintptr_t sin, uintptr_t out,
                    int64_t tokens, int64_t heads, int64_t dim, int threads);
int dl_silu_mul(int dtype, uintptr_t gate, uintptr_t up, int64_t n);
int mr_softmax_top_k(int dtype, uintptr_t logits, int64_t rows, int64_t num_experts,
                     int64_t top_k, int normalise, uintptr_t weights, uintptr_t experts,
                     uintptr_t probs);
int dl_decode_layers(int dtype, int layout, uintptr_t weights, int64_t num_layers, uintptr_t h,
                     int64_t rows, uintptr_t cos, uintptr_t sin, uintptr_t cache,
                     int64_t num_pages, int64_t page_size, uintptr_t table, int64_t max_pages,
                     uintptr_t kv_lens, uintptr_t slot_pages, uintptr_t slot_offsets,
                     int64_t hidden, int64_t num_heads, int64_t kv_heads, int64_t dim,
                     int64_t inter, int64_t num_experts, int64_t top_k, int normalise,
                     int64_t moe_inter, float eps, float scale, int threads);
uint64_t kls_lane_sum(uintptr_t values, int lane_bytes, int64_t heads, int64_t tokens,
                      int64_t lanes, uintptr_t head_ids, int64_t first_position, uint64_t seed,
                      int threads);
uint64_t kls_layers_sum(uintptr_t pages, int64_t offset, int64_t layer_stride, int64_t layers_n,
                        uintptr_t seeds, int64_t page_size, int64_t first_row, int lane_bytes,
                        int64_t heads, int64_t tokens, int64_t lanes, int64_t head_stride,
                        int64_t token_stride, uintptr_t head_ids, int64_t first_position,
                        int threads);
"""

_HERE = pathlib.Path(__file__).resolve().parent
SOURCES = ("small_linear.c", "decode_attention.c", "rms_norm.c", "rotary.c", "kv_lane_sum.c",
           "moe_route.c", "decode_layers.c")

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
