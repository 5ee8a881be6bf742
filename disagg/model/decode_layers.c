/* A decode step's layers in one call (X8e), and SwiGLU's activation for a decode's rows.
 *
 * NOTE (why one call). At batch 1 a SmolLM2 layer is about twenty small operations around its
 * seven weight streams, and each weight stream evicts the interpreter's working set from the
 * caches, so the Python between the kernels costs several times what it costs hot (X8c). This
 * file runs the same kernels in the same order as `transformer.py`'s loop does for a batch of
 * decodes, without returning to Python between them: rms_norm.c, small_linear.c, rotary.c,
 * decode_attention.c, and the two pieces that are PyTorch ops there (the KV append and the
 * residual adds, both exact) plus `dl_silu_mul` below, which the PyTorch loop also calls for
 * the same rows (`swiglu.py`). So the hidden state that leaves here has the loop's bits.
 *
 * NOTE (layout of `weights`). DL_WEIGHTS addresses per layer, in DL_* order; every weight is
 * the model's own contiguous tensor (no copy), in the step's dtype. Q/K/V biases (Qwen2),
 * o_proj's bias and Qwen3's Q/K norms are 0 where the architecture has none. A Qwen3-MoE
 * layer's MLP is its router (DL_ROUTER) and DL_EXPERTS, the address of num_experts triples of
 * addresses (gate, up, down); a dense layer has 0 there and its MLP in DL_GATE..DL_DOWN. The
 * cache is the whole `PagedKVCache.buffer`: layer l starts l * num_pages * 2 * page_size *
 * heads * dim elements in.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "cpu_kernels.h"

enum { DL_IN_NORM, DL_Q, DL_K, DL_V, DL_O, DL_POST_NORM, DL_GATE, DL_UP, DL_DOWN,
       DL_Q_BIAS, DL_K_BIAS, DL_V_BIAS, DL_O_BIAS, DL_Q_NORM, DL_K_NORM, DL_ROUTER, DL_EXPERTS,
       DL_WEIGHTS };

#if defined(__x86_64__)
#include "lanes_exp.h"

/* gate[i] = silu(gate[i]) * up[i], 16 elements at a time (one scalar expf each cost as much
 * as a layer's norms and RoPE together). */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static void dl_silu_mul_lanes(void *g, const void *u, int64_t n, int bf16) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = lanes_mask(n, i);
        __m512 x = lanes_load(g, i, bf16, m);
        __m512 e = lanes_exp(_mm512_sub_ps(_mm512_setzero_ps(), x));
        __m512 silu = lanes_as_dtype(_mm512_div_ps(x, _mm512_add_ps(one, e)), bf16);
        lanes_store(g, i, bf16, m, _mm512_mul_ps(silu, lanes_load(u, i, bf16, m)));
    }
}
#endif

/* gate[i] = silu(gate[i]) * up[i] for n elements, each op rounded to the dtype as PyTorch's
 * `F.silu(gate).mul_(up)` rounds them: silu in float32 (x / (1 + exp(-x))), then the product.
 * Only the exponential may differ from PyTorch's, in its last bit. -1 without AVX-512. */
int dl_silu_mul(int dtype, uintptr_t gate, uintptr_t up, int64_t n) {
    if ((dtype != 0 && dtype != 1) || n < 0 || !sl_has_avx512()) return -1;
#if defined(__x86_64__)
    dl_silu_mul_lanes((void *)gate, (const void *)up, n, dtype == 1);
#endif
    return 0;
}

/* h[i] += d[i], rounded to the dtype: PyTorch's `h = h + d`. */
static void dl_add(void *h, const void *d, int64_t n, int bf16) {
    for (int64_t i = 0; i < n; i++)
        elem_store(h, i, bf16, elem_load(h, i, bf16) + elem_load(d, i, bf16));
}

/* out[r, j] += bias[j] over `rows` rows of n: PyTorch's `out + bias`, a row at a time. */
static void dl_add_bias(char *out, const void *bias, int64_t rows, int64_t n, int bf16) {
    for (int64_t r = 0; r < rows; r++) dl_add(out + r * n * (bf16 ? 2 : 4), bias, n, bf16);
}

/* Row r's K and V ([heads, dim] each) into slot offsets[r] of page pages[r]; -2, and nothing
 * written, if any row's slot is outside the cache. */
static int dl_append(char *layer, int layout, const char *k, const char *v, const int64_t *pages,
                     const int64_t *offsets, int64_t rows, int64_t num_pages, int64_t page_size,
                     int64_t heads, int64_t dim, int64_t es) {
    int64_t head_bytes = dim * es, page_elems = 2 * page_size * heads * dim;
    for (int64_t r = 0; r < rows; r++) /* all rows first: a refusal writes nothing */
        if (pages[r] < 0 || pages[r] >= num_pages || offsets[r] < 0 || offsets[r] >= page_size)
            return -2;
    for (int64_t r = 0; r < rows; r++) {
        for (int part = 0; part < 2; part++) {
            const char *src = (part ? v : k) + r * heads * head_bytes;
            char *page = layer + (pages[r] * page_elems + part * page_size * heads * dim) * es;
            if (layout == 0) /* NHD: [page_size, heads, dim] */
                memcpy(page + offsets[r] * heads * head_bytes, src, heads * head_bytes);
            else /* HND: [heads, page_size, dim] */
                for (int64_t hd = 0; hd < heads; hd++)
                    memcpy(page + (hd * page_size + offsets[r]) * head_bytes,
                           src + hd * head_bytes, head_bytes);
        }
    }
    return 0;
}

/* The routed experts of a Qwen3-MoE layer, as `moe.py`'s `routed_experts` runs them: the
 * router's logits and `mr_softmax_top_k`, then each expert that got a token once, on its
 * tokens in row order (gathered into `xg`), its output times the routing weight added into
 * `out` (zeroed first) one token at a time, experts in id order, each op rounded to the dtype
 * as PyTorch's `*` and `index_add_` round it. */
typedef struct {
    int64_t num_experts, top_k, inter;
    int normalise;
    char *logits, *weights, *xg, *gate, *up, *y;
    int64_t *experts, *tokens, *picks;
    float *probs;
} dl_moe_args;

static int dl_moe(int dtype, const dl_moe_args *m, uintptr_t router, const uintptr_t *experts,
                  const char *xn, char *out, int64_t rows, int64_t hidden, int threads) {
    int bf16 = dtype == 1;
    int64_t es = bf16 ? 2 : 4, top_k = m->top_k;
    int status = sl_linear(dtype, (uintptr_t)xn, router, 0, (uintptr_t)m->logits, rows,
                           m->num_experts, hidden, threads);
    status = status ? status : mr_softmax_top_k(dtype, (uintptr_t)m->logits, rows,
                                                m->num_experts, top_k, m->normalise,
                                                (uintptr_t)m->weights, (uintptr_t)m->experts,
                                                (uintptr_t)m->probs);
    if (status) return status;
    memset(out, 0, (size_t)(rows * hidden * es));
    for (int64_t e = 0; e < m->num_experts && status == 0; e++) {
        int64_t count = 0;
        for (int64_t pick = 0; pick < rows * top_k; pick++)
            if (m->experts[pick] == e) {
                m->tokens[count] = pick / top_k, m->picks[count] = pick;
                memcpy(m->xg + count * hidden * es, xn + (pick / top_k) * hidden * es,
                       hidden * es);
                count++;
            }
        if (!count) continue;
        const uintptr_t *w = experts + 3 * e;
        const uintptr_t gu_b[2] = {0, 0}, gu_y[2] = {(uintptr_t)m->gate, (uintptr_t)m->up};
        const int64_t gu_n[2] = {m->inter, m->inter};
        status = sl_linear_many(dtype, (uintptr_t)m->xg, 2, w, gu_b, gu_y, gu_n, count, hidden,
                                threads); /* gate and up in one team; w[0], w[1] are theirs */
        status = status ? status : dl_silu_mul(dtype, (uintptr_t)m->gate, (uintptr_t)m->up,
                                               count * m->inter);
        status = status ? status : sl_linear(dtype, (uintptr_t)m->gate, w[2], 0,
                                             (uintptr_t)m->y, count, hidden, m->inter,
                                             threads);
        for (int64_t i = 0; i < count && status == 0; i++) { /* y * weight, then out += it */
            float weight = elem_load(m->weights, m->picks[i], bf16);
            char *y = m->y + i * hidden * es;
            for (int64_t j = 0; j < hidden; j++)
                elem_store(y, j, bf16, elem_load(y, j, bf16) * weight);
            dl_add(out + m->tokens[i] * hidden * es, y, hidden, bf16);
        }
    }
    return status;
}

/* `rows` decodes through `num_layers` layers: h ([rows, hidden], in place) is the embedding
 * rows on entry and the last layer's output on return (before the final norm). cos/sin
 * [rows, dim] in the dtype; table [rows, max_pages] and kv_lens [rows] (this step's token
 * included) as decode_attention.c takes them; slot_pages/slot_offsets [rows]: where each row's
 * new K/V goes. num_experts, top_k, normalise, moe_inter: a Qwen3-MoE model's routing and
 * expert width (num_experts 0: no MoE layer). 0 on success; < 0 a refusal (`decode_layers.py`
 * checks the shapes it passes; a page id or slot outside the cache is refused here): h and the
 * cache then hold what the layers before it wrote. */
int dl_decode_layers(int dtype, int layout, uintptr_t weights, int64_t num_layers, uintptr_t h,
                     int64_t rows, uintptr_t cos, uintptr_t sin, uintptr_t cache,
                     int64_t num_pages, int64_t page_size, uintptr_t table, int64_t max_pages,
                     uintptr_t kv_lens, uintptr_t slot_pages, uintptr_t slot_offsets,
                     int64_t hidden, int64_t num_heads, int64_t kv_heads, int64_t dim,
                     int64_t inter, int64_t num_experts, int64_t top_k, int normalise,
                     int64_t moe_inter, float eps, float scale, int threads) {
    if ((dtype != 0 && dtype != 1) || (layout != 0 && layout != 1) || !sl_has_avx512()
        || rows < 1 || kv_heads < 1 || num_heads % kv_heads)
        return -1;
    int bf16 = dtype == 1;
    int64_t es = bf16 ? 2 : 4, q_n = num_heads * dim, kv_n = kv_heads * dim;
    /* One block for the step's intermediates: xn, q, k, v, q and k normed (Qwen3), q and k
     * rotated, attention, out, gate, up. */
    int64_t wide = inter > moe_inter ? inter : moe_inter; /* gate and up: either MLP's */
    char *scratch = malloc((size_t)(rows * es * (2 * hidden + 4 * q_n + 4 * kv_n + 2 * wide)));
    /* A MoE layer's: logits, routing weights, gathered rows, expert outputs; ids; probs. */
    int64_t n_picks = rows * top_k;
    char *moe = NULL;
    if (num_experts) /* int64 arrays first, then floats, then the dtype's: each aligned */
        moe = malloc((size_t)(sizeof(int64_t) * 3 * n_picks + sizeof(float) * num_experts
                              + es * (rows * num_experts + n_picks + 2 * rows * hidden)));
    if (!scratch || (num_experts && !moe)) {
        free(scratch), free(moe);
        return -5;
    }
    char *xn = scratch, *q = xn + rows * hidden * es, *k = q + rows * q_n * es;
    char *v = k + rows * kv_n * es, *qn = v + rows * kv_n * es, *kn = qn + rows * q_n * es;
    char *qr = kn + rows * kv_n * es, *kr = qr + rows * q_n * es;
    char *attn = kr + rows * kv_n * es, *out = attn + rows * q_n * es;
    char *gate = out + rows * hidden * es, *up = gate + rows * wide * es;
    dl_moe_args m = {num_experts, top_k, moe_inter, normalise, 0};
    if (moe) {
        m.experts = (int64_t *)moe, m.tokens = m.experts + n_picks;
        m.picks = m.tokens + n_picks, m.probs = (float *)(m.picks + n_picks);
        m.logits = (char *)(m.probs + num_experts), m.weights = m.logits + rows * num_experts * es;
        m.xg = m.weights + n_picks * es, m.y = m.xg + rows * hidden * es;
        m.gate = gate, m.up = up;
    }
    const uintptr_t *w = (const uintptr_t *)weights;
    int64_t layer_bytes = num_pages * 2 * page_size * kv_n * es;
    int status = 0;
    for (int64_t l = 0; l < num_layers && status == 0; l++, w += DL_WEIGHTS) {
        char *layer = (char *)cache + l * layer_bytes;
        status = rn_rms_norm(dtype, h, w[DL_IN_NORM], (uintptr_t)xn, rows, hidden, eps, threads);
        { /* q, k and v: one team for the three (sl_linear_many) */
            const uintptr_t qkv_w[3] = {w[DL_Q], w[DL_K], w[DL_V]};
            const uintptr_t qkv_b[3] = {w[DL_Q_BIAS], w[DL_K_BIAS], w[DL_V_BIAS]};
            const uintptr_t qkv_y[3] = {(uintptr_t)q, (uintptr_t)k, (uintptr_t)v};
            const int64_t qkv_n[3] = {q_n, kv_n, kv_n};
            status = status ? status : sl_linear_many(dtype, (uintptr_t)xn, 3, qkv_w, qkv_b,
                                                      qkv_y, qkv_n, rows, hidden, threads);
        }
        char *qs = q, *ks = k; /* what RoPE rotates: the projections, or Qwen3's normed heads */
        if (w[DL_Q_NORM]) {
            status = status ? status : rn_rms_norm(dtype, (uintptr_t)q, w[DL_Q_NORM],
                                                   (uintptr_t)qn, rows * num_heads, dim, eps,
                                                   threads);
            status = status ? status : rn_rms_norm(dtype, (uintptr_t)k, w[DL_K_NORM],
                                                   (uintptr_t)kn, rows * kv_heads, dim, eps,
                                                   threads);
            qs = qn, ks = kn;
        }
        status = status ? status : rot_rotate_half(dtype, (uintptr_t)qs, cos, sin,
                                                   (uintptr_t)qr, rows, num_heads, dim, threads);
        status = status ? status : rot_rotate_half(dtype, (uintptr_t)ks, cos, sin,
                                                   (uintptr_t)kr, rows, kv_heads, dim, threads);
        status = status ? status : dl_append(layer, layout, kr, v, (const int64_t *)slot_pages,
                                             (const int64_t *)slot_offsets, rows, num_pages,
                                             page_size, kv_heads, dim, es);
        status = status ? status : da_decode_attention(
            bf16, layout, (uintptr_t)qr, (uintptr_t)layer, table, kv_lens, (uintptr_t)attn,
            rows, max_pages, num_pages, page_size, kv_heads, dim, 0, kv_heads,
            num_heads / kv_heads, scale, threads);
        status = status ? status : sl_linear(dtype, (uintptr_t)attn, w[DL_O], 0,
                                             (uintptr_t)out, rows, hidden, q_n, threads);
        if (status) break;
        if (w[DL_O_BIAS]) dl_add_bias(out, (const void *)w[DL_O_BIAS], rows, hidden, bf16);
        dl_add((void *)h, out, rows * hidden, bf16);
        status = rn_rms_norm(dtype, h, w[DL_POST_NORM], (uintptr_t)xn, rows, hidden, eps,
                             threads);
        if (w[DL_ROUTER]) {
            status = status ? status : moe ? dl_moe(dtype, &m, w[DL_ROUTER],
                                                    (const uintptr_t *)w[DL_EXPERTS], xn, out,
                                                    rows, hidden, threads) : -1;
        } else {
            const uintptr_t gu_w[2] = {w[DL_GATE], w[DL_UP]}, gu_b[2] = {0, 0};
            const uintptr_t gu_y[2] = {(uintptr_t)gate, (uintptr_t)up};
            const int64_t gu_n[2] = {inter, inter};
            status = status ? status : sl_linear_many(dtype, (uintptr_t)xn, 2, gu_w, gu_b, gu_y,
                                                      gu_n, rows, hidden, threads);
            status = status ? status : dl_silu_mul(dtype, (uintptr_t)gate, (uintptr_t)up,
                                                   rows * inter);
            status = status ? status : sl_linear(dtype, (uintptr_t)gate, w[DL_DOWN], 0,
                                                 (uintptr_t)out, rows, hidden, inter, threads);
        }
        if (status) break;
        dl_add((void *)h, out, rows * hidden, bf16);
    }
    free(scratch);
    free(moe);
    return status;
}
