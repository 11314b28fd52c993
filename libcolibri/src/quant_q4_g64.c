/*
 * quant_q4_g64.c — reference kernels for q4_g64, Colibri's 4-bit type: blocks of 64 values
 * with an f16 scale d and an f16 offset m, value = d * q + m, q in 0..15. Layout: colibri.h.
 *
 * The quantizer searches (d, m) per block:
 *   1. the min/max start: m = min rounded down to f16, d = (max - m) / 15 rounded up to f16,
 *      so the 16 levels cover the block and every element is within d/2 of its level;
 *   2. a few scales between range/15 and range/16 with the grid centred on the block (a
 *      smaller step that still covers the block to within half a step);
 *   3. from each of these, a few rounds of least squares: with q fixed, the best (d, m) solve
 *      a 2x2 linear system; round them to f16, re-assign q, repeat.
 * Every candidate is scored with its f16-rounded d and m, exactly as col_dequantize will
 * decode it. A candidate is kept only if no element is more than d/2 from its decoded value
 * (so the error of every element is bounded by half a step: outliers are never clipped), and
 * the lowest squared error wins. The search is deterministic.
 */
#include <float.h>
#include <math.h>

#include "col_internal.h"

#define Q4_LEVELS 16          /* q in 0..15 */
#define Q4_GRID_STEPS 2       /* extra scales tried between range/15 and range/16 */
#define Q4_LS_ROUNDS 6        /* least-squares rounds from each start (stops early once q is stable) */
#define Q4_F16_MAX 65504.0f   /* largest finite f16: d and m must be representable */

typedef struct {
    uint16_t d16, m16;           /* as stored */
    float sse;                   /* squared error of the decoded block */
    uint8_t q[COL_QK4_G64];      /* (64) level of each element */
} q4_choice;

static uint16_t f16_next_up(uint16_t h) {
    if ((h & 0x7fffu) == 0) return 0x0001u;
    return (h & 0x8000u) ? (uint16_t)(h - 1u) : (uint16_t)(h + 1u);
}

static uint16_t f16_next_down(uint16_t h) {
    if ((h & 0x7fffu) == 0) return 0x8001u;
    return (h & 0x8000u) ? (uint16_t)(h + 1u) : (uint16_t)(h - 1u);
}

/* Smallest f16 >= v (v finite, within f16 range). */
static uint16_t f16_ceil(float v) {
    uint16_t h = col_f32_to_f16(v);
    return col_f16_to_f32(h) < v ? f16_next_up(h) : h;
}

/* Largest f16 <= v (v finite, within f16 range). */
static uint16_t f16_floor(float v) {
    uint16_t h = col_f32_to_f16(v);
    return col_f16_to_f32(h) > v ? f16_next_down(h) : h;
}

/* Assigns each element of x (64) its nearest level for the stored (d16, m16) and scores the
 * result. Returns 1 if every element decodes to within d/2 of its input. */
static int q4_assign(const float *x, uint16_t d16, uint16_t m16, q4_choice *c) {
    const float d = col_f16_to_f32(d16), m = col_f16_to_f32(m16);
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    const float half_step = 0.5f * d;
    float sse = 0.0f;
    int within = 1;
    for (int j = 0; j < COL_QK4_G64; j++) {
        const float v = (x[j] - m) * id;
        const int q = v <= 0.0f ? 0 : v >= (float)(Q4_LEVELS - 1) ? Q4_LEVELS - 1 : (int)(v + 0.5f);
        const float err = x[j] - (d * (float)q + m); /* same expression as dequantize */
        sse += err * err;
        within &= fabsf(err) <= half_step;
        c->q[j] = (uint8_t)q;
    }
    c->d16 = d16;
    c->m16 = m16;
    c->sse = sse;
    return within;
}

static void q4_keep_if_better(const q4_choice *c, int within, q4_choice *best) {
    if (within && c->sse < best->sse) *best = *c;
}

/* Least-squares rounds starting from the levels in *start. */
static void q4_refine(const float *x, const q4_choice *start, q4_choice *best) {
    q4_choice cur = *start, next;
    for (int round = 0; round < Q4_LS_ROUNDS; round++) {
        /* minimise sum_j (x_j - d q_j - m)^2 over (d, m) with q fixed */
        double sq = 0, sqq = 0, sx = 0, sqx = 0;
        for (int j = 0; j < COL_QK4_G64; j++) {
            const double q = cur.q[j];
            sq += q;
            sqq += q * q;
            sx += x[j];
            sqx += q * x[j];
        }
        const double n = COL_QK4_G64;
        const double det = n * sqq - sq * sq;
        if (det <= 0) return; /* all elements on one level */
        const double d = (n * sqx - sq * sx) / det;
        const double m = (sx - d * sq) / n;
        if (!(d > 0) || d > Q4_F16_MAX || fabs(m) > Q4_F16_MAX) return;
        const uint16_t d16 = col_f32_to_f16((float)d), m16 = col_f32_to_f16((float)m);
        if ((d16 & 0x7fffu) == 0) return;
        const int within = q4_assign(x, d16, m16, &next);
        q4_keep_if_better(&next, within, best);
        if (memcmp(next.q, cur.q, sizeof cur.q) == 0) return; /* converged */
        cur = next;
    }
}

static int q4_quantize_block(const float *x /* (64) */, uint8_t *blk) {
    float lo = x[0], hi = x[0];
    int in_range = 1;
    for (int j = 0; j < COL_QK4_G64; j++) {
        in_range &= fabsf(x[j]) <= Q4_F16_MAX; /* false for NaN and inf too */
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    if (!in_range) return COL_ERANGE;

    q4_choice best, cand;
    if (hi == lo) { /* constant block: exact up to the f16 rounding of the value */
        q4_assign(x, 0, col_f32_to_f16(lo), &best);
    } else {
        /* 1. min/max start, rounded outward so it always covers the block */
        const uint16_t m16 = f16_floor(lo);
        const uint16_t d16 = f16_ceil((hi - col_f16_to_f32(m16)) / (float)(Q4_LEVELS - 1));
        q4_assign(x, d16, m16, &best);
        cand = best;
        q4_refine(x, &cand, &best);

        /* 2. smaller steps, grid centred on the block: step in [range/16, range/15) keeps
         *    every element within half a step before f16 rounding */
        const float range = hi - lo, mid = 0.5f * (lo + hi);
        for (int k = 1; k <= Q4_GRID_STEPS; k++) {
            const float levels = (float)(Q4_LEVELS - 1) + (float)k / (float)Q4_GRID_STEPS;
            const float d = range / levels;
            const float m = mid - 0.5f * (float)(Q4_LEVELS - 1) * d;
            const uint16_t dk = col_f32_to_f16(d), mk = col_f32_to_f16(m);
            if ((dk & 0x7fffu) == 0) continue;
            const int within = q4_assign(x, dk, mk, &cand);
            q4_keep_if_better(&cand, within, &best);
            q4_refine(x, &cand, &best);
        }
    }

    col_store_u16(blk + offsetof(col_block_q4_g64, d), best.d16);
    col_store_u16(blk + offsetof(col_block_q4_g64, m), best.m16);
    uint8_t *qs = blk + offsetof(col_block_q4_g64, qs);
    for (int j = 0; j < COL_QK4_G64 / 2; j++)
        qs[j] = (uint8_t)(best.q[j] | (best.q[j + COL_QK4_G64 / 2] << 4));
    return COL_OK;
}

int col_quantize_row_q4_g64(const float *x, uint8_t *dst, int64_t n) {
    const int64_t nb = n / COL_QK4_G64;
    for (int64_t b = 0; b < nb; b++) {
        const int st = q4_quantize_block(x + b * COL_QK4_G64, dst + b * (int64_t)sizeof(col_block_q4_g64));
        if (st != COL_OK) return st;
    }
    return COL_OK;
}

void col_dequantize_row_q4_g64(const uint8_t *src, float *y, int64_t n) {
    const int64_t nb = n / COL_QK4_G64;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = src + b * (int64_t)sizeof(col_block_q4_g64);
        const float d = col_f16_to_f32(col_load_u16(blk + offsetof(col_block_q4_g64, d)));
        const float m = col_f16_to_f32(col_load_u16(blk + offsetof(col_block_q4_g64, m)));
        const uint8_t *qs = blk + offsetof(col_block_q4_g64, qs);
        float *yb = y + b * COL_QK4_G64; /* (64) */
        for (int j = 0; j < COL_QK4_G64 / 2; j++) {
            yb[j] = d * (float)(qs[j] & 0x0f) + m;
            yb[j + COL_QK4_G64 / 2] = d * (float)(qs[j] >> 4) + m;
        }
    }
}

float col_vec_dot_q4_g64(const uint8_t *w, const float *x, int64_t n) {
    const int64_t nb = n / COL_QK4_G64;
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (int64_t)sizeof(col_block_q4_g64);
        const float d = col_f16_to_f32(col_load_u16(blk + offsetof(col_block_q4_g64, d)));
        const float m = col_f16_to_f32(col_load_u16(blk + offsetof(col_block_q4_g64, m)));
        const uint8_t *qs = blk + offsetof(col_block_q4_g64, qs);
        const float *xb = x + b * COL_QK4_G64; /* (64) */
        /* sum_j (d q_j + m) x_j = d * sum_j q_j x_j + m * sum_j x_j */
        float sum_qx = 0.0f, sum_x = 0.0f;
        for (int j = 0; j < COL_QK4_G64 / 2; j++) {
            sum_qx += (float)(qs[j] & 0x0f) * xb[j] + (float)(qs[j] >> 4) * xb[j + COL_QK4_G64 / 2];
            sum_x += xb[j] + xb[j + COL_QK4_G64 / 2];
        }
        total += d * sum_qx + m * sum_x;
    }
    return total;
}
