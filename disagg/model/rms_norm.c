/* RMSNorm of token rows, computed as transformers' LlamaRMSNorm computes it (X8c).

   In PyTorch a norm is five ops on the CPU (square, mean, add, rsqrt, product) plus the casts
   and the weight's product: for a decode step's few rows, tens of microseconds of dispatch
   around nanoseconds of arithmetic, twice per layer. Here one call does a row in registers:
   the float32 sum of squares over the row, divided by its width, plus eps, 1 / sqrt (IEEE,
   as torch's rsqrt on a CPU), each element times that in float32, rounded to the row's dtype,
   then times the weight and rounded again (bfloat16 products are float32 products rounded).
   Every step rounds as PyTorch's does; only the order of the sum of squares differs. Rows are
   split over OpenMP threads when there are enough. Returns 0, or -1 without AVX-512: the
   caller then runs the PyTorch reference (`norms.py`). */

#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "cpu_kernels.h"

/* Below this many elements one thread is faster than waking a team. */
#define RN_PARALLEL_MIN (1 << 16)

#if defined(__x86_64__)

__attribute__((target("avx512f,avx512bw,avx512vl")))
static void rn_row(const void *x, const void *weight, void *out, int64_t width, float eps,
                   int bf16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < width; i += 16) {
        __m512 v = lanes_load(x, i, bf16, lanes_mask(width, i));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v)); /* no FMA: each square rounds */
    }
    float mean = _mm512_reduce_add_ps(acc) / (float)width;
    __m512 scale = _mm512_set1_ps(1.0f / sqrtf(mean + eps));
    for (int64_t i = 0; i < width; i += 16) {
        __mmask16 m = lanes_mask(width, i);
        __m512 normed = lanes_as_dtype(_mm512_mul_ps(lanes_load(x, i, bf16, m), scale), bf16);
        lanes_store(out, i, bf16, m, _mm512_mul_ps(lanes_load(weight, i, bf16, m), normed));
    }
}

static int rn_run(int bf16, const char *x, const void *weight, char *out, int64_t rows,
                  int64_t width, float eps, int threads) {
    if (!sl_has_avx512()) return -1;
    int64_t row_bytes = width * (bf16 ? 2 : 4);
    int team = threads < 1 || rows * width < RN_PARALLEL_MIN ? 1
               : (rows < threads ? (int)rows : threads);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (int64_t r = 0; r < rows; r++)
        rn_row(x + r * row_bytes, weight, out + r * row_bytes, width, eps, bf16);
    return 0;
}

#else

static int rn_run(int bf16, const char *x, const void *weight, char *out, int64_t rows,
                  int64_t width, float eps, int threads) {
    (void)bf16; (void)x; (void)weight; (void)out; (void)rows; (void)width; (void)eps;
    (void)threads;
    return -1;
}

#endif

/* out[r] = weight * rms_norm(x[r]) for `rows` contiguous rows of `width`; dtype 0 float32,
   1 bfloat16 (x, weight and out alike). Addresses as integers, as `sl_linear` takes them. */
int rn_rms_norm(int dtype, uintptr_t x, uintptr_t weight, uintptr_t out, int64_t rows,
                int64_t width, float eps, int threads) {
    if ((dtype != 0 && dtype != 1) || rows < 0 || width < 1) return -1;
    return rn_run(dtype == 1, (const char *)x, (const void *)weight, (char *)out, rows, width,
                  eps, threads);
}
