/*
 * quant_float.c — reference row kernels for the unblocked types f32, f16 and bf16.
 *
 * Dot products sum each run of COL_DOT_CHUNK values on its own and add the run totals, the
 * same grouping a SIMD kernel with per-lane accumulators gets; it keeps the float32 rounding
 * error proportional to (chunk + n / chunk) instead of n.
 */
#include "col_internal.h"

#define COL_DOT_CHUNK 32

/* ---- f32 ------------------------------------------------------------------------------ */

int col_quantize_row_f32(const float *x, uint8_t *dst, int64_t n) {
    memcpy(dst, x, (size_t)n * sizeof(float));
    return COL_OK;
}

void col_dequantize_row_f32(const uint8_t *src, float *y, int64_t n) {
    memcpy(y, src, (size_t)n * sizeof(float));
}

float col_vec_dot_f32(const uint8_t *w, const float *x, int64_t n) {
    float total = 0.0f;
    for (int64_t i0 = 0; i0 < n; i0 += COL_DOT_CHUNK) {
        const int64_t i1 = i0 + COL_DOT_CHUNK < n ? i0 + COL_DOT_CHUNK : n;
        float sum = 0.0f;
        for (int64_t i = i0; i < i1; i++) sum += col_load_f32(w + 4 * i) * x[i];
        total += sum;
    }
    return total;
}

/* ---- f16 ------------------------------------------------------------------------------ */

int col_quantize_row_f16(const float *x, uint8_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) col_store_u16(dst + 2 * i, col_f32_to_f16(x[i]));
    return COL_OK;
}

void col_dequantize_row_f16(const uint8_t *src, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = col_f16_to_f32(col_load_u16(src + 2 * i));
}

float col_vec_dot_f16(const uint8_t *w, const float *x, int64_t n) {
    float total = 0.0f;
    for (int64_t i0 = 0; i0 < n; i0 += COL_DOT_CHUNK) {
        const int64_t i1 = i0 + COL_DOT_CHUNK < n ? i0 + COL_DOT_CHUNK : n;
        float sum = 0.0f;
        for (int64_t i = i0; i < i1; i++) sum += col_f16_to_f32(col_load_u16(w + 2 * i)) * x[i];
        total += sum;
    }
    return total;
}

/* ---- bf16 ----------------------------------------------------------------------------- */

int col_quantize_row_bf16(const float *x, uint8_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) col_store_u16(dst + 2 * i, col_f32_to_bf16(x[i]));
    return COL_OK;
}

void col_dequantize_row_bf16(const uint8_t *src, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = col_bf16_to_f32(col_load_u16(src + 2 * i));
}

float col_vec_dot_bf16(const uint8_t *w, const float *x, int64_t n) {
    float total = 0.0f;
    for (int64_t i0 = 0; i0 < n; i0 += COL_DOT_CHUNK) {
        const int64_t i1 = i0 + COL_DOT_CHUNK < n ? i0 + COL_DOT_CHUNK : n;
        float sum = 0.0f;
        for (int64_t i = i0; i < i1; i++) sum += col_bf16_to_f32(col_load_u16(w + 2 * i)) * x[i];
        total += sum;
    }
    return total;
}
