/*
 * quant_mxfp4.c — reference kernels for mxfp4, the OCP MX FP4 type: blocks of 32 e2m1 codes
 * (4 bits each) sharing one e8m0 exponent. Layout: colibri.h.
 *
 * Published MXFP4 weights (gpt-oss) are copied into packs, not quantized here: decoding is
 * what must be exact. A value is e2m1(code) * 2^(e - 127); written as
 * col_e2m1_x2[code] * 2^(e - 128) every factor is exact in float32 (the doubled codes are
 * the integers -12..12 the SIMD kernels multiply with, and 2^(e - 128) is a float for every
 * byte e), so the product is exact too, signed zeros included.
 *
 * The quantizer exists so that any weight can be stored as mxfp4 (and measured): per block
 * it tries the OCP shared exponent floor(log2(max|x|)) - 2, which maps the largest value into
 * [4, 8) and may clip it to 6, and the exponent above it, which never clips; each value goes
 * to its nearest code (ties to the code with an even mantissa bit, as OCP rounding says),
 * and the exponent whose decoded block has the lower squared error wins (the OCP one on a
 * tie). Deterministic.
 */
#include <float.h>
#include <math.h>

#include "col_internal.h"

const int8_t col_e2m1_x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* The e2m1 values of the codes, in float, -0.0 kept (code 8): what decoding multiplies. */
static const float e2m1_x2_f32[16] = {0.0f,  1.0f,  2.0f,  3.0f,  4.0f,  6.0f,  8.0f,  12.0f,
                                      -0.0f, -1.0f, -2.0f, -3.0f, -4.0f, -6.0f, -8.0f, -12.0f};

#define E8M0_BIAS 127
#define E2M1_EMAX 2 /* the largest e2m1 value, 6 = 1.5 * 2^2 */

/* The magnitude code (0..7) nearest to v >= 0 (in units of the block scale), saturating at
 * 6. On a tie between two codes the even one wins: its mantissa bit is 0. */
static int e2m1_code_of(float v) {
    /* midpoints between the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 */
    return (v > 0.25f) + (v >= 0.75f) + (v > 1.25f) + (v >= 1.75f) + (v > 2.5f) + (v >= 3.5f) + (v > 5.0f);
}

/* Encodes x (32) with exponent byte e into codes q (32), returns the squared error of the
 * decoded block. */
static float mxfp4_assign(const float *x, int e, uint8_t *q) {
    const float half_scale = col_e8m0_half_to_f32((uint8_t)e);
    float sse = 0.0f;
    for (int j = 0; j < COL_QK_MXFP4; j++) {
        const float v = ldexpf(fabsf(x[j]), E8M0_BIAS - e); /* |x| / 2^(e - 127), exact scaling */
        const int mag = e2m1_code_of(v);
        const int code = mag == 0 ? 0 : (x[j] < 0.0f ? mag | 8 : mag); /* zeros as +0 */
        const float err = x[j] - e2m1_x2_f32[code] * half_scale;
        sse += err * err;
        q[j] = (uint8_t)code;
    }
    return sse;
}

static int mxfp4_quantize_block(const float *x /* (32) */, uint8_t *blk) {
    float amax = 0.0f;
    int finite = 1;
    for (int j = 0; j < COL_QK_MXFP4; j++) {
        const float ax = fabsf(x[j]);
        finite &= ax <= FLT_MAX; /* false for inf and NaN */
        if (ax > amax) amax = ax;
    }
    if (!finite) return COL_ERANGE;

    uint8_t best_q[COL_QK_MXFP4] = {0}, q[COL_QK_MXFP4];
    int best_e = 0; /* an all-zero block: codes 0, exponent byte 0 */
    if (amax > 0.0f) {
        int exp2;
        frexpf(amax, &exp2); /* amax = m * 2^exp2, m in [0.5, 1): floor(log2(amax)) = exp2 - 1 */
        int e_ocp = exp2 - 1 - E2M1_EMAX + E8M0_BIAS;
        if (e_ocp < 0) e_ocp = 0; /* tiny blocks: the smallest scale (largest is never reached) */
        best_e = e_ocp;
        float best_sse = mxfp4_assign(x, e_ocp, best_q);
        if (mxfp4_assign(x, e_ocp + 1, q) < best_sse) {
            best_e = e_ocp + 1;
            memcpy(best_q, q, sizeof q);
        }
    }
    blk[offsetof(col_block_mxfp4, e)] = (uint8_t)best_e;
    uint8_t *qs = blk + offsetof(col_block_mxfp4, qs);
    for (int j = 0; j < COL_QK_MXFP4 / 2; j++)
        qs[j] = (uint8_t)(best_q[j] | (best_q[j + COL_QK_MXFP4 / 2] << 4));
    return COL_OK;
}

int col_quantize_row_mxfp4(const float *x, uint8_t *dst, int64_t n) {
    const int64_t nb = n / COL_QK_MXFP4;
    for (int64_t b = 0; b < nb; b++) {
        const int st = mxfp4_quantize_block(x + b * COL_QK_MXFP4, dst + b * (int64_t)sizeof(col_block_mxfp4));
        if (st != COL_OK) return st;
    }
    return COL_OK;
}

void col_dequantize_row_mxfp4(const uint8_t *src, float *y, int64_t n) {
    const int64_t nb = n / COL_QK_MXFP4;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = src + b * (int64_t)sizeof(col_block_mxfp4);
        const float half_scale = col_e8m0_half_to_f32(blk[offsetof(col_block_mxfp4, e)]);
        const uint8_t *qs = blk + offsetof(col_block_mxfp4, qs);
        float *yb = y + b * COL_QK_MXFP4; /* (32) */
        for (int j = 0; j < COL_QK_MXFP4 / 2; j++) {
            yb[j] = e2m1_x2_f32[qs[j] & 0x0f] * half_scale;
            yb[j + COL_QK_MXFP4 / 2] = e2m1_x2_f32[qs[j] >> 4] * half_scale;
        }
    }
}

float col_vec_dot_mxfp4(const uint8_t *w, const float *x, int64_t n) {
    const int64_t nb = n / COL_QK_MXFP4;
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (int64_t)sizeof(col_block_mxfp4);
        const uint8_t *qs = blk + offsetof(col_block_mxfp4, qs);
        const float *xb = x + b * COL_QK_MXFP4; /* (32) */
        float sum = 0.0f; /* in units of the half scale: the doubled codes are exact */
        for (int j = 0; j < COL_QK_MXFP4 / 2; j++)
            sum += (float)col_e2m1_x2[qs[j] & 0x0f] * xb[j] + (float)col_e2m1_x2[qs[j] >> 4] * xb[j + COL_QK_MXFP4 / 2];
        total += col_e8m0_half_to_f32(blk[offsetof(col_block_mxfp4, e)]) * sum;
    }
    return total;
}
