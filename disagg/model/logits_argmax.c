/* The greedy token: the index of a logits row's largest value, as torch.argmax gives it (X8g).

   torch.argmax over one row of a vocabulary (49,152 bfloat16 logits for SmolLM2) takes
   ~180 us on this machine's CPU, ~60 us in float32: a general reduction that carries an index
   per element. Here two passes over the row, 16 lanes at a time: the largest value (noting
   any NaN), then the first index holding it. torch's rules: a NaN counts as the largest (the
   first NaN's index is the answer), ties go to the first index, -0.0 equals +0.0. One
   thread: the row sits in L2 once the LM head wrote it. Returns the index, or -1 without
   AVX-512 (the caller then runs torch.argmax). */

#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "cpu_kernels.h"

#if defined(__x86_64__)

__attribute__((target("avx512f,avx512bw,avx512vl")))
static int64_t la_first_nan(const void *x, int64_t n, int bf16) {
    for (int64_t i = 0; i < n; i += 16) {
        __m512 v = lanes_load(x, i, bf16, lanes_mask(n, i));
        __mmask16 nan = _mm512_mask_cmp_ps_mask(lanes_mask(n, i), v, v, _CMP_UNORD_Q);
        if (nan) return i + __builtin_ctz(nan);
    }
    return -1;
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
static int64_t la_argmax_avx512(const void *x, int64_t n, int bf16) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __mmask16 any_nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = lanes_mask(n, i);
        __m512 v = lanes_load(x, i, bf16, m);
        any_nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
        best = _mm512_mask_max_ps(best, m, best, v);
    }
    if (any_nan) return la_first_nan(x, n, bf16);
    __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = lanes_mask(n, i);
        __mmask16 hit = _mm512_mask_cmp_ps_mask(m, lanes_load(x, i, bf16, m), top, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    return 0; /* every value -inf: the first, as torch.argmax */
}

int64_t la_argmax(int dtype, uintptr_t x, int64_t n) {
    if (n <= 0 || !sl_has_avx512()) return -1;
    return la_argmax_avx512((const void *)x, n, dtype == 1);
}

#else

int64_t la_argmax(int dtype, uintptr_t x, int64_t n) {
    (void)dtype; (void)x; (void)n;
    return -1;
}

#endif
