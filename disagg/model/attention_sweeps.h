/* A decode's attention over one (sequence, KV head) pair's pages, read where they lie (X8b):
   where a token's K or V row sits in the paged cache (NHD or HND), the rows fetched ahead, the
   keys scored 16 at a time (`attention_math.h`'s block arithmetic) and the values summed in
   register tiles. `decode_attention.c` splits the pairs over threads and joins their parts;
   these sweeps are what each part runs. The kernels are one translation unit, and this header
   is part of `decode_attention.c`'s. */

#ifndef DISAGG_ATTENTION_SWEEPS_H
#define DISAGG_ATTENTION_SWEEPS_H

#include <stdint.h>

#include "bf16.h"

enum { DA_NHD = 0, DA_HND = 1 };

/* One call's arguments (`da_decode_attention`'s, checked by `decode_attention.c`). */
typedef struct {
    const void *q;          /* [batch, num_heads, head_dim] */
    const void *layer;      /* one layer: [num_pages, 2, ...page dims], K before V */
    const int64_t *table;   /* [batch, max_pages] */
    const int64_t *kv_lens; /* [batch] */
    void *out;              /* [batch, num_heads, head_dim] */
    int64_t batch, max_pages, num_pages, page_size, cache_heads, head_dim;
    int64_t head_start, num_kv_heads, group; /* the cache heads these queries use */
    int layout, bf16;
    int bf16_dot; /* bfloat16 keys scored with AVX-512 BF16's dot product (else its emulation) */
    float scale;
} da_args;

#if defined(__x86_64__)
#include <immintrin.h>

#include "attention_math.h"

/* Where token `slot` of `page`'s part (0 K, 1 V) for cache head `head` starts, in elements,
   and how far apart consecutive slots' rows are. */
static inline int64_t da_row(const da_args *a, int64_t page, int part, int64_t head) {
    if (a->layout == DA_NHD)
        return ((page * 2 + part) * a->page_size * a->cache_heads + head) * a->head_dim;
    return ((page * 2 + part) * a->cache_heads + head) * a->page_size * a->head_dim;
}

static inline int64_t da_slot_stride(const da_args *a) {
    return a->layout == DA_NHD ? a->cache_heads * a->head_dim : a->head_dim;
}

/* Pages ahead of the one being scored whose rows are fetched into L2 meanwhile: between two
   layers a decode step streams megabytes of weights, which leave no KV in any cache, and a
   lone reader walking rows hundreds of bytes apart waits on the DRAM for each (measured: 2x
   the time of the same pages read from L3). */
#define DA_PREFETCH_PAGES 4

/* Ask for the cache lines of `head`'s rows of one page's part (0 K, 1 V) to be in L2; the
   first pass over the keys does it for both, so the values pass finds them there too. */
static inline void da_prefetch(const da_args *a, const char *layer, int64_t page, int part,
                               int64_t head) {
    const int64_t itemsize = a->bf16 ? 2 : 4, row_bytes = a->head_dim * itemsize;
    const char *first = layer + da_row(a, page, part, head) * itemsize;
    for (int64_t slot = 0; slot < a->page_size; slot++) {
        const char *row = first + slot * da_slot_stride(a) * itemsize;
        for (int64_t at = 0; at < row_bytes; at += 64) _mm_prefetch(row + at, _MM_HINT_T1);
    }
}

/* A value sweep's sums: at most DA_TILE (query head, 16-column block) pairs, each an even and
   an odd sum, so that every sum stays in a register (written back to memory and read again
   per token, they stalled on store-to-load forwarding). */
#define DA_TILE 8

/* Columns [16 c0, 16 (c0 + C)) of query heads [g0, g0 + G) of one pair's weighted sum of
   values over keys [t0, t1), in key order, alternating an even and an odd sum per column block
   (two chains of FMAs in flight). G and C are constants where this is inlined (`da_values`),
   so the sums get registers, and each V row loaded serves all G heads. `w` holds the weights,
   a row of `len` per query head. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline void da_values_tile(const da_args *a, const char *layer, const int64_t *pages,
                                  int64_t head, int64_t t0, int64_t t1, const float *w,
                                  float *acc, int64_t g0, int G, int64_t c0, int C) {
    const int64_t d = a->head_dim, n = a->page_size, len = t1 - t0;
    const int bf16 = a->bf16;
    const int64_t itemsize = bf16 ? 2 : 4, step = da_slot_stride(a) * itemsize;
    __m512 even[DA_TILE], odd[DA_TILE];
    __mmask16 mask[DA_TILE];
    const float *row[DA_TILE]; /* row[g][t] for t in [t0, t1) */
    for (int c = 0; c < C; c++) mask[c] = lanes_mask(d, (c0 + c) * 16);
    for (int g = 0; g < G; g++) row[g] = w + (g0 + g) * len - t0;
    for (int k = 0; k < G * C; k++) even[k] = odd[k] = _mm512_setzero_ps();
    for (int64_t p = t0 / n, t = t0; t < t1; p++) {
        const char *v = layer + da_row(a, pages[p], 1, head) * itemsize;
        int64_t slot = t % n;
        for (; slot + 1 < n && t + 1 < t1; slot += 2, t += 2) {
            const char *v0 = v + slot * step, *v1 = v0 + step;
            for (int c = 0; c < C; c++) {
                __m512 x0 = lanes_load(v0, (c0 + c) * 16, bf16, mask[c]);
                __m512 x1 = lanes_load(v1, (c0 + c) * 16, bf16, mask[c]);
                for (int g = 0; g < G; g++) {
                    even[g * C + c] = _mm512_fmadd_ps(_mm512_set1_ps(row[g][t]), x0,
                                                      even[g * C + c]);
                    odd[g * C + c] = _mm512_fmadd_ps(_mm512_set1_ps(row[g][t + 1]), x1,
                                                     odd[g * C + c]);
                }
            }
        }
        for (; slot < n && t < t1; slot++, t++)
            for (int c = 0; c < C; c++) {
                __m512 x = lanes_load(v + slot * step, (c0 + c) * 16, bf16, mask[c]);
                for (int g = 0; g < G; g++)
                    even[g * C + c] = _mm512_fmadd_ps(_mm512_set1_ps(row[g][t]), x,
                                                      even[g * C + c]);
            }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            _mm512_mask_storeu_ps(acc + (g0 + g) * d + (c0 + c) * 16, mask[c],
                                  _mm512_add_ps(even[g * C + c], odd[g * C + c]));
}

/* The largest power of two that is at most n (n >= 1) and at most DA_TILE. */
static inline int da_tile_side(int64_t n) {
    int side = 1;
    while (side * 2 <= n && side * 2 <= DA_TILE) side *= 2;
    return side;
}

/* Every query head's weighted sum of values: tiles of G heads by C column blocks, the widest
   that fit DA_TILE (powers of two, so one specialised sweep per shape), each a sweep over the
   keys. A head group of 2 and 64 columns is one sweep; 4 heads of 128 columns, four. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static void da_values(const da_args *a, const char *layer, const int64_t *pages, int64_t head,
                      int64_t t0, int64_t t1, const float *w, float *acc) {
    const int64_t blocks = (a->head_dim + 15) / 16;
    for (int64_t g0 = 0; g0 < a->group;) {
        int G = da_tile_side(a->group - g0);
        for (int64_t c0 = 0; c0 < blocks;) {
            int64_t room = DA_TILE / G, cols = blocks - c0 < room ? blocks - c0 : room;
            int C = da_tile_side(cols);
#define DA_TILE_CASE(GG, CC)                                                          \
    case GG * 16 + CC:                                                                \
        da_values_tile(a, layer, pages, head, t0, t1, w, acc, g0, GG, c0, CC);       \
        break;
            switch (G * 16 + C) {
                DA_TILE_CASE(1, 1) DA_TILE_CASE(1, 2) DA_TILE_CASE(1, 4) DA_TILE_CASE(1, 8)
                DA_TILE_CASE(2, 1) DA_TILE_CASE(2, 2) DA_TILE_CASE(2, 4)
                DA_TILE_CASE(4, 1) DA_TILE_CASE(4, 2) DA_TILE_CASE(8, 1)
            default: /* G and C are powers of two with G * C <= DA_TILE: every pair is above */
                abort();
            }
#undef DA_TILE_CASE
            c0 += C;
        }
        g0 += G;
    }
}

/* Keys [t0, t1) of one pair scored against its `group` query heads into `s` (a row of
   t1 - t0 per head), pages in order and slots within each, 16 keys at a time while their rows
   are in L1; the pages' rows are fetched DA_PREFETCH_PAGES ahead (the values' pass finds them
   too). `qf`: float32 query rows (float32 keys, `da_scores16`); `qb`: bfloat16 ones (bfloat16
   keys, `SCORE_BF16`). Built twice (`da_score_keys_dot` for a CPU with AVX-512 BF16,
   `da_score_keys_plain` for any AVX-512 CPU), so that each inlines its bfloat16 block
   scoring. */
#define DA_SCORE_KEYS(NAME, TARGET, SCORE_BF16)                                              \
    __attribute__((target(TARGET)))                                                          \
    static void NAME(const da_args *a, const char *layer, const int64_t *pages,             \
                     int64_t head, int64_t t0, int64_t t1, const float *qf,                 \
                     const uint16_t *qb, float *s) {                                         \
        const int64_t d = a->head_dim, n = a->page_size, len = t1 - t0;                      \
        const int64_t stride = da_slot_stride(a), itemsize = a->bf16 ? 2 : 4;                \
        const int64_t p0 = t0 / n, p1 = (t1 + n - 1) / n;                                    \
        const char *rows[16];                                                                \
        int count = 0;                                                                       \
        for (int64_t p = p0, t = t0; p < p1; p++) {                                          \
            if (p + DA_PREFETCH_PAGES < p1) {                                                \
                da_prefetch(a, layer, pages[p + DA_PREFETCH_PAGES], 0, head);                \
                da_prefetch(a, layer, pages[p + DA_PREFETCH_PAGES], 1, head);                \
            }                                                                                \
            const char *k = layer + da_row(a, pages[p], 0, head) * itemsize;                 \
            for (int64_t slot = t % n; slot < n && t < t1; slot++, t++) {                    \
                rows[count++] = k + slot * stride * itemsize;                                \
                if (count < 16 && t + 1 < t1) continue;                                      \
                for (int j = count; j < 16; j++) rows[j] = rows[0]; /* padding */            \
                float *out = s + t + 1 - count - t0; /* keys t + 1 - count .. t */           \
                for (int64_t g = 0; g < a->group; g++, out += len)                           \
                    if (a->bf16) SCORE_BF16(qb + g * d, rows, count, d, a->scale, out);      \
                    else da_scores16(qf + g * d, rows, count, d, a->scale, out);             \
                count = 0;                                                                   \
            }                                                                                \
        }                                                                                    \
    }

DA_SCORE_KEYS(da_score_keys_dot, "avx512f,avx512bw,avx512vl,avx512bf16", da_scores16_dot)
DA_SCORE_KEYS(da_score_keys_plain, "avx512f,avx512bw,avx512vl", da_scores16_pairs)

#endif

#endif
