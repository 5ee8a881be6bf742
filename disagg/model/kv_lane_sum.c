/* The KV checksum's weighted lane sum on the CPU (X4c, X8d): the inner loop of
 * disagg/kv_transfer/kv_checksum.py's `_rank_sum`, one layer's K or V at a time, read in place
 * from the cache's pages (`kls_page_sum`) or from one contiguous array (`kls_lane_sum`).
 *
 * A row is one (head, token)'s lanes of lane_bytes (2: int16, sign-extended; 1: uint8), the
 * bits of the KV values. Each lane counts with an odd weight below 2^16 drawn from
 * (seed, position, head id, lane) by the same integer hash as the PyTorch reference; the
 * products are summed in wrapping 64-bit arithmetic, which equals the reference's sum mod
 * 2^52 once masked (2^52 divides 2^64). The weights are what costs: three hash steps per lane
 * in the reference's tensors, registers here. The modulus 2^31 - 1 is a Mersenne prime, so a
 * hash step's remainder is two adds and a compare instead of a division.
 */

#include <stdint.h>

#include "cpu_kernels.h"

#define KLS_PRIME 2147483647ULL
#define KLS_MULTIPLIER 48271U

/* x < 2^32: x * 48271 mod (2^31 - 1), then the xor-shift (kv_checksum.py's `_mix`). A 32 x 32
 * -> 64-bit multiply, which vectorizes (vpmuludq) where a 64-bit one would not. */
static inline uint32_t kls_mix(uint32_t x)
{
    uint64_t y = (uint64_t)x * KLS_MULTIPLIER; /* < 2^48 */
    y = (y & KLS_PRIME) + (y >> 31);          /* 2^31 = 1 mod p; now below 2p */
    if (y >= KLS_PRIME)
        y -= KLS_PRIME;
    uint32_t z = (uint32_t)y;
    return z ^ (z >> 11);
}

/* The odd weight below 2^16 of lane l of the value whose (position, head) hashed to x. */
static inline int32_t kls_weight(uint32_t x, int32_t l)
{
    return (int32_t)(((kls_mix(x + (uint32_t)l) >> 7) & 0xFFFF) | 1);
}

/* Each row function compiled for AVX-512 and AVX2 beside the baseline, picked at load time. */
#if defined(__x86_64__)
#define KLS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KLS_CLONES
#endif

/* One (position, head) row of lanes of type LANE: |lane * weight| < 2^31, so each product is
 * an int32. One function per lane type, so that each vectorizes over its own loads. */
#define KLS_ROW(NAME, LANE)                                                                 \
    KLS_CLONES                                                                              \
    static int64_t NAME(const LANE *v, int32_t lanes, uint32_t x)                           \
    {                                                                                       \
        int64_t sum = 0;                                                                    \
        for (int32_t l = 0; l < lanes; l++)                                                 \
            sum += (int32_t)v[l] * kls_weight(x, l);                                        \
        return sum;                                                                         \
    }

KLS_ROW(kls_row16, int16_t)
KLS_ROW(kls_row8, uint8_t)

#if defined(__x86_64__)
#include <immintrin.h>

/* (x * 48271) mod (2^31 - 1): the multiply-and-remainder half of `kls_mix`. */
static inline uint32_t kls_mulmod(uint32_t x)
{
    uint64_t y = (uint64_t)x * KLS_MULTIPLIER;
    y = (y & KLS_PRIME) + (y >> 31);
    return (uint32_t)(y >= KLS_PRIME ? y - KLS_PRIME : y);
}

/* Both rows in AVX-512, 16 lanes a step in 32-bit lanes. The hash input of lane l is x + l, so
 * its remainder is (x M + l M) mod p: from the first 16 lanes' remainders (x M mod p plus a
 * constant per lane), each step adds 16 M mod p, and a remainder that reached p drops by p
 * (min(r, r - p) unsigned: r - p wraps high when r < p). No multiply is left per lane but the
 * value times its weight, which fits an int32 (|lane| < 2^15, weight < 2^16); products are
 * widened into two int64 accumulators. The same number as the rows above, bit for bit. */
#define KLS_ROW_AVX512(NAME, LANE, LOAD)                                                    \
    __attribute__((target("avx512f,avx512bw,avx512vl")))                                     \
    static int64_t NAME(const LANE *v, int32_t lanes, uint32_t x)                           \
    {                                                                                       \
        const __m512i p = _mm512_set1_epi32((int32_t)KLS_PRIME);                             \
        const __m512i step = _mm512_set1_epi32((int32_t)((16ULL * KLS_MULTIPLIER) % KLS_PRIME));\
        const __m512i low16 = _mm512_set1_epi32(0xFFFF), one = _mm512_set1_epi32(1);        \
        __m512i r = _mm512_add_epi32(_mm512_set1_epi32((int32_t)kls_mulmod(x)), KLS_LANE_M);  \
        r = _mm512_min_epu32(r, _mm512_sub_epi32(r, p));                                    \
        __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();              \
        for (int32_t l = 0; l < lanes; l += 16) {                                           \
            __mmask16 live = lanes - l >= 16 ? (__mmask16)0xFFFF                             \
                                             : (__mmask16)((1u << (lanes - l)) - 1u);        \
            __m512i w = _mm512_xor_si512(r, _mm512_srli_epi32(r, 11));                      \
            w = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w, 7), low16), one);    \
            __m512i prod = _mm512_maskz_mullo_epi32(live, LOAD(live, v + l), w);            \
            acc0 = _mm512_add_epi64(acc0, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(prod)));\
            acc1 = _mm512_add_epi64(acc1,                                                   \
                                    _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(prod, 1)));\
            r = _mm512_add_epi32(r, step);                                                  \
            r = _mm512_min_epu32(r, _mm512_sub_epi32(r, p));                                \
        }                                                                                   \
        return _mm512_reduce_add_epi64(_mm512_add_epi64(acc0, acc1));                       \
    }

/* l * 48271 for l = 0..15 (below p): each lane's offset from the row's first remainder. */
#define KLS_LANE_M                                                                          \
    _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), \
                       _mm512_set1_epi32((int32_t)KLS_MULTIPLIER))

#define KLS_LOAD16(m, p) _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16((m), (p)))
#define KLS_LOAD8(m, p) _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8((m), (p)))
KLS_ROW_AVX512(kls_row16_avx512, int16_t, KLS_LOAD16)
KLS_ROW_AVX512(kls_row8_avx512, uint8_t, KLS_LOAD8)

static int kls_avx512(void)
{
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl");
}
#endif

/* The sum over rows (head h, token t) read where the cache keeps them: token t sits at row
 * r = first_row + t of the pages, in page r / page_size, whose part starts at byte address
 * pages[r / page_size]; the row is token_stride * (r % page_size) + head_stride * h bytes
 * further on (NHD: heads side by side in a token; HND: a head's tokens side by side). No
 * gather: the sum does not depend on the order rows are read in, only on each lane's
 * (position, head, lane). first_row lets a token range start inside its first page; offset
 * is added to every page's address (a later layer's part lies one layer stride further on, so
 * one array of addresses serves every layer). */
uint64_t kls_page_sum(uintptr_t pages, int64_t offset, int64_t page_size, int64_t first_row,
                      int lane_bytes, int64_t heads, int64_t tokens, int64_t lanes,
                      int64_t head_stride, int64_t token_stride, uintptr_t head_ids,
                      int64_t first_position, uint64_t seed, int threads)
{
    const int64_t *ids = (const int64_t *)head_ids;
    const uintptr_t *page = (const uintptr_t *)pages;
    uint64_t total = 0;
#if defined(__x86_64__)
    int wide = kls_avx512();
#endif
    int team = threads > 1 && heads * tokens * lanes >= (1 << 16) ? threads : 1;
    /* Rows in the order memory holds them: a token's heads together (NHD) or a head's tokens
     * (HND), so the reads run forward through each page once. */
    int heads_inner = head_stride < token_stride;
    int64_t outer = heads_inner ? tokens : heads, inner = heads_inner ? heads : tokens;
#pragma omp parallel for collapse(2) reduction(+ : total) num_threads(team) if (team > 1)
    for (int64_t o = 0; o < outer; o++) {
        for (int64_t i = 0; i < inner; i++) {
            int64_t h = heads_inner ? i : o, t = heads_inner ? o : i;
            uint32_t x = kls_mix((uint32_t)(seed + (uint64_t)(first_position + t)));
            x = kls_mix(x + (uint32_t)ids[h]);
            int64_t r = first_row + t;
            const char *row = (const char *)page[r / page_size] + offset
                + (r % page_size) * token_stride + h * head_stride;
            int64_t sum;
#if defined(__x86_64__)
            if (wide)
                sum = lane_bytes == 2
                    ? kls_row16_avx512((const int16_t *)row, (int32_t)lanes, x)
                    : kls_row8_avx512((const uint8_t *)row, (int32_t)lanes, x);
            else
#endif
                sum = lane_bytes == 2 ? kls_row16((const int16_t *)row, (int32_t)lanes, x)
                                      : kls_row8((const uint8_t *)row, (int32_t)lanes, x);
            total += (uint64_t)sum; /* wrapping: the caller masks to 2^52 */
        }
    }
    return total;
}

/* kls_page_sum over layers_n consecutive layers in one call: layer i's part lies at offset +
 * i * layer_stride and counts with seeds[i]. A range of layers is what a caller sums at once
 * (a group of layers as the prefiller posts it, a request's body on the decoder), and each
 * layer through Python would cost a call's overhead for a few rows' work. */
uint64_t kls_layers_sum(uintptr_t pages, int64_t offset, int64_t layer_stride, int64_t layers_n,
                        uintptr_t seeds, int64_t page_size, int64_t first_row, int lane_bytes,
                        int64_t heads, int64_t tokens, int64_t lanes, int64_t head_stride,
                        int64_t token_stride, uintptr_t head_ids, int64_t first_position,
                        int threads)
{
    const uint64_t *seed = (const uint64_t *)seeds;
    uint64_t total = 0;
    for (int64_t i = 0; i < layers_n; i++)
        total += kls_page_sum(pages, offset + i * layer_stride, page_size, first_row, lane_bytes,
                              heads, tokens, lanes, head_stride, token_stride, head_ids,
                              first_position, seed[i], threads);
    return total;
}

/* values: [heads, tokens, lanes] contiguous, i.e. one page holding every token. */
uint64_t kls_lane_sum(uintptr_t values, int lane_bytes, int64_t heads, int64_t tokens,
                      int64_t lanes, uintptr_t head_ids, int64_t first_position, uint64_t seed,
                      int threads)
{
    uintptr_t page = values;
    return kls_page_sum((uintptr_t)&page, 0, tokens > 0 ? tokens : 1, 0, lane_bytes, heads,
                        tokens, lanes, tokens * lanes * lane_bytes, lanes * lane_bytes, head_ids,
                        first_position, seed, threads);
}
