/*
 * simd_neon.c — q8_0 / q4_g64 / mxfp4 dot products with int8 activations for aarch64 Advanced SIMD.
 *
 * Written to be obviously correct rather than fast: widening int8 multiplies (vmull_s8)
 * accumulated pairwise into int32 (vpadalq_s16), one block at a time, scaled in float. Every
 * aarch64 CPU has these instructions, so the level is always available there.
 *
 * Tested for correctness only, and not on real hardware (the build machines are x86-64):
 * tests/test_neon_qemu.py cross-compiles libcolibri/tests/neon_check.c with the library for
 * aarch64 and runs it under qemu-user, comparing this level with the portable one (matmul on
 * odd shapes and thread splits, fused experts, rounding of ties). No speed numbers exist.
 */
#include <math.h>

#include "col_internal.h"

#ifdef __aarch64__
#include <arm_neon.h>

/* sum_j a[j] * b[j] over 32 int8 pairs, in int32. */
static inline int32_t dot32_s8(const int8_t *a, const int8_t *b) {
    int32x4_t acc = vdupq_n_s32(0);
    for (int j = 0; j < 32; j += 16) {
        const int8x16_t va = vld1q_s8(a + j), vb = vld1q_s8(b + j);
        acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(va), vget_low_s8(vb)));
        acc = vpadalq_s16(acc, vmull_s8(vget_high_s8(va), vget_high_s8(vb)));
    }
    return vaddvq_s32(acc);
}

static float dot_q8_0_neon(const uint8_t *w, const col_xq_row *x, int64_t nb) {
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 34;
        const float dw = col_f16_to_f32(col_load_u16(blk));
        total += dw * x->d[b] * (float)dot32_s8((const int8_t *)(blk + 2), x->qs + b * 32);
    }
    return total;
}

static float dot_q4_g64_neon(const uint8_t *w, const col_xq_row *x, int64_t nb) {
    float total = 0.0f;
    const uint8x16_t low4 = vdupq_n_u8(0x0f);
    for (int64_t k = 0; k < nb / 2; k++) {
        const uint8_t *blk = w + k * 36;
        const float d = col_f16_to_f32(col_load_u16(blk));
        const float m = col_f16_to_f32(col_load_u16(blk + 2));
        int8_t lo[32], hi[32]; /* q in 0..15 fits int8 */
        for (int j = 0; j < 32; j += 16) {
            const uint8x16_t q = vld1q_u8(blk + 4 + j);
            vst1q_s8(lo + j, vreinterpretq_s8_u8(vandq_u8(q, low4)));
            vst1q_s8(hi + j, vreinterpretq_s8_u8(vshrq_n_u8(q, 4)));
        }
        /* activations for q4_g64 come in blocks of 64: one scale x->d[k] */
        const int32_t s = dot32_s8(lo, x->qs + k * 64) + dot32_s8(hi, x->qs + k * 64 + 32);
        total += d * x->d[k] * (float)s + m * x->ds2[k];
    }
    return total;
}

/* mxfp4: the codes become int8 weights (2 x e2m1, -12..12) by table lookup (tbl), low
 * nibbles elements 0..15, high nibbles 16..31; the block's factor 2^(e - 128) in float. */
static float dot_mxfp4_neon(const uint8_t *w, const col_xq_row *x, int64_t nb) {
    const int8x16_t table = vld1q_s8(col_e2m1_x2);
    const uint8x16_t low4 = vdupq_n_u8(0x0f);
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 17;
        const uint8x16_t q = vld1q_u8(blk + 1);
        int8_t wq[32]; /* (32) the block's weights in element order */
        vst1q_s8(wq, vqtbl1q_s8(table, vandq_u8(q, low4)));
        vst1q_s8(wq + 16, vqtbl1q_s8(table, vshrq_n_u8(q, 4)));
        total += col_e8m0_half_to_f32(blk[0]) * x->d[b] * (float)dot32_s8(wq, x->qs + b * 32);
    }
    return total;
}

/* Y = s Y + X M (col_internal.h) in tiles of NR rows (4, 2 or 1) by 16 columns (four vectors);
 * the columns past the last multiple of 16 one at a time with fmaf, which rounds as vfmaq
 * does: every element gets s * y (or 0), then one fused multiply-add per row of M in order,
 * whatever its tile. */
#define GEMM_TILE_ROWS 4

static inline __attribute__((always_inline)) void gemm_tile_neon(float *y, int64_t y_stride, float s, const float *x,
                                                                 int64_t x_stride, const float *m, int64_t rows,
                                                                 int64_t cols, const int nr) {
    float32x4_t acc[GEMM_TILE_ROWS][4]; /* (NR, 16 columns) */
#pragma GCC unroll 4
    for (int q = 0; q < nr; q++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
            acc[q][v] = s == 0.0f ? vdupq_n_f32(0.0f) : vmulq_n_f32(vld1q_f32(y + q * y_stride + 4 * v), s);
    for (int64_t i = 0; i < rows; i++) {
        const float *mi = m + i * cols;
        float32x4_t mv[4];
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) mv[v] = vld1q_f32(mi + 4 * v);
#pragma GCC unroll 4
        for (int q = 0; q < nr; q++) {
            const float32x4_t xq = vdupq_n_f32(x[q * x_stride + i]);
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) acc[q][v] = vfmaq_f32(acc[q][v], xq, mv[v]);
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < nr; q++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) vst1q_f32(y + q * y_stride + 4 * v, acc[q][v]);
}

static void gemm_f32_neon(float *y, int64_t y_stride, float s, const float *x, int64_t x_stride, const float *m,
                          int64_t n, int64_t rows, int64_t cols) {
    const int64_t full = cols / 16 * 16;
    for (int64_t j0 = 0; j0 < full; j0 += 16) {
        int64_t r = 0;
        for (; r + GEMM_TILE_ROWS <= n; r += GEMM_TILE_ROWS)
            gemm_tile_neon(y + r * y_stride + j0, y_stride, s, x + r * x_stride, x_stride, m + j0, rows, cols, GEMM_TILE_ROWS);
        if (r + 2 <= n) { /* k and q of the recurrent step share their reads of S */
            gemm_tile_neon(y + r * y_stride + j0, y_stride, s, x + r * x_stride, x_stride, m + j0, rows, cols, 2);
            r += 2;
        }
        for (; r < n; r++) gemm_tile_neon(y + r * y_stride + j0, y_stride, s, x + r * x_stride, x_stride, m + j0, rows, cols, 1);
    }
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = full; j < cols; j++) {
            float acc = s == 0.0f ? 0.0f : s * y[r * y_stride + j];
            for (int64_t i = 0; i < rows; i++) acc = fmaf(x[r * x_stride + i], m[i * cols + j], acc);
            y[r * y_stride + j] = acc;
        }
}

col_gemm_f32_fn col_gemm_f32_neon(void) { return gemm_f32_neon; }

static const col_kernel_set neon_kernels = {
    COL_KERNELS_NEON,
    {[COL_TYPE_Q8_0] = dot_q8_0_neon, [COL_TYPE_Q4_G64] = dot_q4_g64_neon, [COL_TYPE_MXFP4] = dot_mxfp4_neon},
    col_dot_f32_portable, col_axpy_f32_portable, {NULL}, col_silu_mul_portable, col_quantize_block_portable,
    col_rms_norm_row_portable, col_clamped_swiglu_portable, {NULL}, col_gelu_tanh_mul_portable, {NULL}, {NULL}, NULL};

const col_kernel_set *col_kernels_neon(void) { return &neon_kernels; }

#else

const col_kernel_set *col_kernels_neon(void) { return NULL; }
col_gemm_f32_fn col_gemm_f32_neon(void) { return NULL; }

#endif
