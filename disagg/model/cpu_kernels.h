/* The CPU kernels' entry points (X8), in one place: every kernel file includes this after
   <stdint.h>, and `_cpu_kernels_build.py` hands it to cffi as its cdef, so the C side and the
   Python binding cannot disagree on an argument. Only declarations and comments: cffi's cdef
   reads no preprocessor lines (so no include guard: repeating a declaration is legal C, and
   the kernels are compiled as one translation unit). Addresses travel as integers
   (`data_ptr()` values); dtype 0 is float32, 1 bfloat16; 0 is success, a negative code a
   refusal the Python wrapper raises. */

/* small_linear.c (X8a): y[m, n] = x[m, k] @ w[n, k]^T (+ bias) for up to 8 rows. */
int sl_has_avx512(void);
int sl_has_avx512_bf16(void);
int sl_linear_many(int dtype, uintptr_t x, int count, const uintptr_t *w, const uintptr_t *bias,
                   const uintptr_t *y, const int64_t *n, int64_t m, int64_t k, int threads);
int sl_linear(int dtype, uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m,
              int64_t n, int64_t k, int threads);
/* decode_attention.c (X8b): one new token per sequence over its pages, in place. */
int da_decode_attention(int bf16, int layout, uintptr_t q, uintptr_t layer, uintptr_t table,
                        uintptr_t kv_lens, uintptr_t out, int64_t batch, int64_t max_pages,
                        int64_t num_pages, int64_t page_size, int64_t cache_heads,
                        int64_t head_dim, int64_t head_start, int64_t num_kv_heads,
                        int64_t group, float scale, int threads);
int da_block_scores(int bf16, uintptr_t q, uintptr_t keys, int64_t count, int64_t d,
                    float scale, uintptr_t out);
/* rms_norm.c and rotary.c (X8c). */
int rn_rms_norm(int dtype, uintptr_t x, uintptr_t weight, uintptr_t out, int64_t rows,
                int64_t width, float eps, int threads);
int rot_rotate_half(int dtype, uintptr_t x, uintptr_t cos, uintptr_t sin, uintptr_t out,
                    int64_t tokens, int64_t heads, int64_t dim, int threads);
/* decode_layers.c and moe_route.c (X8e): a decode step's layers in one call. */
int dl_silu_mul(int dtype, uintptr_t gate, uintptr_t up, int64_t n);
int mr_softmax_top_k(int dtype, uintptr_t logits, int64_t rows, int64_t num_experts,
                     int64_t top_k, int normalise, uintptr_t weights, uintptr_t experts,
                     uintptr_t probs);
int dl_decode_layers(int dtype, int layout, uintptr_t weights, int64_t num_layers, uintptr_t h,
                     int64_t rows, uintptr_t cos, uintptr_t sin, uintptr_t cache,
                     int64_t num_pages, int64_t page_size, uintptr_t table, int64_t max_pages,
                     uintptr_t kv_lens, uintptr_t slot_pages, uintptr_t slot_offsets,
                     int64_t hidden, int64_t num_heads, int64_t kv_heads, int64_t dim,
                     int64_t inter, int64_t num_experts, int64_t top_k, int normalise,
                     int64_t moe_inter, float eps, float scale, int threads);
/* logits_argmax.c (X8g): the greedy token of one logits row, torch.argmax's index. */
int64_t la_argmax(int dtype, uintptr_t x, int64_t n);
/* kv_lane_sum.c (X4c, X8d): the KV checksum's weighted lane sums. */
uint64_t kls_lane_sum(uintptr_t values, int lane_bytes, int64_t heads, int64_t tokens,
                      int64_t lanes, uintptr_t head_ids, int64_t first_position, uint64_t seed,
                      int threads);
uint64_t kls_layers_sum(uintptr_t pages, int64_t offset, int64_t layer_stride, int64_t layers_n,
                        uintptr_t seeds, int64_t page_size, int64_t first_row, int lane_bytes,
                        int64_t heads, int64_t tokens, int64_t lanes, int64_t head_stride,
                        int64_t token_stride, uintptr_t head_ids, int64_t first_position,
                        int threads);
