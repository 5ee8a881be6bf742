/* The arithmetic of a decode's attention on a block of keys, whatever page holds them (X8b):
   the scores of 16 keys against one query row, their lanes summed as one vector's reduction
   sums them (bfloat16 rows' products summed in pairs, as the projections' are), and the
   exponentials of a row of scores (`lanes_exp.h`). `decode_attention.c`
   walks the pages and the threads; this is what it computes per block. AVX-512 only
   (included where the kernel is compiled for x86-64). */

#ifndef DISAGG_ATTENTION_MATH_H
#define DISAGG_ATTENTION_MATH_H

#include <immintrin.h>
#include <math.h> /* INFINITY, NAN */
#include <stdint.h>

#include "bf16.h"
#include "lanes_exp.h"

/* row[0..len) <- exp(row - peak), in float32; returns the peak (the largest score, NaN if any
   score is NaN) and the sum of the exponentials. The division comes after the values are
   summed (`da_combine`), so that a task split into parts divides once. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static void da_exponentials(float *row, int64_t len, float *peak_out, float *sum_out) {
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    __mmask16 nan = 0; /* max drops NaNs: they are tracked apart and poison the peak */
    for (int64_t t = 0; t < len; t += 16) {
        __mmask16 m = lanes_mask(len, t);
        __m512 x = _mm512_maskz_loadu_ps(m, row + t);
        nan |= _mm512_mask_cmp_ps_mask(m, x, x, _CMP_UNORD_Q);
        top = _mm512_mask_max_ps(top, m, top, x);
    }
    float peak = nan ? NAN : _mm512_reduce_max_ps(top);
    for (int64_t t = 0; t < len; t += 16) {
        __mmask16 m = lanes_mask(len, t);
        __m512 e = lanes_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + t),
                                        _mm512_set1_ps(peak)));
        _mm512_mask_storeu_ps(row + t, m, e);
        sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    *peak_out = peak;
    *sum_out = _mm512_reduce_add_ps(sum);
}

/* The horizontal sums of 16 vectors, lane j of the result the sum of acc[j]'s 16 lanes, added
   pairwise in the order `_mm512_reduce_add_ps` adds one vector's lanes (lanes i and i + 8, then
   i and i + 4, then 0 and 2, then 0 and 1), so each sum has the bits of that reduction: four
   rounds of shuffles over all 16 at once instead of 16 reductions one by one. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline __m512 da_sum16(const __m512 *acc) {
    __m512 x[8], w[4], r[2];
    for (int j = 0; j < 8; j++) /* lanes i + 8 onto i: keys 2j and 2j + 1, 8 lanes each */
        x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * j], acc[2 * j + 1], 0xEE),
                             _mm512_shuffle_f32x4(acc[2 * j], acc[2 * j + 1], 0x44));
    for (int m = 0; m < 4; m++) /* i + 4 onto i: keys 4m .. 4m + 3, a 128-bit block each */
        w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], 0xDD),
                             _mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], 0x88));
    for (int h = 0; h < 2; h++) /* 2 onto 0 and 3 onto 1, within each block */
        r[h] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * h], w[2 * h + 1], 0x44),
                             _mm512_shuffle_ps(w[2 * h], w[2 * h + 1], 0xEE));
    /* 1 onto 0: lane 4k + m holds key 4m + k; put key j in lane j. */
    __m512 s = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88),
                             _mm512_shuffle_ps(r[0], r[1], 0xDD));
    const __m512i keys = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(keys, s);
}

/* Scores of up to 16 float32 keys, rows at `rows[0..count)`, against a float32 query row:
   each the lanes' FMAs along the row, their sum (`da_sum16`), then the scale; written to
   out[0..count). (bfloat16 keys: `da_scores16_dot` and `da_scores16_pairs` below.) */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline void da_scores16(const float *q, const char *const *rows, int count, int64_t d,
                               float scale, float *out) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        __mmask16 m = lanes_mask(d, i);
        __m512 qv = _mm512_maskz_loadu_ps(m, q + i);
        for (int j = 0; j < 16; j++)
            acc[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, (const float *)rows[j] + i),
                                     acc[j]);
    }
    __m512 s = _mm512_mul_ps(da_sum16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << count) - 1u), s);
}

/* Scores of up to 16 bfloat16 keys against a bfloat16 query row, 32 elements a step, each
   lane adding its pair's two products as AVX-512 BF16's dot product does (`STEP`: the
   instruction or its emulation, `bf16.h`), then the lanes summed as above and scaled: half the
   multiply instructions of widening each element to float32 first (a Qwen3-MoE layer's
   attention 1.3x faster hot), and the same bits on a CPU with the extension or without it.
   Inlined where called (`decode_attention.c` builds its key sweep once per variant): called
   out of line, the block's sums left the registers and the instruction gained nothing. */
#define DA_SCORES16_PAIRS(NAME, TARGET, STEP)                                                \
    __attribute__((target(TARGET), always_inline))                                           \
    static inline void NAME(const uint16_t *q, const char *const *rows, int count,            \
                            int64_t d, float scale, float *out) {                            \
        __m512 acc[16];                                                                      \
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();                           \
        for (int64_t i = 0; i < d; i += 32) {                                                \
            __mmask32 m = d - i >= 32 ? (__mmask32)0xffffffffu                               \
                                      : (__mmask32)((1ull << (d - i)) - 1ull);               \
            __m512i qv = _mm512_maskz_loadu_epi16(m, q + i);                                 \
            for (int j = 0; j < 16; j++)                                                     \
                acc[j] = STEP(acc[j], qv,                                                    \
                              _mm512_maskz_loadu_epi16(m, (const uint16_t *)rows[j] + i));   \
        }                                                                                    \
        __m512 s = _mm512_mul_ps(da_sum16(acc), _mm512_set1_ps(scale));                      \
        _mm512_mask_storeu_ps(out, (__mmask16)((1u << count) - 1u), s);                      \
    }

DA_SCORES16_PAIRS(da_scores16_dot, "avx512f,avx512bw,avx512vl,avx512bf16", sl_bf16_dot)
DA_SCORES16_PAIRS(da_scores16_pairs, "avx512f,avx512bw,avx512vl", sl_bf16_pair_fma)

#endif
