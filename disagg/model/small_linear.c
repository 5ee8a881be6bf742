/* y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) for a few rows m: a decode step's projections.

   At decode a projection multiplies one to eight token rows by a weight that is read once, so
   the step is a stream of weight bytes and nothing else; the kernel's only job is to keep that
   stream at the memory's rate. Every weight row is loaded once, 16 floats (or 32 bf16) at a
   time, and multiplied into the m accumulators of the m token rows, which stay in registers.
   Up to 32 rows (a larger batch, a short prefill chunk) go eight at a time over weight rows
   still in the cache (`sl_grouped`). Output rows are split into contiguous blocks, one per
   OpenMP thread.

   float32 uses AVX-512F FMAs; bfloat16 uses AVX-512 BF16's dot products, which accumulate pairs
   of bf16 products in float32, or on a CPU without that extension the same sums from AVX-512F
   FMAs (`sl_bf16_pair_fma`). The result is rounded once, to nearest-even, after the bias is
   added in float32. The functions return -1 when the CPU lacks AVX-512 (or is not x86-64):
   the caller then runs the pure-PyTorch reference (`linear.py`). */

#include <stdint.h>

#include "bf16.h"
#include "cpu_kernels.h"

#define SL_MAX_ROWS 8
/* More token rows (a larger decode batch, a short prefill chunk) go SL_MAX_ROWS at a time over
   each chunk of SL_CHUNK weight rows: the first group reads the chunk from memory, the others
   find it in the cache, so the weight streams once however many groups there are. Up to
   SL_MAX_TOKEN_ROWS: about where oneDNN's GEMM catches up (measured on SmolLM2's matrices, two
   threads: 2.2x at 9 rows, 1.3-1.5x at 32, even at 64; one thread, even at 32). */
#define SL_MAX_TOKEN_ROWS 32
#define SL_CHUNK 16
#define SL_MAX_MATRICES 4 /* projections of the same rows in one call (`sl_linear_many`) */
/* Below this many weight elements one thread streams the matrix faster than a team starts. */
#define SL_PARALLEL_MIN (1 << 16)
/* Blocks of output rows keep each thread's part of the weight contiguous. */
#define SL_ROW_BLOCK 16
/* From this many token rows on, the FMAs take about as long as the weight's bytes take to
   arrive, and the hardware's prefetcher no longer runs far enough ahead to overlap the two
   (5 rows ran at a third of the memory's rate): the loop then asks for the weight
   SL_PREFETCH_BYTES ahead into L2 itself. Into L1, or 1-4 KiB ahead, it was slower still;
   fewer rows stream at the memory's rate without it, and the extra requests slow them. A
   prefetch past the matrix's end is a hint and cannot fault. */
#define SL_PREFETCH_MIN_ROWS 3
#define SL_PREFETCH_BYTES 8192

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
        if (m >= SL_PREFETCH_MIN_ROWS)
            _mm_prefetch((const char *)(wr + i) + SL_PREFETCH_BYTES, _MM_HINT_T1);
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

/* One weight row against m token rows, 32 bfloat16 a step (`STEP`: one of the two above); a
   macro because each needs its own target. */
#define SL_BF16_ROW(NAME, TARGET, STEP)                                                     \
    __attribute__((target(TARGET), always_inline))                                          \
    static inline void NAME(const uint16_t *x, const uint16_t *wr, float *out, int m,      \
                            int64_t k, int64_t ldx) {                                       \
        __m512 acc[SL_MAX_ROWS];                                                            \
        for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();                           \
        int64_t i = 0;                                                                      \
        for (; i + 32 <= k; i += 32) {                                                      \
            if (m >= SL_PREFETCH_MIN_ROWS)                                                  \
                _mm_prefetch((const char *)(wr + i) + SL_PREFETCH_BYTES, _MM_HINT_T1);      \
            __m512i wv = _mm512_loadu_si512(wr + i);                                        \
            for (int r = 0; r < m; r++)                                                     \
                acc[r] = STEP(acc[r], _mm512_loadu_si512(x + r * ldx + i), wv);             \
        }                                                                                   \
        if (i < k) {                                                                        \
            __mmask32 tail = (__mmask32)((1ull << (k - i)) - 1ull);                         \
            __m512i wv = _mm512_maskz_loadu_epi16(tail, wr + i);                            \
            for (int r = 0; r < m; r++)                                                     \
                acc[r] = STEP(acc[r], _mm512_maskz_loadu_epi16(tail, x + r * ldx + i), wv); \
        }                                                                                   \
        for (int r = 0; r < m; r++) out[r] = _mm512_reduce_add_ps(acc[r]);                 \
    }

SL_BF16_ROW(sl_bf16_row, "avx512f,avx512bw,avx512bf16", sl_bf16_dot)
SL_BF16_ROW(sl_bf16_row_f, "avx512f,avx512bw", sl_bf16_pair_fma)

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

#define SL_BF16_BLOCK_OF(M, NAME, ROW, TARGET)                                              \
    __attribute__((target(TARGET)))                                                         \
    static void NAME##_##M(const void *xv, const void *wv, const void *bv, void *yv,        \
                           int64_t n, int64_t k, int64_t j0, int64_t j1) {                  \
        const uint16_t *x = xv, *w = wv, *bias = bv;                                        \
        uint16_t *y = yv;                                                                   \
        float out[SL_MAX_ROWS];                                                             \
        for (int64_t j = j0; j < j1; j++) {                                                 \
            ROW(x, w + j * k, out, M, k, k);                                                \
            float b = bias ? sl_bf16_to_f32(bias[j]) : 0.0f;                                \
            for (int r = 0; r < M; r++) y[r * n + j] = sl_round_bf16(out[r] + b);           \
        }                                                                                   \
    }

/* Each bfloat16 block twice: with AVX-512 BF16's dot products, and with their emulation. */
#define SL_BF16_BLOCK(M)                                                                    \
    SL_BF16_BLOCK_OF(M, sl_bf16_block, sl_bf16_row, "avx512f,avx512bw,avx512bf16")          \
    SL_BF16_BLOCK_OF(M, sl_bf16f_block, sl_bf16_row_f, "avx512f,avx512bw")

SL_F32_BLOCK(1) SL_F32_BLOCK(2) SL_F32_BLOCK(3) SL_F32_BLOCK(4)
SL_F32_BLOCK(5) SL_F32_BLOCK(6) SL_F32_BLOCK(7) SL_F32_BLOCK(8)
SL_BF16_BLOCK(1) SL_BF16_BLOCK(2) SL_BF16_BLOCK(3) SL_BF16_BLOCK(4)
SL_BF16_BLOCK(5) SL_BF16_BLOCK(6) SL_BF16_BLOCK(7) SL_BF16_BLOCK(8)

/* Blocks by dtype (`SL_FLOAT32`, `SL_BFLOAT16`, then bfloat16 without AVX-512 BF16) and
   number of rows. */
static const sl_block_fn SL_BLOCKS[3][SL_MAX_ROWS + 1] = {
    {0, sl_f32_block_1, sl_f32_block_2, sl_f32_block_3, sl_f32_block_4,
     sl_f32_block_5, sl_f32_block_6, sl_f32_block_7, sl_f32_block_8},
    {0, sl_bf16_block_1, sl_bf16_block_2, sl_bf16_block_3, sl_bf16_block_4,
     sl_bf16_block_5, sl_bf16_block_6, sl_bf16_block_7, sl_bf16_block_8},
    {0, sl_bf16f_block_1, sl_bf16f_block_2, sl_bf16f_block_3, sl_bf16f_block_4,
     sl_bf16f_block_5, sl_bf16f_block_6, sl_bf16f_block_7, sl_bf16f_block_8}};

/* Output rows [j0, j1) for m token rows, m above SL_MAX_ROWS: groups of SL_MAX_ROWS rows (the
   last may be smaller) over each chunk of weight rows. Every output is computed by the same
   block function as alone, so the bits do not depend on m. */
static void sl_grouped(const sl_block_fn *fns, int64_t m, int64_t elem, const void *x,
                       const void *w, const void *bias, void *y, int64_t n, int64_t k,
                       int64_t j0, int64_t j1) {
    for (int64_t c = j0; c < j1; c += SL_CHUNK) {
        int64_t ce = c + SL_CHUNK < j1 ? c + SL_CHUNK : j1;
        for (int64_t g = 0; g < m; g += SL_MAX_ROWS) {
            int64_t rows = m - g < SL_MAX_ROWS ? m - g : SL_MAX_ROWS;
            fns[rows]((const char *)x + g * k * elem, w, bias, (char *)y + g * n * elem, n, k,
                      c, ce);
        }
    }
}

/* Several projections of the same rows in one team (a layer's q, k and v; gate and up): their
   output rows are cut into blocks of SL_ROW_BLOCK, matrix after matrix, and each thread takes
   a contiguous share of all the blocks, so one fork and join serves them all. Each output row
   is computed by the same block function as alone, so the bits do not depend on the grouping. */
int sl_linear_many(int dtype, uintptr_t x, int count, const uintptr_t *w, const uintptr_t *bias,
                   const uintptr_t *y, const int64_t *n, int64_t m, int64_t k, int threads) {
    if ((dtype != SL_FLOAT32 && dtype != SL_BFLOAT16) || !sl_has_avx512() || m < 1
        || m > SL_MAX_TOKEN_ROWS || k < 1 || count < 1 || count > SL_MAX_MATRICES)
        return -1;
    int64_t first[SL_MAX_MATRICES + 1] = {0}, elems = 0; /* matrix i's blocks: [first[i], ..) */
    for (int i = 0; i < count; i++) {
        if (n[i] < 1) return -1;
        first[i + 1] = first[i] + (n[i] + SL_ROW_BLOCK - 1) / SL_ROW_BLOCK;
        elems += n[i] * k;
    }
    int table = dtype == SL_BFLOAT16 && !sl_has_avx512_bf16() ? 2 : dtype;
    const sl_block_fn *fns = SL_BLOCKS[table];
    int64_t elem = dtype == SL_BFLOAT16 ? 2 : 4;
    int64_t blocks = first[count];
    int team = threads < 1 || elems < SL_PARALLEL_MIN ? 1
               : (blocks < threads ? (int)blocks : threads);
#pragma omp parallel num_threads(team) if (team > 1)
    {
        int t = omp_get_thread_num(), size = omp_get_num_threads();
        int64_t b0 = blocks * t / size, b1 = blocks * (t + 1) / size;
        for (int i = 0; i < count; i++) { /* the part of this thread's blocks in matrix i */
            int64_t lo = b0 > first[i] ? b0 : first[i], hi = b1 < first[i + 1] ? b1 : first[i + 1];
            if (lo >= hi) continue;
            int64_t j0 = (lo - first[i]) * SL_ROW_BLOCK, j1 = (hi - first[i]) * SL_ROW_BLOCK;
            j1 = j1 < n[i] ? j1 : n[i];
            if (m <= SL_MAX_ROWS)
                fns[m]((const void *)x, (const void *)w[i], (const void *)bias[i],
                       (void *)y[i], n[i], k, j0, j1);
            else
                sl_grouped(fns, m, elem, (const void *)x, (const void *)w[i],
                           (const void *)bias[i], (void *)y[i], n[i], k, j0, j1);
        }
    }
    return 0;
}

/* The entry point for one projection: addresses as integers, so that Python hands over
   `data_ptr()` values as they are (no pointer objects to build per call). */
int sl_linear(int dtype, uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m,
              int64_t n, int64_t k, int threads) {
    return sl_linear_many(dtype, x, 1, &w, &bias, &y, &n, m, k, threads);
}

#else /* not x86-64: the caller runs the reference */

int sl_has_avx512(void) { return 0; }
int sl_has_avx512_bf16(void) { return 0; }
int sl_linear_many(int dtype, uintptr_t x, int count, const uintptr_t *w, const uintptr_t *bias,
                   const uintptr_t *y, const int64_t *n, int64_t m, int64_t k, int threads) {
    (void)dtype; (void)x; (void)count; (void)w; (void)bias; (void)y; (void)n; (void)m; (void)k;
    (void)threads;
    return -1;
}
int sl_linear(int dtype, uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m,
              int64_t n, int64_t k, int threads) {
    (void)dtype; (void)x; (void)w; (void)bias; (void)y; (void)m; (void)n; (void)k;
    (void)threads;
    return -1;
}

#endif
