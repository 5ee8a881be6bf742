/* bfloat16 <-> float32 for the CPU kernels (`small_linear.c`, `decode_attention.c`): a
   bfloat16 is the top half of a float32, and results are rounded to nearest-even, as torch's
   own `.to(torch.bfloat16)` rounds. */

#ifndef DISAGG_BF16_H
#define DISAGG_BF16_H

#include <stdint.h>
#include <string.h>

static inline uint16_t sl_round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float sl_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#endif
