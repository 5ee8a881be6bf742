/* Qwen3-MoE's routing of a decode's few token rows (X8e): softmax over every expert's logit in
 * float32, the top k kept, renormalised to sum to one if asked, rounded to the logits' dtype.
 *
 * `moe_routing.py` calls it for a decode step's rows in the PyTorch loop, and `decode_layers.c`
 * for the same rows in its one call, so the two route alike to the bit; more rows (a prefill
 * chunk) run PyTorch's softmax and topk, its reference in the tests. Ties go to the lower
 * expert id (torch.topk leaves their order open); a NaN logit makes its row's probabilities,
 * and so its weights, NaN, as PyTorch's softmax does, and a NaN ranks above every number. */

#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "cpu_kernels.h"

/* Whether probability a (of expert ia) ranks above b (of expert ib). */
static inline int mr_above(float a, int64_t ia, float b, int64_t ib) {
    if (isnan(a) || isnan(b)) return isnan(a) && (!isnan(b) || ia < ib);
    return a > b || (a == b && ia < ib);
}

/* logits [rows, num_experts] (float32 or bfloat16, `dtype` 0 or 1) -> weights [rows, top_k]
 * in the same dtype and experts [rows, top_k], best first. `probs` is scratch of num_experts
 * floats. 0, or -1 for arguments no router has. */
int mr_softmax_top_k(int dtype, uintptr_t logits, int64_t rows, int64_t num_experts,
                     int64_t top_k, int normalise, uintptr_t weights, uintptr_t experts,
                     uintptr_t probs) {
    if ((dtype != 0 && dtype != 1) || rows < 0 || top_k < 1 || top_k > num_experts)
        return -1;
    float *p = (float *)probs;
    int64_t *chosen = (int64_t *)experts;
    for (int64_t r = 0; r < rows; r++) {
        float top = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < num_experts; e++) {
            p[e] = elem_load((const void *)logits, r * num_experts + e, dtype);
            top = p[e] > top || isnan(p[e]) ? p[e] : top;
        }
        for (int64_t e = 0; e < num_experts; e++) sum += p[e] = expf(p[e] - top);
        for (int64_t e = 0; e < num_experts; e++) p[e] /= sum;
        float picked[top_k], total = 0.0f;
        for (int64_t k = 0; k < top_k; k++) { /* k passes: top_k is a handful */
            int64_t best = -1;
            for (int64_t e = 0; e < num_experts; e++) {
                int taken = 0;
                for (int64_t j = 0; j < k; j++) taken |= chosen[r * top_k + j] == e;
                if (!taken && (best < 0 || mr_above(p[e], e, p[best], best))) best = e;
            }
            chosen[r * top_k + k] = best;
            total += picked[k] = p[best];
        }
        for (int64_t k = 0; k < top_k; k++) {
            elem_store((void *)weights, r * top_k + k, dtype,
                       normalise ? picked[k] / total : picked[k]);
        }
    }
    return 0;
}
