/* bfloat16 <-> float32 for the CPU kernels (`small_linear.c`, `decode_attention.c`,
   `rms_norm.c`, `rotary.c`, `moe_route.c`, `decode_layers.c`): a bfloat16 is the top half of
   a float32, and results are rounded to nearest-even, as torch's own `.to(torch.bfloat16)`
   rounds. For kernels that take float32 or bfloat16 arrays alike (`bf16` says which), the
   `elem_` helpers load, store and round one element, the `lanes_` helpers 16 at a time with
   AVX-512. A bfloat16 dot product (the projections', a decode's attention scores) sums its
   products in pairs, as AVX-512 BF16's dot-product instruction does (`sl_bf16_dot`), or, on a
   CPU without that extension, as its emulation does with the same bits (`sl_bf16_pair_fma`). */

#ifndef DISAGG_BF16_H
#define DISAGG_BF16_H

#include <stdint.h>
#include <string.h>

static inline uint16_t sl_round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float sl_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Element i of a float32 or bfloat16 array, as float32. */
static inline float elem_load(const void *p, int64_t i, int bf16) {
    return bf16 ? sl_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* `v` stored as element i of the array, in its dtype. */
static inline void elem_store(void *p, int64_t i, int bf16, float v) {
    if (bf16) ((uint16_t *)p)[i] = sl_round_bf16(v);
    else ((float *)p)[i] = v;
}

/* `v` as the array's dtype holds it (`lanes_as_dtype` for one element). */
static inline float elem_as_dtype(float v, int bf16) {
    return bf16 ? sl_bf16_to_f32(sl_round_bf16(v)) : v;
}

#if defined(__x86_64__)
#include <immintrin.h>

/* Lanes [0, n - i) of 16, for the last step over n elements. */
static inline __mmask16 lanes_mask(int64_t n, int64_t i) {
    return n - i >= 16 ? (__mmask16)0xffff : n <= i ? 0 : (__mmask16)((1u << (n - i)) - 1u);
}

/* Elements i.. (16, fewer under `mask`) of a float32 or bfloat16 array, as float32. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline __m512 lanes_load(const void *p, int64_t i, int bf16, __mmask16 mask) {
    if (!bf16) return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 float32 rounded to bfloat16 as `sl_round_bf16` rounds them (NaNs quieted). Not
   vcvtneps2bf16: it flushes denormals, which torch keeps. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline __m256i lanes_round_bf16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* `v` as the array's dtype holds it: float32 as is, else rounded to bfloat16 and back, as a
   PyTorch op on bfloat16 tensors rounds its result before the next op reads it. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline __m512 lanes_as_dtype(__m512 v, int bf16) {
    if (!bf16) return v;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(lanes_round_bf16(v)),
                                                 16));
}

/* One step of a bfloat16 row: `acc` plus the 16 pairs of products of 32 elements, with AVX-512
   BF16's dot-product instruction. */
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))
static inline __m512 sl_bf16_dot(__m512 acc, __m512i xv, __m512i wv) {
    return _mm512_dpbf16_ps(acc, (__m512bh)xv, (__m512bh)wv);
}

/* The same step on a CPU with AVX-512 but not its BF16 extension (Skylake to Ice Lake Xeons):
   `vdpbf16ps` adds, per float32 lane, the product of the pair's odd elements and then that of
   its even ones, each rounded once; a product of two bfloat16 values is exact in float32, so an
   FMA of the two widened halves rounds exactly as it does. The odd element of a pair is
   already a float32's top half (mask the low one off), the even one shifts up. The same bits
   as the instruction, except that it treats denormal inputs and results as zero and this does
   not. */
__attribute__((target("avx512f,avx512bw"), always_inline))
static inline __m512 sl_bf16_pair_fma(__m512 acc, __m512i xv, __m512i wv) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 x_odd = _mm512_castsi512_ps(_mm512_and_si512(xv, high));
    __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(wv, high));
    __m512 x_even = _mm512_castsi512_ps(_mm512_slli_epi32(xv, 16));
    __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
    return _mm512_fmadd_ps(x_even, w_even, _mm512_fmadd_ps(x_odd, w_odd, acc));
}

/* 16 results (fewer under `mask`) stored in the array's dtype. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline void lanes_store(void *p, int64_t i, int bf16, __mmask16 mask, __m512 v) {
    if (bf16) _mm256_mask_storeu_epi16((uint16_t *)p + i, mask, lanes_round_bf16(v));
    else _mm512_mask_storeu_ps((float *)p + i, mask, v);
}
#endif

#endif
