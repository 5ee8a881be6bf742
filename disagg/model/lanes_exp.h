/* e^x, 16 lanes at a time, for the CPU kernels (X8b's softmax in `attention_math.h`, SwiGLU's
   silu in `decode_layers.c`): x = n ln2 + r with |r| <= ln2/2, e^r by Cephes' degree-6
   polynomial for expf (about 1 ulp from libm's expf), then scaled by 2^n. A call to libm's
   expf per element cost more than the rest of either kernel. */

#ifndef DISAGG_LANES_EXP_H
#define DISAGG_LANES_EXP_H

#include <immintrin.h>

/* x is clamped to [-87, 88.8] first: e^-87 is below every weight that counts and leaves
   1 + e^-87 == 1, and above 88.72 the scaling by 2^128 gives +inf, as expf does (a larger x
   would leave r imprecise and its polynomial of any sign). The constants go first: min and
   max return their second operand when either is NaN, so a NaN stays one. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline __m512 lanes_exp(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.8f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#endif
