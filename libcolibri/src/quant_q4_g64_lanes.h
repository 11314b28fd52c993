/*
 * quant_q4_g64_lanes.h — col_quantize_row_q4_g64's search with one block per SIMD lane.
 *
 * Included once per SIMD level by a file that first defines
 *   Q4L_LANES       blocks searched at once (8 for AVX2, 16 for AVX-512)
 *   Q4L_TARGET      the level's function attribute (__attribute__((target(...))))
 *   q4l_min(a, b)   the level's minps, a < b ? a : b, per lane (vf)
 *   q4l_max(a, b)   the level's maxps, a > b ? a : b, per lane (vf)
 *   q4l_wide_lo(v), q4l_wide_hi(v)  the lower / upper half of the lanes of v (vf) as double
 *                   (vdh: one register; a double vector of all lanes would be two, and GCC
 *                   spills such vectors through memory)
 *   q4l_narrow(lo, hi)  the two halves rounded to float (vf), as the C cast rounds
 * and then defines its row quantizer as q4l_quantize_row.
 *
 * Why one block per lane: the search (quant_q4_g64.c) is a chain of dependent steps per
 * block (assign the levels, solve the 2x2 least squares, round d and m to f16, assign
 * again), so with one block's 64 values across the vector its speed is bound by the chain's
 * latency and by the scalar bookkeeping between steps. With one block per lane, independent
 * blocks fill the pipeline and the bookkeeping is vector code too.
 *
 * Why the bytes are the reference's: every lane runs the reference's search on its own
 * block, operation for operation. The arithmetic is written with GCC vector extensions, where
 * `+ - * /` and the conversions are one IEEE operation per lane with the reference's
 * rounding (-ffp-contract=off forbids FMA here too); every sum is accumulated over j = 0..63
 * in the reference's order and type (lane l adds x[l][j] when the reference adds x[j]); the
 * f16 roundings are the reference's integer arithmetic in vector form; each lane walks its
 * block's candidates in the reference's order and keeps one with the same strict `<`.
 * Nothing is reassociated, so no tolerance argument is needed; the tests compare the bytes
 * with the portable reference on every level anyway.
 *
 * Lockstep: each step assigns one candidate in every lane. A lane walks its block's
 * candidates (the min/max start and its least-squares rounds, then each grid start and its
 * rounds); once its block is done the lane idles (its results are ignored) until every lane
 * of the group is done. The lanes past the row's last block repeat that block.
 */
#include <stdint.h>
#include <string.h>

#define Q4L_BLOCK COL_QK4_G64 /* 64 values per block */
#define Q4L_LEVELS 16         /* q in 0..15 */
#define Q4L_GRID_STEPS 2      /* quant_q4_g64.c's Q4_GRID_STEPS */
#define Q4L_LS_ROUNDS 6       /* quant_q4_g64.c's Q4_LS_ROUNDS */
#define Q4L_F16_MAX 65504.0f  /* quant_q4_g64.c's Q4_F16_MAX */
#define Q4L_STARTS (1 + Q4L_GRID_STEPS) /* the min/max start, then the grid starts */

/* One value per lane; masks are integer vectors of -1 (true) or 0. */
typedef float vf __attribute__((vector_size(4 * Q4L_LANES)));
typedef int32_t vi __attribute__((vector_size(4 * Q4L_LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * Q4L_LANES)));
typedef double vdh __attribute__((vector_size(4 * Q4L_LANES))); /* half the lanes */
typedef int64_t vlh __attribute__((vector_size(4 * Q4L_LANES)));
typedef uint8_t vb __attribute__((vector_size(Q4L_LANES)));

Q4L_TARGET static inline vi sel_i(vi mask, vi a, vi b) { return (mask & a) | (~mask & b); }
Q4L_TARGET static inline vu sel_u(vi mask, vu a, vu b) { return (vu)sel_i(mask, (vi)a, (vi)b); }
Q4L_TARGET static inline vf sel_f(vi mask, vf a, vf b) { return (vf)sel_i(mask, (vi)a, (vi)b); }
Q4L_TARGET static inline vf abs_f(vf v) { return (vf)((vu)v & 0x7fffffffu); }
Q4L_TARGET static inline vdh sel_dh(vlh mask, vdh a, vdh b) { return (vdh)((mask & (vlh)a) | (~mask & (vlh)b)); }

Q4L_TARGET static inline int any_lane(vi mask) {
    int any = 0;
    for (int l = 0; l < Q4L_LANES; l++) any |= mask[l];
    return any != 0;
}

/* col_f32_to_f16 for non-NaN values: the same integer steps, every case computed and the
 * lane's own selected. */
Q4L_TARGET static vu f32_to_f16(vf f) {
    const vu u = (vu)f;
    const vu sign = (u >> 16) & 0x8000u;
    const vu a = u & 0x7fffffffu;
    /* >= 2^-14: a normal half, rounded to nearest even */
    const vu normal = (a + 0xfffu + ((a >> 13) & 1u) - ((uint32_t)(127 - 15) << 23)) >> 13;
    /* below: a half subnormal (or zero), q = mant >> shift rounded to even; the shift is
     * clamped to 1..25 only so that lanes on the other paths stay defined */
    const vu e = a >> 23;
    vu shift = 126u - e;
    shift = sel_u((vi)(shift > 25u), (vu){0} + 25u, shift);
    shift = sel_u((vi)(shift < 1u), (vu){0} + 1u, shift);
    const vu mant = (a & 0x7fffffu) | 0x800000u;
    const vu q = mant >> shift;
    const vu rem = mant & ((1u << shift) - 1u);
    const vu half = 1u << (shift - 1u);
    const vi round_up = (vi)(rem > half) | ((vi)(rem == half) & (vi)((q & 1u) != 0));
    const vu subnormal = sel_u((vi)(e == 0) | (vi)(126u - e > 24u), (vu){0}, q - (vu)round_up);
    vu h = sel_u((vi)(a >= 0x38800000u), normal, subnormal);
    h = sel_u((vi)(a >= 0x477ff000u), (vu){0} + 0x7c00u, h); /* >= 65520 (and inf) rounds to inf */
    return sign | h;
}

/* col_f16_to_f32: exact. */
Q4L_TARGET static vf f16_to_f32(vu h) {
    const vu sign = (h & 0x8000u) << 16;
    const vu exp = (h >> 10) & 0x1fu;
    const vu mant = h & 0x3ffu;
    const vu normal = sign | ((exp + (127 - 15)) << 23) | (mant << 13);
    const vu special = sign | 0x7f800000u | (mant << 13);
    const vu subnormal = sign | (vu)(__builtin_convertvector(mant, vf) * 0x1p-24f); /* |v| exact, sign or'ed */
    return (vf)sel_u((vi)(exp == 0x1fu), special, sel_u((vi)(exp == 0), subnormal, normal));
}

/* quant_q4_g64.c's f16_next_up / f16_next_down, f16_ceil / f16_floor. */
Q4L_TARGET static vu f16_next_up(vu h) {
    return sel_u((vi)((h & 0x7fffu) == 0), (vu){0} + 0x0001u, sel_u((vi)((h & 0x8000u) != 0), h - 1u, h + 1u));
}

Q4L_TARGET static vu f16_next_down(vu h) {
    return sel_u((vi)((h & 0x7fffu) == 0), (vu){0} + 0x8001u, sel_u((vi)((h & 0x8000u) != 0), h + 1u, h - 1u));
}

Q4L_TARGET static vu f16_ceil(vf v) {
    const vu h = f32_to_f16(v);
    return sel_u((vi)(f16_to_f32(h) < v), f16_next_up(h), h);
}

Q4L_TARGET static vu f16_floor(vf v) {
    const vu h = f32_to_f16(v);
    return sel_u((vi)(f16_to_f32(h) > v), f16_next_down(h), h);
}

/* A group's blocks, transposed: value j of every lane's block in one vector. */
typedef struct {
    vf x[Q4L_BLOCK];     /* (64, L) */
    vdh x_wide[Q4L_BLOCK][2]; /* (64, 2, L / 2) the same values as double, in two halves */
    vi q[2][Q4L_BLOCK];  /* (2, 64, L) the levels of this step and of the lane's previous step */
} q4l_group;

/* The reference's q4_assign in every lane for that lane's (d, m): the squared error and the
 * largest |error| (the reference's "every error within d/2" is largest <= d/2), the sums its
 * least squares needs (sum q and sum q^2 are integers: exact in int32; sum q x in double, in
 * order), and whether any level differs from the lane's previous step. */
typedef struct {
    vf sse, worst_err;
    vi sum_q, sum_qq, changed;
    vdh sum_qx[2];
} q4l_assigned;

Q4L_TARGET static q4l_assigned q4l_assign(q4l_group *g, int step, vf d, vf m) {
    const vf id = sel_f((vi)(d > 0.0f), 1.0f / d, (vf){0});
    const vf zero = {0}, top = zero + (float)(Q4L_LEVELS - 1);
    vi *q_now = g->q[step & 1];
    const vi *q_before = g->q[(step & 1) ^ 1];
    q4l_assigned r = {{0}, {0}, {0}, {0}, {0}, {{0}, {0}}};
    for (int j = 0; j < Q4L_BLOCK; j++) {
        const vf x = g->x[j];
        const vf v = q4l_min(q4l_max((x - m) * id, zero), top); /* v <= 0 -> 0, v >= 15 -> 15 */
        const vi q = __builtin_convertvector(v + 0.5f, vi);     /* truncation, as (int) */
        const vf qf = __builtin_convertvector(q, vf);
        const vf err = x - (d * qf + m);
        r.sse += err * err;
        r.worst_err = q4l_max(r.worst_err, abs_f(err));
        r.sum_q += q;
        r.sum_qq += q * q;
        r.sum_qx[0] += q4l_wide_lo(qf) * g->x_wide[j][0];
        r.sum_qx[1] += q4l_wide_hi(qf) * g->x_wide[j][1];
        r.changed |= q ^ q_before[j];
        q_now[j] = q;
    }
    return r;
}

/* The reference's least-squares (d, m) from the sums of half the lanes, in the same double
 * operations; d = 0 where the reference gives up (all levels equal, d not positive, d or m
 * beyond f16), which the caller's "d rounds to a nonzero f16" check then refuses. */
Q4L_TARGET static vdh q4l_least_squares(vdh sq, vdh sqq, vdh sqx, vdh sx, vdh *m_out) {
    const double n = Q4L_BLOCK;
    const vdh det = n * sqq - sq * sq;
    const vdh d = (n * sqx - sq * sx) / det;
    const vdh m = (sx - d * sq) / n;
    const vdh abs_m = (vdh)((vlh)m & INT64_MAX);
    const vlh ok = (vlh)(det > 0) & (vlh)(d > 0) & ~(vlh)(d > Q4L_F16_MAX) & ~(vlh)(abs_m > Q4L_F16_MAX);
    *m_out = m;
    return sel_dh(ok, d, (vdh){0});
}

/* Searches blocks x (n_blocks <= L, 64 values each) into dst (n_blocks q4_g64 blocks).
 * Returns 0, writing nothing, if a value is NaN, infinite or beyond +-65504. */
Q4L_TARGET static int q4l_search_group(q4l_group *g, const float *x, uint8_t *dst, int n_blocks) {
    for (int l = 0; l < Q4L_LANES; l++) {
        const float *xb = x + (l < n_blocks ? l : n_blocks - 1) * Q4L_BLOCK;
        for (int j = 0; j < Q4L_BLOCK; j++) g->x[j][l] = xb[j];
    }
    /* the reference's block scan: lo, hi keep the first of equal values (signed zeros) */
    vf lo = g->x[0], hi = g->x[0];
    vi in_range = ~(vi){0};
    vdh sum_x[2] = {{0}, {0}};
    for (int j = 0; j < Q4L_BLOCK; j++) {
        const vf v = g->x[j];
        g->x_wide[j][0] = q4l_wide_lo(v);
        g->x_wide[j][1] = q4l_wide_hi(v);
        in_range &= (vi)(abs_f(v) <= Q4L_F16_MAX); /* false for NaN */
        lo = q4l_min(v, lo);
        hi = q4l_max(v, hi);
        sum_x[0] += g->x_wide[j][0];
        sum_x[1] += g->x_wide[j][1];
    }
    if (any_lane(~in_range)) return 0;

    /* The starts. Constant block: its one candidate, d = 0 and m = its value. */
    const vi constant = (vi)(hi == lo);
    vu start_d16[Q4L_STARTS], start_m16[Q4L_STARTS];
    vi start_valid[Q4L_STARTS];
    {
        const vu m16 = f16_floor(lo);
        const vu d16 = f16_ceil((hi - f16_to_f32(m16)) / (float)(Q4L_LEVELS - 1));
        start_d16[0] = sel_u(constant, (vu){0}, d16);
        start_m16[0] = sel_u(constant, f32_to_f16(lo), m16);
        start_valid[0] = ~(vi){0};
    }
    const vf range = hi - lo, mid = 0.5f * (lo + hi);
    for (int k = 1; k <= Q4L_GRID_STEPS; k++) {
        const float levels = (float)(Q4L_LEVELS - 1) + (float)k / (float)Q4L_GRID_STEPS;
        const vf d = range / levels;
        const vf m = mid - 0.5f * (float)(Q4L_LEVELS - 1) * d;
        start_d16[k] = f32_to_f16(d);
        start_m16[k] = f32_to_f16(m);
        start_valid[k] = ~constant & (vi)((start_d16[k] & 0x7fffu) != 0);
    }

    /* Lane state: the start a lane walks from (Q4L_STARTS: done), least-squares rounds
     * taken from it, the candidate to assign next, the best so far. */
    vi chain = {0}, round = {0};
    const vi max_rounds = sel_i(constant, (vi){0}, (vi){0} + Q4L_LS_ROUNDS);
    vu cand_d16 = start_d16[0], cand_m16 = start_m16[0];
    vu best_d16 = cand_d16, best_m16 = cand_m16;
    vf best_sse = {0};
    vi active = ~(vi){0};
    for (int step = 0; any_lane(active); step++) {
        const vf d = f16_to_f32(cand_d16), m = f16_to_f32(cand_m16);
        const q4l_assigned a = q4l_assign(g, step, d, m);

        /* keep: the block's first candidate always, later ones if within d/2 and lower */
        const vi within = (vi)(a.worst_err <= 0.5f * d);
        const vi better = active & (step == 0 ? ~(vi){0} : within & (vi)(a.sse < best_sse));
        best_sse = sel_f(better, a.sse, best_sse);
        best_d16 = sel_u(better, cand_d16, best_d16);
        best_m16 = sel_u(better, cand_m16, best_m16);

        /* the next least-squares round from these levels, unless they did not change */
        const vi converged = (vi)(round > 0) & (vi)(a.changed == 0);
        vi refine = active & (vi)(round < max_rounds) & ~converged;
        const vf sq = __builtin_convertvector(a.sum_q, vf), sqq = __builtin_convertvector(a.sum_qq, vf); /* exact */
        vdh ls_d[2], ls_m[2];
        ls_d[0] = q4l_least_squares(q4l_wide_lo(sq), q4l_wide_lo(sqq), a.sum_qx[0], sum_x[0], &ls_m[0]);
        ls_d[1] = q4l_least_squares(q4l_wide_hi(sq), q4l_wide_hi(sqq), a.sum_qx[1], sum_x[1], &ls_m[1]);
        const vu ls_d16 = f32_to_f16(q4l_narrow(ls_d[0], ls_d[1]));
        const vu ls_m16 = f32_to_f16(q4l_narrow(ls_m[0], ls_m[1]));
        refine &= (vi)((ls_d16 & 0x7fffu) != 0); /* also where the least squares failed */

        /* lanes leaving their chain move to their next valid start, or are done */
        const vi leave = active & ~refine;
        vi next = chain + 1;
        next = sel_i((vi)(next == 1) & ~start_valid[1], next + 1, next);
        next = sel_i((vi)(next == 2) & ~start_valid[2], next + 1, next);
        chain = sel_i(leave, next, chain);
        active &= (vi)(chain < Q4L_STARTS);
        const vi on_1 = (vi)(chain == 1);
        cand_d16 = sel_u(refine, ls_d16, sel_u(on_1, start_d16[1], start_d16[2]));
        cand_m16 = sel_u(refine, ls_m16, sel_u(on_1, start_m16[1], start_m16[2]));
        round = sel_i(refine, round + 1, (vi){0});
    }

    /* the winners' levels, assigned again exactly as the reference assigned them */
    const vf best_d = f16_to_f32(best_d16), best_m = f16_to_f32(best_m16);
    for (int b = 0; b < n_blocks; b++) {
        const float d = best_d[b], m = best_m[b];
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        const vf zero = {0}, top = zero + (float)(Q4L_LEVELS - 1);
        const float *xb = x + b * Q4L_BLOCK;
        uint8_t *blk = dst + b * (int64_t)sizeof(col_block_q4_g64);
        vi q[Q4L_BLOCK / Q4L_LANES];
        for (int c = 0; c < Q4L_BLOCK / Q4L_LANES; c++) {
            vf v;
            memcpy(&v, xb + c * Q4L_LANES, sizeof v);
            q[c] = __builtin_convertvector(q4l_min(q4l_max((v - m) * id, zero), top) + 0.5f, vi);
        }
        col_store_u16(blk + offsetof(col_block_q4_g64, d), (uint16_t)best_d16[b]);
        col_store_u16(blk + offsetof(col_block_q4_g64, m), (uint16_t)best_m16[b]);
        /* qs[j] = q[j] | q[j + 32] << 4 */
        for (int c = 0; c < Q4L_BLOCK / 2 / Q4L_LANES; c++) {
            const vb packed = __builtin_convertvector(q[c] | q[c + Q4L_BLOCK / 2 / Q4L_LANES] << 4, vb);
            memcpy(blk + offsetof(col_block_q4_g64, qs) + c * Q4L_LANES, &packed, sizeof packed);
        }
    }
    return 1;
}

/* col_quantize_row_q4_g64's bytes and status. A group with a value out of range is left to
 * the reference, which writes the blocks before the first such value and returns its error. */
Q4L_TARGET static int q4l_quantize_row(const float *x, uint8_t *dst, int64_t n) {
    const int64_t nb = n / Q4L_BLOCK;
    q4l_group g;
    for (int64_t b = 0; b < nb; b += Q4L_LANES) {
        const int count = nb - b < Q4L_LANES ? (int)(nb - b) : Q4L_LANES;
        const float *xg = x + b * Q4L_BLOCK;
        uint8_t *dg = dst + b * (int64_t)sizeof(col_block_q4_g64);
        if (!q4l_search_group(&g, xg, dg, count)) return col_quantize_row_q4_g64(xg, dg, (nb - b) * Q4L_BLOCK);
    }
    return COL_OK;
}
