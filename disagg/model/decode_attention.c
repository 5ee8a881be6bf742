/* Attention of one new token per sequence over its pages, read where they lie (X8b).

   A decode's attention is small arithmetic over a few hundred keys, but done with PyTorch it
   first copies every page of the request out of the cache (one gather per K and V, per layer)
   and then calls SDPA: the copies, the calls and their thread hand-offs cost more than the
   math. Here each (sequence, KV head) pair is one task: its `group` query heads (the heads
   sharing that KV head, as in `attention.grouped_queries`) are scored against every key of the
   sequence, read in place from the page table's pages, softmax in float32, then the values
   are summed with those weights. NHD and HND differ only in where a token's head row sits.

   Inputs in float32 or bfloat16 (queries and cache alike); sums, softmax and the output's
   accumulation in float32, rounded once to the output's dtype; a NaN score makes its row's
   weights NaN, as PyTorch's softmax does. Returns 0, or a negative code (no AVX-512, a page id
   outside the cache, a length beyond the table, a shape it cannot take): `decode_attention.py`
   raises it as a KernelError, and what the kernel wrote is not read. */

#include <math.h> /* INFINITY, NAN */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

/* Below this much work a team of threads costs more to start than it saves (and a node of a
   tiny model would wake its pool for nothing at every layer). */
#define DA_PARALLEL_MIN (1 << 15)

enum { DA_NHD = 0, DA_HND = 1 };
enum { DA_OK = 0, DA_NO_ISA = -1, DA_BAD_PAGE = -2, DA_BAD_LENGTH = -3, DA_BAD_SHAPE = -4,
       DA_NO_MEMORY = -5 };

typedef struct {
    const void *q;          /* [batch, num_heads, head_dim] */
    const void *layer;      /* one layer: [num_pages, 2, ...page dims], K before V */
    const int64_t *table;   /* [batch, max_pages] */
    const int64_t *kv_lens; /* [batch] */
    void *out;              /* [batch, num_heads, head_dim] */
    int64_t batch, max_pages, num_pages, page_size, cache_heads, head_dim;
    int64_t head_start, num_kv_heads, group; /* the cache heads these queries use */
    int layout, bf16;
    float scale;
} da_args;

#if defined(__x86_64__)
#include <immintrin.h>
#include <omp.h>

int sl_has_avx512(void); /* small_linear.c: AVX-512 F, BW and VL */

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

/* e^x for x <= 0 (scores minus their maximum), 16 at a time: x = n ln2 + r with |r| <= ln2/2,
   e^r by Cephes' degree-6 polynomial for expf (about 1 ulp), then scaled by 2^n. A call to
   libm's expf per score cost more than the rest of the attention. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline __m512 da_exp(__m512 x) {
    /* e^-87 is below every weight that counts. The constant goes first: max returns its second
       operand when either is NaN, so a NaN stays one. */
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
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

/* row[0..len) <- softmax(row), in float32. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static void da_softmax(float *row, int64_t len) {
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    __mmask16 nan = 0; /* max drops NaNs: they are tracked apart and poison the peak */
    for (int64_t t = 0; t < len; t += 16) {
        __mmask16 m = lanes_mask(len, t);
        __m512 x = _mm512_maskz_loadu_ps(m, row + t);
        nan |= _mm512_mask_cmp_ps_mask(m, x, x, _CMP_UNORD_Q);
        top = _mm512_mask_max_ps(top, m, top, x);
    }
    __m512 peak = _mm512_set1_ps(nan ? NAN : _mm512_reduce_max_ps(top));
    for (int64_t t = 0; t < len; t += 16) {
        __mmask16 m = lanes_mask(len, t);
        __m512 e = da_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + t), peak));
        _mm512_mask_storeu_ps(row + t, m, e);
        sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t t = 0; t < len; t += 16) {
        __mmask16 m = lanes_mask(len, t);
        _mm512_mask_storeu_ps(row + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + t),
                                                        inverse));
    }
}

/* The dot product of a query row (float32) with a key row, times the scale. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline float da_dot(const float *q, const void *k, int64_t d, int bf16, float scale) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        __mmask16 m = lanes_mask(d, i);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + i), lanes_load(k, i, bf16, m), acc);
    }
    return _mm512_reduce_add_ps(acc) * scale;
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

/* One (sequence, KV head) task. Each pass runs over one query head at a time, so that its
   sums stay in registers: written back to memory and read again per token, they stalled
   on store-to-load forwarding. `s` holds group * kv_len scores, `qf` the group's rows. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static int da_task(const da_args *a, int64_t b, int64_t kvh, float *qf, float *s) {
    const int64_t d = a->head_dim, kv_len = a->kv_lens[b], n = a->page_size;
    const int64_t group = a->group, stride = da_slot_stride(a), itemsize = a->bf16 ? 2 : 4;
    const int bf16 = a->bf16;
    const float scale = a->scale;
    const int64_t *pages = a->table + b * a->max_pages;
    const int64_t head = a->head_start + kvh, first_q = (b * a->num_kv_heads + kvh) * group * d;
    const int64_t num_pages = (kv_len + n - 1) / n;
    for (int64_t p = 0; p < num_pages; p++)
        if (pages[p] < 0 || pages[p] >= a->num_pages) return DA_BAD_PAGE;
    const char *layer = (const char *)a->layer;
    for (int64_t p = 0; p < DA_PREFETCH_PAGES && p < num_pages; p++) {
        da_prefetch(a, layer, pages[p], 0, head);
        da_prefetch(a, layer, pages[p], 1, head);
    }
    for (int64_t i = 0; i < group * d; i++)
        qf[i] = bf16 ? sl_bf16_to_f32(((const uint16_t *)a->q)[first_q + i])
                     : ((const float *)a->q)[first_q + i];
    for (int64_t g = 0; g < group; g++) { /* scores, pages in order, slots within each */
        float *row = s + g * kv_len;
        for (int64_t p = 0, t = 0; p < num_pages; p++) {
            if (g == 0 && p + DA_PREFETCH_PAGES < num_pages) {
                da_prefetch(a, layer, pages[p + DA_PREFETCH_PAGES], 0, head);
                da_prefetch(a, layer, pages[p + DA_PREFETCH_PAGES], 1, head);
            }
            const char *k = layer + da_row(a, pages[p], 0, head) * itemsize;
            for (int64_t slot = 0; slot < n && t < kv_len; slot++, t++)
                row[t] = da_dot(qf + g * d, k + slot * stride * itemsize, d, bf16, scale);
        }
        da_softmax(row, kv_len);
    }
    for (int64_t g = 0; g < group; g++) { /* values: 16 columns at a time, two sums */
        const float *w = s + g * kv_len;
        for (int64_t i = 0; i < d; i += 16) {
            __mmask16 m = lanes_mask(d, i);
            __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
            for (int64_t p = 0, t = 0; p < num_pages; p++) {
                const char *v = layer + da_row(a, pages[p], 1, head) * itemsize;
                int64_t slot = 0;
                for (; slot + 1 < n && t + 1 < kv_len; slot += 2, t += 2) {
                    even = _mm512_fmadd_ps(_mm512_set1_ps(w[t]),
                                           lanes_load(v + slot * stride * itemsize, i, bf16, m),
                                           even);
                    odd = _mm512_fmadd_ps(_mm512_set1_ps(w[t + 1]),
                                          lanes_load(v + (slot + 1) * stride * itemsize, i, bf16,
                                                  m), odd);
                }
                for (; slot < n && t < kv_len; slot++, t++)
                    even = _mm512_fmadd_ps(_mm512_set1_ps(w[t]),
                                           lanes_load(v + slot * stride * itemsize, i, bf16, m),
                                           even);
            }
            __m512 sum = _mm512_add_ps(even, odd);
            int64_t at = first_q + g * d + i;
            if (bf16) {
                float lanes[16];
                _mm512_storeu_ps(lanes, sum);
                for (int64_t j = 0; j < 16 && i + j < d; j++)
                    ((uint16_t *)a->out)[at + j] = sl_round_bf16(lanes[j]);
            } else {
                _mm512_mask_storeu_ps((float *)a->out + at, m, sum);
            }
        }
    }
    return DA_OK;
}

static int da_check(const da_args *a) {
    if (a->head_dim < 1 || a->group < 1 || a->page_size < 1
        || a->num_kv_heads < 1 || a->head_start < 0
        || a->head_start + a->num_kv_heads > a->cache_heads)
        return DA_BAD_SHAPE;
    for (int64_t b = 0; b < a->batch; b++)
        if (a->kv_lens[b] < 1 || a->kv_lens[b] > a->max_pages * a->page_size)
            return DA_BAD_LENGTH;
    return DA_OK;
}

static int da_run(const da_args *a, int threads) {
    if (!sl_has_avx512()) return DA_NO_ISA;
    int status = da_check(a);
    if (status != DA_OK) return status;
    int64_t tasks = a->batch * a->num_kv_heads, longest = 0, keys = 0;
    if (tasks == 0) return DA_OK;
    for (int64_t b = 0; b < a->batch; b++) {
        longest = a->kv_lens[b] > longest ? a->kv_lens[b] : longest;
        keys += a->kv_lens[b];
    }
    /* Multiply-adds, about: below DA_PARALLEL_MIN one thread is faster. */
    int64_t work = keys * a->num_kv_heads * a->group * a->head_dim * 2;
    int team = threads < 1 || work < DA_PARALLEL_MIN ? 1
               : (tasks < threads ? (int)tasks : threads);
#pragma omp parallel num_threads(team) if (team > 1)
    {
        int64_t rows = a->group * a->head_dim;
        float *scratch = malloc(sizeof(float) * (rows + a->group * longest));
        int mine = scratch ? DA_OK : DA_NO_MEMORY;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (mine != DA_OK) continue;
            mine = da_task(a, task / a->num_kv_heads, task % a->num_kv_heads, scratch,
                           scratch + rows);
        }
        free(scratch);
        if (mine != DA_OK) {
#pragma omp atomic write
            status = mine;
        }
    }
    return status;
}

#else

static int da_run(const da_args *a, int threads) {
    (void)a; (void)threads;
    return DA_NO_ISA;
}

#endif

/* The entry point: addresses as integers, as `sl_linear` takes them. */
int da_decode_attention(int bf16, int layout, uintptr_t q, uintptr_t layer, uintptr_t table,
                        uintptr_t kv_lens, uintptr_t out, int64_t batch, int64_t max_pages,
                        int64_t num_pages, int64_t page_size, int64_t cache_heads,
                        int64_t head_dim, int64_t head_start, int64_t num_kv_heads,
                        int64_t group, float scale, int threads) {
    da_args a = {(const void *)q, (const void *)layer, (const int64_t *)table,
                 (const int64_t *)kv_lens, (void *)out, batch, max_pages, num_pages, page_size,
                 cache_heads, head_dim, head_start, num_kv_heads, group, layout, bf16 != 0,
                 scale};
    return da_run(&a, threads);
}
