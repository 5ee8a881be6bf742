/* y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) for a few rows m: a decode step's projections.

   At decode a projection multiplies one to eight token rows by a weight that is read once, so
   the step is a stream of weight bytes and nothing else; the kernel's only job is to keep that
   stream at the memory's rate. Every weight row is loaded once, 16 floats (or 32 bf16) at a
   time, and multiplied into the m accumulators of the m token rows, which stay in registers.
   Output rows are split into contiguous blocks, one per OpenMP thread.

   float32 uses AVX-512F FMAs; bfloat16 uses AVX-512 BF16's dot products, which accumulate pairs
   of bf16 products in float32. The result is rounded once, to nearest-even, after the bias is
   added in float32. The functions return -1 when the CPU lacks the instructions (or is not
   x86-64): the caller then runs the pure-PyTorch reference (`linear.py`). */

#include <stdint.h>

#include "bf16.h"

#define SL_MAX_ROWS 8
/* Below this many weight elements one thread streams the matrix faster than a team starts. */
#define SL_PARALLEL_MIN (1 << 16)
/* Blocks of output rows keep each thread's part of the weight contiguous. */
#define SL_ROW_BLOCK 16

enum { SL_FLOAT32 = 0, SL_BFLOAT16 = 1 };

#if defined(__x86_64__)
#include <immintrin.h>
#include <omp.h>

int sl_has_avx512(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl");
}

int sl_has_avx512_bf16(void) {
    return sl_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

/* One weight row j against m token rows; m is a literal at every call site, so the
   accumulator array becomes m registers. */
__attribute__((target("avx512f,avx512bw"), always_inline))
static inline void sl_f32_row(const float *x, const float *wr, float *out, int m, int64_t k,
                              int64_t ldx) {
    __m512 acc[SL_MAX_ROWS];
    for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 wv = _mm512_loadu_ps(wr + i);
        for (int r = 0; r < m; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + i), wv, acc[r]);
    }
    if (i < k) {
        __mmask16 tail = (__mmask16)((1u << (k - i)) - 1u);
        __m512 wv = _mm512_maskz_loadu_ps(tail, wr + i);
        for (int r = 0; r < m; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + r * ldx + i), wv, acc[r]);
    }
    for (int r = 0; r < m; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))
static inline void sl_bf16_row(const uint16_t *x, const uint16_t *wr, float *out, int m,
                               int64_t k, int64_t ldx) {
    __m512 acc[SL_MAX_ROWS];
    for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + i);
        for (int r = 0; r < m; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(x + r * ldx + i), wv);
    }
    if (i < k) {
        __mmask32 tail = (__mmask32)((1ull << (k - i)) - 1ull);
        __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + i);
        for (int r = 0; r < m; r++)
            acc[r] = _mm512_dpbf16_ps(
                acc[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + r * ldx + i), wv);
    }
    for (int r = 0; r < m; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* Output rows [j0, j1) for a literal M. */
/* Every block function takes its arrays untyped, so that one table and one dispatch
   (`sl_linear`) serve both dtypes. */
typedef void (*sl_block_fn)(const void *, const void *, const void *, void *, int64_t, int64_t,
                            int64_t, int64_t);

#define SL_F32_BLOCK(M)                                                                     \
    __attribute__((target("avx512f,avx512bw")))                                             \
    static void sl_f32_block_##M(const void *xv, const void *wv, const void *bv, void *yv,   \
                                 int64_t n, int64_t k, int64_t j0, int64_t j1) {              \
        const float *x = xv, *w = wv, *bias = bv;                                            \
        float *y = yv, out[SL_MAX_ROWS];                                                     \
        for (int64_t j = j0; j < j1; j++) {                                                  \
            sl_f32_row(x, w + j * k, out, M, k, k);                                          \
            float b = bias ? bias[j] : 0.0f;                                                 \
            for (int r = 0; r < M; r++) y[r * n + j] = out[r] + b;                           \
        }                                                                                    \
    }

#define SL_BF16_BLOCK(M)                                                                    \
    __attribute__((target("avx512f,avx512bw,avx512bf16")))                                  \
    static void sl_bf16_block_##M(const void *xv, const void *wv, const void *bv, void *yv,  \
                                  int64_t n, int64_t k, int64_t j0, int64_t j1) {             \
        const uint16_t *x = xv, *w = wv, *bias = bv;                                         \
        uint16_t *y = yv;                                                                    \
        float out[SL_MAX_ROWS];                                                              \
        for (int64_t j = j0; j < j1; j++) {                                                  \
            sl_bf16_row(x, w + j * k, out, M, k, k);                                         \
            float b = bias ? sl_bf16_to_f32(bias[j]) : 0.0f;                                 \
            for (int r = 0; r < M; r++) y[r * n + j] = sl_round_bf16(out[r] + b);            \
        }                                                                                    \
    }

SL_F32_BLOCK(1) SL_F32_BLOCK(2) SL_F32_BLOCK(3) SL_F32_BLOCK(4)
SL_F32_BLOCK(5) SL_F32_BLOCK(6) SL_F32_BLOCK(7) SL_F32_BLOCK(8)
SL_BF16_BLOCK(1) SL_BF16_BLOCK(2) SL_BF16_BLOCK(3) SL_BF16_BLOCK(4)
SL_BF16_BLOCK(5) SL_BF16_BLOCK(6) SL_BF16_BLOCK(7) SL_BF16_BLOCK(8)

/* Blocks by dtype (`SL_FLOAT32`, `SL_BFLOAT16`) and number of rows. */
static const sl_block_fn SL_BLOCKS[2][SL_MAX_ROWS + 1] = {
    {0, sl_f32_block_1, sl_f32_block_2, sl_f32_block_3, sl_f32_block_4,
     sl_f32_block_5, sl_f32_block_6, sl_f32_block_7, sl_f32_block_8},
    {0, sl_bf16_block_1, sl_bf16_block_2, sl_bf16_block_3, sl_bf16_block_4,
     sl_bf16_block_5, sl_bf16_block_6, sl_bf16_block_7, sl_bf16_block_8}};

static int sl_team(int64_t n, int64_t k, int threads) {
    if (threads < 1 || n * k < SL_PARALLEL_MIN) return 1;
    int64_t blocks = (n + SL_ROW_BLOCK - 1) / SL_ROW_BLOCK;
    return blocks < threads ? (int)blocks : threads;
}

/* Thread t of `team` takes its share of whole row blocks. */
static void sl_share(int64_t n, int t, int team, int64_t *j0, int64_t *j1) {
    int64_t blocks = (n + SL_ROW_BLOCK - 1) / SL_ROW_BLOCK;
    int64_t b0 = blocks * t / team, b1 = blocks * (t + 1) / team;
    *j0 = b0 * SL_ROW_BLOCK;
    *j1 = b1 * SL_ROW_BLOCK < n ? b1 * SL_ROW_BLOCK : n;
}

/* The entry point: addresses as integers, so that Python hands over `data_ptr()` values as
   they are (no pointer objects to build per call). */
int sl_linear(int dtype, uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m,
              int64_t n, int64_t k, int threads) {
    int isa = dtype == SL_FLOAT32 ? sl_has_avx512()
              : dtype == SL_BFLOAT16 ? sl_has_avx512_bf16() : 0;
    if (!isa || m < 1 || m > SL_MAX_ROWS || n < 1 || k < 1) return -1;
    sl_block_fn block = SL_BLOCKS[dtype][m];
    int team = sl_team(n, k, threads);
#pragma omp parallel num_threads(team) if (team > 1)
    {
        int64_t j0, j1;
        sl_share(n, omp_get_thread_num(), omp_get_num_threads(), &j0, &j1);
        block((const void *)x, (const void *)w, (const void *)bias, (void *)y, n, k, j0, j1);
    }
    return 0;
}

#else /* not x86-64: the caller runs the reference */

int sl_has_avx512(void) { return 0; }
int sl_has_avx512_bf16(void) { return 0; }
int sl_linear(int dtype, uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m,
              int64_t n, int64_t k, int threads) {
    (void)dtype; (void)x; (void)w; (void)bias; (void)y; (void)m; (void)n; (void)k;
    (void)threads;
    return -1;
}

#endif
