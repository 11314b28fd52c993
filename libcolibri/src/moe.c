/*
 * moe.c — the fused routed-expert step: for every expert selected in one layer step, the
 * gate and up products, SiLU(gate) * up, the down product and the weighted accumulation
 * into the output, in one call and one pool job.
 *
 * Legend: T tokens, A slots per token (top-k), E selected experts, D hidden, F expert ffn,
 * N = number of (token, slot) assignments that name an expert (<= T * A).
 *
 * The job runs in four phases separated by barriers:
 *   0. quantize the T activation rows (integer path only), tokens split across threads;
 *   1. h[n] = silu(gate_e x_t) * (up_e x_t) for every assignment n = (t, e) (with a
 *      col_expert_ffn: the gate and up biases added first, and its activation: clamped
 *      SwiGLU for gpt-oss, GeGLU for Gemma 4): the E * F
 *      (expert, row) pairs are split evenly across threads, so 8 experts on 2 threads or 1
 *      expert on 2 threads are both balanced;
 *   2. quantize the N rows of h (integer path only);
 *   3. out[t, d] += w_n * ((down_e h[n])[d] (+ down bias)): the D output rows are split across threads, so
 *      no two threads write the same element and every element sums its experts in
 *      increasing e, whatever the thread count.
 * With col_expert_ffn.weight_on_input (Llama 4) the input rows are the N products w_n * x_t,
 * made before the job (phase 0 then quantizes those), and every w_n in phase 3 is 1.
 */
#include <math.h>

#include "col_internal.h"

#define MOE_ROW_TILE 16

/* Assignments per group that meet a tile of weight rows: a level's rows_xq kernel walks the
 * group in its own groups of four (and may repack the tile once for all of them, as the
 * AVX-512 VNNI tiles do); the dotn kernels take four at a time. */
#define MOE_TOKEN_GROUP 64

typedef struct {
    const col_type_traits *tt;
    const col_kernel_set *k;
    col_silu_mul_fn silu_mul;       /* the level's (plain SwiGLU) */
    const col_expert_ffn *kind;     /* NULL: plain SwiGLU, no biases */
    int type;
    int integer;                    /* 1: quantized activations */
    int64_t n_experts, dim, ffn;
    const uint8_t *const *gate;     /* (E) each (F, row_bytes(D)) */
    const uint8_t *const *up;       /* (E) each (F, row_bytes(D)) */
    const uint8_t *const *down;     /* (E) each (D, row_bytes(F)) */
    int64_t rb_dim, rb_ffn;         /* row bytes of gate/up and of down */
    const float *x;                 /* (X, D) input rows: X = T, or N with weight_on_input */
    int64_t n_x;                    /* X */
    const int64_t *first;           /* (E + 1) assignments of expert e: first[e] .. first[e+1] */
    const int32_t *asg_tok;         /* (N) token of each assignment, grouped by expert */
    const int32_t *asg_in;          /* (N) its input row of x */
    const float *asg_w;             /* (N) its weight */
    uint8_t *xq;                    /* (X, xq_d) quantized x */
    size_t xq_d;
    float *h;                       /* (N, F) */
    uint8_t *hq;                    /* (N, xq_f) quantized h */
    size_t xq_f;
    float *out;                     /* (T, D) */
    col_barrier barrier;
} moe_job;

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* h[0:n] from the gate and up products g, u of rows r0 .. r0 + n of expert ex: biases added,
 * then the activation (g and u are scratch). */
static void activate(const moe_job *j, int64_t ex, int64_t r0, float *g, float *u, float *h, int64_t n) {
    const col_expert_ffn *kind = j->kind;
    if (!kind) {
        j->silu_mul(g, u, h, n);
        return;
    }
    if (kind->gate_bias) {
        const float *bg = kind->gate_bias[ex] + r0, *bu = kind->up_bias[ex] + r0;
        for (int64_t i = 0; i < n; i++) {
            g[i] += bg[i];
            u[i] += bu[i];
        }
    }
    if (kind->activation == COL_ACT_CLAMPED_SWIGLU)
        (j->k->clamped_swiglu ? j->k->clamped_swiglu : col_clamped_swiglu_portable)(g, u, h, n, kind->alpha, kind->limit);
    else if (kind->activation == COL_ACT_GELU_TANH)
        (j->k->gelu_tanh_mul ? j->k->gelu_tanh_mul : col_gelu_tanh_mul_portable)(g, u, h, n);
    else
        j->silu_mul(g, u, h, n);
}

/* The down bias of expert ex at output row d, or 0. */
static inline float down_bias(const moe_job *j, int64_t ex, int64_t d) {
    return j->kind && j->kind->down_bias ? j->kind->down_bias[ex][d] : 0.0f;
}

/* h[n, r0:r1] for the assignments n of expert ex (integer path). */
static void gate_up_xq(const moe_job *j, int64_t ex, int64_t r0, int64_t r1) {
    const int64_t nb_d = j->dim / COL_QK_X, F = j->ffn;
    for (int64_t n0 = j->first[ex]; n0 < j->first[ex + 1]; n0 += MOE_TOKEN_GROUP) {
        const int64_t left = j->first[ex + 1] - n0, cnt = left < MOE_TOKEN_GROUP ? left : MOE_TOKEN_GROUP;
        col_xq_row xr[MOE_TOKEN_GROUP];
        for (int64_t i = 0; i < cnt; i++) xr[i] = col_xq_view(j->xq + (size_t)j->asg_in[n0 + i] * j->xq_d, nb_d);
        float g[MOE_TOKEN_GROUP * MOE_ROW_TILE], u[MOE_TOKEN_GROUP * MOE_ROW_TILE]; /* (cnt, r1 - r0) */
        col_rows_times_xq(j->k, j->type, j->gate[ex], j->rb_dim, r0, r1, xr, cnt, nb_d, g, MOE_ROW_TILE);
        col_rows_times_xq(j->k, j->type, j->up[ex], j->rb_dim, r0, r1, xr, cnt, nb_d, u, MOE_ROW_TILE);
        for (int64_t i = 0; i < cnt; i++)
            activate(j, ex, r0, g + i * MOE_ROW_TILE, u + i * MOE_ROW_TILE, j->h + (n0 + i) * F + r0, r1 - r0);
    }
}

/* out[t, d0:d1] += w_n * down_ex h[n] for the assignments n of expert ex (integer path). */
static void down_xq(const moe_job *j, int64_t ex, int64_t d0, int64_t d1) {
    const int64_t nb_f = j->ffn / COL_QK_X, D = j->dim;
    for (int64_t n0 = j->first[ex]; n0 < j->first[ex + 1]; n0 += MOE_TOKEN_GROUP) {
        const int64_t left = j->first[ex + 1] - n0, cnt = left < MOE_TOKEN_GROUP ? left : MOE_TOKEN_GROUP;
        col_xq_row hr[MOE_TOKEN_GROUP];
        for (int64_t i = 0; i < cnt; i++) hr[i] = col_xq_view(j->hq + (size_t)(n0 + i) * j->xq_f, nb_f);
        float y[MOE_TOKEN_GROUP * MOE_ROW_TILE]; /* (cnt, d1 - d0) */
        col_rows_times_xq(j->k, j->type, j->down[ex], j->rb_ffn, d0, d1, hr, cnt, nb_f, y, MOE_ROW_TILE);
        for (int64_t i = 0; i < cnt; i++) {
            float *ot = j->out + (int64_t)j->asg_tok[n0 + i] * D; /* (D) */
            const float wn = j->asg_w[n0 + i];
            if (j->kind && j->kind->down_bias)
                for (int64_t d = d0; d < d1; d++) ot[d] += wn * (y[i * MOE_ROW_TILE + d - d0] + down_bias(j, ex, d));
            else
                for (int64_t d = d0; d < d1; d++) ot[d] += wn * y[i * MOE_ROW_TILE + d - d0];
        }
    }
}

static void moe_task(void *arg, int ith, int nth) {
    moe_job *j = arg;
    const int64_t D = j->dim, F = j->ffn;
    const int64_t n_asg = j->first[j->n_experts];
    int64_t b, e;

    if (j->integer) { /* 0. quantize x */
        col_split(j->n_x, ith, nth, &b, &e);
        for (int64_t t = b; t < e; t++) col_quantize_x(j->type, j->x + t * D, D, j->xq + t * j->xq_d);
        col_barrier_wait(&j->barrier, nth);
    }

    /* 1. gate and up: items are (expert, row) pairs, numbered expert-major */
    col_split(j->n_experts * F, ith, nth, &b, &e);
    for (int64_t item = b; item < e;) {
        const int64_t ex = item / F, r0 = item % F;
        int64_t r1 = r0 + MOE_ROW_TILE;
        if (r1 > F) r1 = F;
        if (r1 > r0 + (e - item)) r1 = r0 + (e - item);
        if (j->integer) {
            gate_up_xq(j, ex, r0, r1);
        } else {
            for (int64_t n = j->first[ex]; n < j->first[ex + 1]; n++) {
                const float *xt = j->x + (int64_t)j->asg_in[n] * D; /* (D) */
                float *hn = j->h + n * F;                           /* (F) */
                if (!j->kind) {
                    for (int64_t r = r0; r < r1; r++) {
                        const float g = j->tt->vec_dot(j->gate[ex] + r * j->rb_dim, xt, D);
                        const float u = j->tt->vec_dot(j->up[ex] + r * j->rb_dim, xt, D);
                        hn[r] = silu(g) * u;
                    }
                    continue;
                }
                float g[MOE_ROW_TILE], u[MOE_ROW_TILE];
                for (int64_t r = r0; r < r1; r++) {
                    g[r - r0] = j->tt->vec_dot(j->gate[ex] + r * j->rb_dim, xt, D);
                    u[r - r0] = j->tt->vec_dot(j->up[ex] + r * j->rb_dim, xt, D);
                }
                activate(j, ex, r0, g, u, hn + r0, r1 - r0);
            }
        }
        item += r1 - r0;
    }
    col_barrier_wait(&j->barrier, nth);

    if (j->integer) { /* 2. quantize h */
        col_split(n_asg, ith, nth, &b, &e);
        for (int64_t n = b; n < e; n++) col_quantize_x(j->type, j->h + n * F, F, j->hq + n * j->xq_f);
        col_barrier_wait(&j->barrier, nth);
    }

    /* 3. down and the weighted sum, output rows split */
    col_split(D, ith, nth, &b, &e);
    for (int64_t ex = 0; ex < j->n_experts; ex++) {
        for (int64_t d0 = b; d0 < e; d0 += MOE_ROW_TILE) {
            const int64_t d1 = d0 + MOE_ROW_TILE < e ? d0 + MOE_ROW_TILE : e;
            if (j->integer) {
                down_xq(j, ex, d0, d1);
                continue;
            }
            for (int64_t n = j->first[ex]; n < j->first[ex + 1]; n++) {
                float *ot = j->out + (int64_t)j->asg_tok[n] * D; /* (D) */
                const float wn = j->asg_w[n];
                const float *hn = j->h + n * F;
                for (int64_t d = d0; d < d1; d++)
                    ot[d] += wn * (j->tt->vec_dot(j->down[ex] + d * j->rb_ffn, hn, F) + down_bias(j, ex, d));
            }
        }
    }
}

size_t col_expert_ffn_size(void) { return sizeof(col_expert_ffn); }

static int ffn_kind_valid(const col_expert_ffn *kind, int64_t n_experts) {
    if (!kind) return 1;
    if (kind->activation != COL_ACT_SWIGLU && kind->activation != COL_ACT_CLAMPED_SWIGLU &&
        kind->activation != COL_ACT_GELU_TANH)
        return 0;
    if (kind->weight_on_input != 0 && kind->weight_on_input != 1) return 0;
    if (kind->activation == COL_ACT_CLAMPED_SWIGLU &&
        (!isfinite(kind->alpha) || !isfinite(kind->limit) || !(kind->limit > 0.0f)))
        return 0;
    if (!kind->gate_bias) return !kind->up_bias && !kind->down_bias;
    if (!kind->up_bias || !kind->down_bias) return 0;
    for (int64_t ex = 0; ex < n_experts; ex++)
        if (!kind->gate_bias[ex] || !kind->up_bias[ex] || !kind->down_bias[ex]) return 0;
    return 1;
}

int col_moe_experts(col_pool *pool, int type, int64_t n_experts, const void *const *gate,
                    const void *const *up, const void *const *down, int64_t dim, int64_t ffn,
                    const float *x, int64_t n_tok, const int32_t *expert_of, const float *weight,
                    int64_t n_slots, float *out) {
    return col_moe_experts_ffn(pool, NULL, type, n_experts, gate, up, down, dim, ffn, x, n_tok, expert_of, weight,
                               n_slots, out);
}

int col_moe_experts_ffn(col_pool *pool, const col_expert_ffn *ffn_kind, int type, int64_t n_experts,
                        const void *const *gate, const void *const *up, const void *const *down, int64_t dim,
                        int64_t ffn, const float *x, int64_t n_tok, const int32_t *expert_of, const float *weight,
                        int64_t n_slots, float *out) {
    const col_type_traits *tt = col_get_type_traits(type);
    if (!tt || n_experts < 0 || dim < 0 || ffn < 0 || n_tok < 0 || n_slots < 0) return COL_EINVAL;
    const int64_t rb_dim = col_type_row_bytes(type, dim), rb_ffn = col_type_row_bytes(type, ffn);
    if (rb_dim < 0 || rb_ffn < 0) return COL_EINVAL;
    if (n_tok == 0 || n_slots == 0 || dim == 0) return COL_OK;
    if (!x || !expert_of || !weight || !out) return COL_EINVAL;
    if (n_experts > 0 && (!gate || !up || !down)) return COL_EINVAL;
    if (!ffn_kind_valid(ffn_kind, n_experts)) return COL_EINVAL;
    for (int64_t ex = 0; ex < n_experts; ex++)
        if (ffn > 0 && (!gate[ex] || !up[ex] || !down[ex])) return COL_EINVAL;
    const int64_t n_pairs = n_tok * n_slots;
    for (int64_t i = 0; i < n_pairs; i++)
        if (expert_of[i] < -1 || expert_of[i] >= n_experts) return COL_EINVAL;
    if (n_experts == 0 || ffn == 0) return COL_OK; /* nothing routed, or experts of width 0 */

    const col_kernel_set *k = col_kernels_active();
    const int integer = k->dot_xq[type] != NULL; /* q8_0 / q4_g64: D and F split into 32-blocks */
    const size_t xq_d = integer ? col_xq_bytes(dim / COL_QK_X) : 0, xq_f = integer ? col_xq_bytes(ffn / COL_QK_X) : 0;

    /* With weight_on_input the experts read N scaled rows instead of the T token rows. */
    int64_t n_asg = 0;
    for (int64_t i = 0; i < n_pairs; i++) n_asg += expert_of[i] >= 0;
    const int scale_input = ffn_kind && ffn_kind->weight_on_input;
    const int64_t n_x = scale_input ? n_asg : n_tok;

    /* scratch: first (E+1) i64 | fill (E+1) i64 | asg_tok (N) i32 | asg_in (N) i32 | asg_w (N) f32 | h (N, F)
     *          | xs (N, D) f32 with weight_on_input | xq (X rows) | hq (N rows) */
    const size_t sz_first = ((size_t)(n_experts + 1) * 8 + 63) / 64 * 64;
    const size_t sz_asg = ((size_t)n_asg * 4 + 63) / 64 * 64;
    const size_t sz_h = ((size_t)n_asg * (size_t)ffn * 4 + 63) / 64 * 64;
    const size_t sz_xs = scale_input ? ((size_t)n_asg * (size_t)dim * 4 + 63) / 64 * 64 : 0;
    const size_t sz_xq = xq_d * (size_t)n_x, sz_hq = xq_f * (size_t)n_asg;
    uint8_t *scratch = col_alloc(2 * sz_first + 3 * sz_asg + sz_h + sz_xs + sz_xq + sz_hq);
    if (!scratch) return COL_ENOMEM;
    int64_t *first = (int64_t *)scratch;
    int64_t *fill = (int64_t *)(scratch + sz_first); /* next free slot per expert */
    uint8_t *rest = scratch + 2 * sz_first;
    int32_t *asg_tok = (int32_t *)rest;
    int32_t *asg_in = (int32_t *)(rest + sz_asg);
    float *asg_w = (float *)(rest + 2 * sz_asg);
    float *h = (float *)(rest + 3 * sz_asg);
    float *xs = (float *)(rest + 3 * sz_asg + sz_h);
    uint8_t *xq = rest + 3 * sz_asg + sz_h + sz_xs;
    uint8_t *hq = xq + sz_xq;

    /* counting sort of the assignments by expert, token order kept within an expert */
    memset(first, 0, (size_t)(n_experts + 1) * 8);
    for (int64_t i = 0; i < n_pairs; i++)
        if (expert_of[i] >= 0) first[expert_of[i] + 1]++;
    for (int64_t ex = 0; ex < n_experts; ex++) first[ex + 1] += first[ex];
    for (int64_t ex = 0; ex < n_experts; ex++) fill[ex] = first[ex];
    for (int64_t i = 0; i < n_pairs; i++) {
        const int32_t ex = expert_of[i];
        if (ex < 0) continue;
        const int64_t n = fill[ex]++;
        asg_tok[n] = (int32_t)(i / n_slots);
        asg_in[n] = asg_tok[n];
        asg_w[n] = weight[i];
    }
    if (scale_input) /* row n = w_n * x[t_n], one float32 product per element (transformers' order) */
        for (int64_t n = 0; n < n_asg; n++) {
            const float *xt = x + (int64_t)asg_tok[n] * dim;
            for (int64_t d = 0; d < dim; d++) xs[n * dim + d] = asg_w[n] * xt[d];
            asg_in[n] = (int32_t)n;
            asg_w[n] = 1.0f;
        }

    moe_job job = {.tt = tt, .k = k, .silu_mul = k->silu_mul ? k->silu_mul : col_silu_mul_portable, .kind = ffn_kind,
                   .type = type, .integer = integer, .n_experts = n_experts, .dim = dim, .ffn = ffn,
                   .gate = (const uint8_t *const *)gate, .up = (const uint8_t *const *)up,
                   .down = (const uint8_t *const *)down, .rb_dim = rb_dim, .rb_ffn = rb_ffn,
                   .x = scale_input ? xs : x, .n_x = n_x, .first = first, .asg_tok = asg_tok, .asg_in = asg_in,
                   .asg_w = asg_w, .xq = xq, .xq_d = xq_d, .h = h, .hq = hq, .xq_f = xq_f, .out = out};
    col_pool_run(pool, moe_task, &job);
    col_free(scratch);
    return COL_OK;
}

/* Routing (col_moe_route) lives in route.c. */
