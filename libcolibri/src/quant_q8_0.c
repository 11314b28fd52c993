/*
 * quant_q8_0.c — reference kernels for q8_0: blocks of 32 int8 quants and one f16 scale,
 * byte-identical to ggml's Q8_0. Block layout: see colibri.h.
 */
#include <float.h>
#include <math.h>

#include "col_internal.h"

int col_quantize_row_q8_0(const float *x, uint8_t *dst, int64_t n) {
    const int64_t nb = n / COL_QK8_0;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * COL_QK8_0; /* (32) */
        uint8_t *blk = dst + b * (int64_t)sizeof(col_block_q8_0);
        float amax = 0.0f;
        int finite = 1;
        for (int j = 0; j < COL_QK8_0; j++) {
            const float ax = fabsf(xb[j]);
            finite &= ax <= FLT_MAX; /* false for inf and NaN */
            if (ax > amax) amax = ax;
        }
        if (!finite) return COL_ERANGE;
        /* ggml's rule: the scale is computed in f32 and only stored as f16. */
        const float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        if (!(id <= FLT_MAX)) id = 0.0f; /* amax ~1e-36: 1/d overflows; d is 0 in f16 anyway */
        const uint16_t d16 = col_f32_to_f16(d);
        if ((d16 & 0x7c00u) == 0x7c00u) return COL_ERANGE; /* scale overflows f16 */
        col_store_u16(blk + offsetof(col_block_q8_0, d), d16);
        int8_t *qs = (int8_t *)(blk + offsetof(col_block_q8_0, qs));
        for (int j = 0; j < COL_QK8_0; j++) qs[j] = (int8_t)roundf(xb[j] * id);
    }
    return COL_OK;
}

void col_dequantize_row_q8_0(const uint8_t *src, float *y, int64_t n) {
    const int64_t nb = n / COL_QK8_0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = src + b * (int64_t)sizeof(col_block_q8_0);
        const float d = col_f16_to_f32(col_load_u16(blk + offsetof(col_block_q8_0, d)));
        const int8_t *qs = (const int8_t *)(blk + offsetof(col_block_q8_0, qs));
        for (int j = 0; j < COL_QK8_0; j++) y[b * COL_QK8_0 + j] = d * (float)qs[j];
    }
}

float col_vec_dot_q8_0(const uint8_t *w, const float *x, int64_t n) {
    const int64_t nb = n / COL_QK8_0;
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (int64_t)sizeof(col_block_q8_0);
        const float d = col_f16_to_f32(col_load_u16(blk + offsetof(col_block_q8_0, d)));
        const int8_t *qs = (const int8_t *)(blk + offsetof(col_block_q8_0, qs));
        const float *xb = x + b * COL_QK8_0; /* (32) */
        float sum = 0.0f;
        for (int j = 0; j < COL_QK8_0; j++) sum += (float)qs[j] * xb[j];
        total += d * sum;
    }
    return total;
}
