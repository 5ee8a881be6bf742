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
   accumulation in float32, rounded once to the output's dtype (a bfloat16 score's products
   summed in pairs, as AVX-512 BF16's dot product sums them, `attention_math.h`); a NaN score
   makes its row's weights NaN, as PyTorch's softmax does. Returns 0, or a negative code (no
   AVX-512, a page id outside the cache, a length beyond the table, a shape it cannot take):
   `decode_attention.py` raises it as a KernelError, and what the kernel wrote is not read. */

#include <math.h> /* INFINITY, NAN, expf */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_sweeps.h"
#include "bf16.h"
#include "cpu_kernels.h"

/* Below this much work a team of threads costs more to start than it saves (and a node of a
   tiny model would wake its pool for nothing at every layer). */
#define DA_PARALLEL_MIN (1 << 15)
/* A pair's keys split for the team's sake: at most this many parts, none under this many keys
   (a part costs a pass over its query rows and a share of the join). */
#define DA_MAX_PARTS 8
#define DA_MIN_PART_KEYS 64

enum { DA_OK = 0, DA_NO_ISA = -1, DA_BAD_PAGE = -2, DA_BAD_LENGTH = -3, DA_BAD_SHAPE = -4,
       DA_NO_MEMORY = -5 };

#if defined(__x86_64__)
#include <immintrin.h>
#include <omp.h>

/* Keys [t0, t1) of one (sequence, KV head) pair: its `group` query heads' scores, their
   exponentials and the values those weigh. Writes, per query head g, the part's peak score
   `peak[g]`, its sum of exponentials `sum[g]` and the weighted sum of its values
   `acc[g * d ..]`, undivided (`da_combine` joins the parts). The keys are read once, 16 at a
   time, each block scored against every query head of the group while it is in L1; the
   values in as few sweeps as the registers allow (the sweeps: `attention_sweeps.h`). `s`
   holds group * (t1 - t0) scores, `qf` room for the group's query rows (float32 ones are
   copied there, as the scoring reads them there fastest). */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static int da_part(const da_args *a, int64_t b, int64_t kvh, int64_t t0, int64_t t1, float *qf,
                   float *s, float *peak, float *sum, float *acc) {
    const int64_t d = a->head_dim, n = a->page_size, len = t1 - t0;
    const int64_t group = a->group;
    const int bf16 = a->bf16;
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
    if (!bf16) memcpy(qf, (const float *)a->q + first_q, sizeof(float) * group * d);
    const uint16_t *qb = bf16 ? (const uint16_t *)a->q + first_q : NULL; /* as they are */
    if (a->bf16_dot) da_score_keys_dot(a, layer, pages, head, t0, t1, qf, qb, s);
    else da_score_keys_plain(a, layer, pages, head, t0, t1, qf, qb, s);
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

/* One block's scores (`da_block_scores`), each dtype and CPU as the sweeps above score it. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void da_block_dot(const uint16_t *q, const char *const *rows, int count, int64_t d,
                         float scale, float *out) {
    da_scores16_dot(q, rows, count, d, scale, out);
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
static int da_block_run(int bf16, const void *q, const char *keys, int64_t count, int64_t d,
                        float scale, float *out) {
    if (!sl_has_avx512()) return DA_NO_ISA;
    if (count < 1 || count > 16 || d < 1) return DA_BAD_SHAPE;
    const char *rows[16];
    for (int j = 0; j < 16; j++) rows[j] = keys + (j < count ? j : 0) * d * (bf16 ? 2 : 4);
    if (bf16 && sl_has_avx512_bf16()) da_block_dot(q, rows, (int)count, d, scale, out);
    else if (bf16) da_scores16_pairs(q, rows, (int)count, d, scale, out);
    else da_scores16((const float *)q, rows, (int)count, d, scale, out);
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

static int da_block_run(int bf16, const void *q, const char *keys, int64_t count, int64_t d,
                        float scale, float *out) {
    (void)bf16; (void)q; (void)keys; (void)count; (void)d; (void)scale; (void)out;
    return DA_NO_ISA;
}

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
                 bf16 != 0 && sl_has_avx512_bf16(), scale};
    return da_run(&a, threads);
}

/* Scores of `count` (1 to 16) contiguous key rows of `d` elements against one query row, as
   the attention above scores a block of keys (float32 or bfloat16 alike): its block
   arithmetic on its own, so that tests hold it to the dot-product instruction's definition.
   0, or DA_NO_ISA / DA_BAD_SHAPE. */
int da_block_scores(int bf16, uintptr_t q, uintptr_t keys, int64_t count, int64_t d,
                    float scale, uintptr_t out) {
    return da_block_run(bf16 != 0, (const void *)q, (const char *)keys, count, d, scale,
                        (float *)out);
}
