/* Attention of one new token per sequence over its pages, read where they lie (X8b).

   A decode's attention is small arithmetic over a few hundred keys, but done with PyTorch it
   first copies every page of the request out of the cache (one gather per K and V, per layer)
   and then calls SDPA: the copies, the calls and their thread hand-offs cost more than the
   math. Here each (sequence, KV head) pair is one task: its `group` query heads (the heads
   sharing that KV head, as in `attention.grouped_queries`) are scored against every key of the
   sequence, read in place from the page table's pages, exponentiated in float32, the values
   summed with those weights, and the sums divided once. When there are too few pairs to keep
   every thread busy, a pair's keys are split into parts that are joined at the end, as a
   split softmax is (`da_combine`). NHD and HND differ only in where a token's head row sits.

   Inputs in float32 or bfloat16 (queries and cache alike); sums, softmax and the output's
   accumulation in float32, rounded once to the output's dtype; a NaN score makes its row's
   weights NaN, as PyTorch's softmax does. Returns 0, or a negative code (no AVX-512, a page id
   outside the cache, a length beyond the table, a shape it cannot take): `decode_attention.py`
   raises it as a KernelError, and what the kernel wrote is not read. */

#include <math.h> /* INFINITY, NAN, expf */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "cpu_kernels.h"

/* Below this much work a team of threads costs more to start than it saves (and a node of a
   tiny model would wake its pool for nothing at every layer). */
#define DA_PARALLEL_MIN (1 << 15)
/* A pair's keys split for the team's sake: at most this many parts, none under this many keys
   (a part costs a pass over its query rows and a share of the join). */
#define DA_MAX_PARTS 8
#define DA_MIN_PART_KEYS 64

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

/* Keys [t0, t1) of one (sequence, KV head) pair: its `group` query heads' scores, their
   exponentials and the values those weigh. Writes, per query head g, the part's peak score
   `peak[g]`, its sum of exponentials `sum[g]` and the weighted sum of its values
   `acc[g * d ..]`, undivided (`da_combine` joins the parts). The keys are read once, 16 at a
   time, each block scored against every query head of the group while it is in L1; the
   values in as few sweeps as the registers allow (`da_values`). `s` holds group * (t1 - t0)
   scores, `qf` the group's query rows. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static int da_part(const da_args *a, int64_t b, int64_t kvh, int64_t t0, int64_t t1, float *qf,
                   float *s, float *peak, float *sum, float *acc) {
    const int64_t d = a->head_dim, n = a->page_size, len = t1 - t0;
    const int64_t group = a->group, stride = da_slot_stride(a), itemsize = a->bf16 ? 2 : 4;
    const int bf16 = a->bf16;
    const float scale = a->scale;
    const int64_t *pages = a->table + b * a->max_pages;
    const int64_t head = a->head_start + kvh, first_q = (b * a->num_kv_heads + kvh) * group * d;
    const int64_t p0 = t0 / n, p1 = (t1 + n - 1) / n; /* the pages holding keys [t0, t1) */
    for (int64_t p = p0; p < p1; p++)
        if (pages[p] < 0 || pages[p] >= a->num_pages) return DA_BAD_PAGE;
    const char *layer = (const char *)a->layer;
    for (int64_t p = p0; p < p0 + DA_PREFETCH_PAGES && p < p1; p++) {
        da_prefetch(a, layer, pages[p], 0, head);
        da_prefetch(a, layer, pages[p], 1, head);
    }
    for (int64_t i = 0; i < group * d; i++)
        qf[i] = elem_load(a->q, first_q + i, bf16);
    const char *rows[16]; /* the next 16 keys' rows, scored together (`da_scores16`) */
    int count = 0;
    for (int64_t p = p0, t = t0; p < p1; p++) { /* scores, pages in order, slots within each */
        if (p + DA_PREFETCH_PAGES < p1) {
            da_prefetch(a, layer, pages[p + DA_PREFETCH_PAGES], 0, head);
            da_prefetch(a, layer, pages[p + DA_PREFETCH_PAGES], 1, head);
        }
        const char *k = layer + da_row(a, pages[p], 0, head) * itemsize;
        for (int64_t slot = t % n; slot < n && t < t1; slot++, t++) {
            rows[count++] = k + slot * stride * itemsize;
            if (count < 16 && t + 1 < t1) continue;
            for (int j = count; j < 16; j++) rows[j] = rows[0]; /* the last block's padding */
            for (int64_t g = 0; g < group; g++) /* keys t + 1 - count .. t */
                da_scores16(qf + g * d, rows, count, d, bf16, scale,
                            s + g * len + t + 1 - count - t0);
            count = 0;
        }
    }
    for (int64_t g = 0; g < group; g++)
        da_exponentials(s + g * len, len, &peak[g], &sum[g]);
    da_values(a, layer, pages, head, t0, t1, s, acc);
    return DA_OK;
}

/* One (sequence, KV head) pair's output from its `parts` (`da_part`'s peaks, sums and value
   sums, part after part): each part's exponentials rescaled to the largest peak, then one
   division. An empty part (no keys) has peak -inf and adds nothing. */
static void da_combine(const da_args *a, int64_t b, int64_t kvh, int parts, const float *peak,
                       const float *sum, const float *acc) {
    const int64_t d = a->head_dim, group = a->group;
    const int64_t first_q = (b * a->num_kv_heads + kvh) * group * d;
    for (int64_t g = 0; g < group; g++) {
        float top = -INFINITY, total = 0.0f, weight[DA_MAX_PARTS];
        int nan = 0;
        for (int k = 0; k < parts; k++) {
            float x = peak[k * group + g];
            nan |= isnan(x);
            top = x > top ? x : top;
        }
        if (nan) top = NAN;
        for (int k = 0; k < parts; k++) {
            float x = peak[k * group + g];
            weight[k] = x == -INFINITY ? 0.0f : expf(x - top);
            total += weight[k] * sum[k * group + g];
        }
        for (int64_t i = 0; i < d; i++) {
            float value = 0.0f;
            for (int k = 0; k < parts; k++)
                if (weight[k] != 0.0f)
                    value += weight[k] * acc[(k * group + g) * d + i];
            value /= total;
            elem_store(a->out, first_q + g * d + i, a->bf16, value);
        }
    }
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
    int team = threads < 1 || work < DA_PARALLEL_MIN ? 1 : threads;
    /* Fewer pairs than twice the team (a batch of one with 3 KV heads on 2 threads: one
       thread took two pairs, the other one) split each pair's keys into parts, so that the
       team shares the keys evenly; a part keeps at least DA_MIN_PART_KEYS of them. */
    int parts = 1;
    if (team > 1 && tasks < 2 * team) {
        parts = (int)((2 * team + tasks - 1) / tasks);
        int64_t most = longest / DA_MIN_PART_KEYS;
        parts = parts > most ? (int)(most > 1 ? most : 1) : parts;
        parts = parts > DA_MAX_PARTS ? DA_MAX_PARTS : parts;
    }
    int64_t items = tasks * parts, widest = (longest + parts - 1) / parts;
    team = items < team ? (int)items : team;
    float *joined = malloc(sizeof(float) * items * a->group * (a->head_dim + 2));
    if (!joined) return DA_NO_MEMORY;
    float *peaks = joined, *sums = joined + items * a->group, *accs = sums + items * a->group;
    int failed = DA_OK;
#pragma omp parallel num_threads(team) if (team > 1)
    {
        int64_t rows = a->group * a->head_dim;
        float *scratch = malloc(sizeof(float) * (rows + a->group * widest));
        int mine = scratch ? DA_OK : DA_NO_MEMORY;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            int64_t task = item / parts, b = task / a->num_kv_heads, len = a->kv_lens[b];
            int64_t t0 = len * (item % parts) / parts, t1 = len * (item % parts + 1) / parts;
            float *peak = peaks + item * a->group, *sum = sums + item * a->group;
            if (mine != DA_OK) continue;
            if (t0 == t1) { /* a pair too short for every part */
                for (int64_t g = 0; g < a->group; g++) peak[g] = -INFINITY, sum[g] = 0.0f;
                continue;
            }
            mine = da_part(a, b, task % a->num_kv_heads, t0, t1, scratch, scratch + rows, peak,
                           sum, accs + item * a->group * a->head_dim);
        }
        free(scratch);
        if (mine != DA_OK) {
#pragma omp atomic write
            failed = mine;
        }
#pragma omp barrier
        int ok;
#pragma omp atomic read
        ok = failed;
        if (ok == DA_OK) {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < tasks; task++)
                da_combine(a, task / a->num_kv_heads, task % a->num_kv_heads, parts,
                           peaks + task * parts * a->group, sums + task * parts * a->group,
                           accs + task * parts * a->group * a->head_dim);
        }
    }
    free(joined);
    return failed;
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
