/* Rotate-half RoPE of query or key rows by their token's cos and sin (X8c, S3b).

   In PyTorch the rotation is seven ops (two slices, a negation, a concatenation, two products
   and a sum), each a dispatch and a fresh tensor; a decode step runs it for queries and keys in
   every layer, and for a few rows the dispatch is all the time there is. Here one call rotates
   every head of every token: dimension i pairs with i + dim/2, and

       out[i]        = x[i] cos[i]               - x[i + dim/2] sin[i]
       out[i + dim/2] = x[i + dim/2] cos[i + dim/2] + x[i] sin[i + dim/2]

   with each product and the sum rounded to the rows' dtype in turn, as PyTorch's separate ops
   on bfloat16 tensors round them (and no FMA in float32: the build turns contraction off), so
   the result is PyTorch's bit for bit. `cos` and `sin` are [tokens, dim] in the rows' dtype.
   Tokens are split over OpenMP threads when there are enough. Returns 0, or -1 without AVX-512
   or for an odd dim: the caller then runs the PyTorch reference (`rope.py`). */

#include <stdint.h>

#include "bf16.h"
#include "cpu_kernels.h"

/* Below this many elements one thread is faster than waking a team. */
#define ROT_PARALLEL_MIN (1 << 16)

#if defined(__x86_64__)

/* -v by its sign bit, as torch's neg (0 - v would turn -0 into +0). */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline __m512 rot_negated(__m512 v) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v),
                                                _mm512_set1_epi32((int)0x80000000u)));
}

/* One token's `heads` rows. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static void rot_token(const char *x, const char *cos, const char *sin, char *out,
                      int64_t heads, int64_t dim, int bf16) {
    const int64_t half = dim / 2, itemsize = bf16 ? 2 : 4;
    for (int64_t h = 0; h < heads; h++) {
        const char *row = x + h * dim * itemsize;
        char *dst = out + h * dim * itemsize;
        for (int64_t i = 0; i < half; i += 16) {
            __mmask16 m = lanes_mask(half, i);
            __m512 lo = lanes_load(row, i, bf16, m), hi = lanes_load(row, i + half, bf16, m);
            __m512 lo_cos = lanes_as_dtype(_mm512_mul_ps(lo, lanes_load(cos, i, bf16, m)), bf16);
            __m512 hi_sin = lanes_as_dtype(
                _mm512_mul_ps(rot_negated(hi), lanes_load(sin, i, bf16, m)), bf16);
            __m512 hi_cos = lanes_as_dtype(
                _mm512_mul_ps(hi, lanes_load(cos, i + half, bf16, m)), bf16);
            __m512 lo_sin = lanes_as_dtype(
                _mm512_mul_ps(lo, lanes_load(sin, i + half, bf16, m)), bf16);
            lanes_store(dst, i, bf16, m, _mm512_add_ps(lo_cos, hi_sin));
            lanes_store(dst, i + half, bf16, m, _mm512_add_ps(hi_cos, lo_sin));
        }
    }
}

static int rot_run(int bf16, const char *x, const char *cos, const char *sin, char *out,
                   int64_t tokens, int64_t heads, int64_t dim, int threads) {
    if (!sl_has_avx512() || dim % 2) return -1;
    const int64_t itemsize = bf16 ? 2 : 4, row = heads * dim * itemsize;
    int team = threads < 1 || tokens * heads * dim < ROT_PARALLEL_MIN ? 1
               : (tokens < threads ? (int)tokens : threads);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (int64_t t = 0; t < tokens; t++)
        rot_token(x + t * row, cos + t * dim * itemsize, sin + t * dim * itemsize,
                  out + t * row, heads, dim, bf16);
    return 0;
}

#else

static int rot_run(int bf16, const char *x, const char *cos, const char *sin, char *out,
                   int64_t tokens, int64_t heads, int64_t dim, int threads) {
    (void)bf16; (void)x; (void)cos; (void)sin; (void)out; (void)tokens; (void)heads;
    (void)dim; (void)threads;
    return -1;
}

#endif

/* out <- x rotated, for x and out [tokens, heads, dim] and cos, sin [tokens, dim], contiguous;
   dtype 0 float32, 1 bfloat16 (all four alike). Addresses as integers, as `sl_linear` takes
   them. */
int rot_rotate_half(int dtype, uintptr_t x, uintptr_t cos, uintptr_t sin, uintptr_t out,
                    int64_t tokens, int64_t heads, int64_t dim, int threads) {
    if ((dtype != 0 && dtype != 1) || tokens < 0 || heads < 0 || dim < 2) return -1;
    return rot_run(dtype == 1, (const char *)x, (const char *)cos, (const char *)sin,
                   (char *)out, tokens, heads, dim, threads);
}
