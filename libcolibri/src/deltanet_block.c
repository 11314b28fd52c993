/*
 * deltanet_block.c — a Gated DeltaNet layer step (the linear-attention layers of Qwen3.5-MoE
 * and Qwen3-Next) in one call and one pool job. Instead of a KV cache a sequence keeps two
 * fixed-size states per layer: the last Kc - 1 pre-conv rows (conv_state) and one (Dk, Dv)
 * matrix S per value head (recurrent_state).
 *
 * Legend: T new tokens, D hidden, Hk q/k heads, Hv value heads, Dk, Dv their head dims, Kc
 * conv taps, C = 2 Hk Dk + Hv Dv conv channels (q heads | k heads | v heads), Z = Hv Dv,
 * R = C + Z + 2 Hv rows of the stacked input product (qkv | z | b | a), L <= 64 tokens of a
 * chunk, S the (Dk, Dv) state of one value head.
 *
 * Phases, with a barrier between each two:
 *   0. h[t] = rms_norm(x[t]) * norm, quantized for the input type          tokens split
 *   1. [qkv | z | b | a][t] = h[t] @ [wqkv; wz; wb; wa]^T                  R rows split
 *   2. causal depthwise conv + SiLU over the T tokens after conv_state,
 *      conv_state updated                                                  channels split
 *   3. per value head: q, k l2-normalised, beta, g, the delta rule over the T tokens from S
 *      (T == 1: the recurrent step; else the chunked form), then each token's gated
 *      RMSNorm, o = rms_norm(o) * gate_norm * silu(z)                      value heads dealt
 *   4. o quantized for wo's type, x[t] += o[t] @ wo^T                       (col_attention_output)
 * Every (channel, token) of phase 2 and every head of phase 3 is computed by one thread in a
 * fixed order, so the thread count never changes a bit of the result.
 *
 * The recurrent step of one head (transformers' torch_recurrent_gated_delta_rule, regrouped):
 *   e = exp(g);  u = S^T k,  w = S^T q                     (S read once for both)
 *   delta = beta (v - e u);  o = e w + (q . k) delta        (q^T of the updated S)
 *   S = e S + k delta^T                                     (S written once)
 *
 * The chunked form (transformers' torch_chunk_gated_delta_rule, the DeltaNet paper's UT
 * transform). For a chunk of L tokens with in-chunk cumulative log decay c_i = g_0 + .. + g_i:
 *   A[i][j] = beta_i (k_i . k_j) exp(c_i - c_j)                     (j < i)
 *   (I + A) U = diag(beta) V,  (I + A) W = diag(beta exp(c)) K      forward substitution
 *   V' = U - W S                                                    the new values
 *   o_i = exp(c_i) q_i S + sum_{j <= i} (q_i . k_j) exp(c_i - c_j) V'_j
 *   S <- exp(c_{L-1}) S + sum_i exp(c_{L-1} - c_i) k_i V'_i^T
 * It is the recurrence with its sums regrouped so that the work is (L, Dk) x (Dk, Dv) and
 * (L, L) x (L, Dv) products (col_gemm_f32) instead of 3 L passes over S: the same function,
 * other float rounding, so a prompt in one call and token by token agree within float
 * tolerance, not bit for bit.
 */
#include <math.h>

#include "col_internal.h"

#define DELTA_CHUNK 64              /* tokens per chunk, transformers' chunk_size */
#define L2NORM_EPS 1e-6f            /* transformers' l2norm (and FLA's) epsilon */

typedef struct {
    const col_kernel_set *k;
    const col_deltanet_layer *l;
    col_gemm_f32_fn gemm;
    col_matrix m_qkv, m_z, m_b, m_a, m_o;
    int64_t n_tok, C, Z, R, Lc;     /* Lc: rows of the per-thread arrays, the longest chunk
                                       (min(T, DELTA_CHUNK)) and at least 2 (the recurrent
                                       step keeps k and q in two rows of q) */
    float *x;                       /* (T, D) */
    float *conv_state;              /* (Kc - 1, C) */
    float *state;                   /* (Hv, Dk, Dv) */
    float *h;                       /* (T, D) normed input */
    uint8_t *hq;                    /* (T, hq_bytes) */
    size_t hq_bytes;
    float *proj;                    /* (T, R) qkv | z | b | a before the conv */
    float *conv_out;                /* (T, C) after the conv and SiLU */
    float *taps;                    /* (Kc, C) the conv taps transposed */
    float *ones;                    /* (C) 1.0f: silu(v) = silu_mul(v, 1) */
    float *a;                       /* (T, Z) the heads' gated outputs */
    uint8_t *aq;                    /* (T, aq_bytes) */
    size_t aq_bytes;
    float *o;                       /* (T, D) a @ wo^T */
    float *scratch;                 /* (nth, per_thread) see head_scratch */
    int64_t per_thread;
    col_barrier barrier;
} delta_job;

/* One thread's working set for a head's chunk (floats, each array 64-byte aligned). */
typedef struct {
    float *q;      /* (Lc, Dk) q * Dk^-0.5, then * exp(c_i) */
    float *kk;     /* (Lc, Dk) k */
    float *kt;     /* (Dk, Lc) k transposed */
    float *w;      /* (Lc, Dk) -W */
    float *u;      /* (Lc, Dv) beta v, then U, then V' */
    float *na;     /* (Lc, Lc) -A (strictly lower) */
    float *p;      /* (Lc, Lc) (q_i . k_j) exp(c_i - c_j), j <= i */
    float *kdt;    /* (Dk, Lc) k_i exp(c_{L-1} - c_i), transposed */
    float *beta, *g, *cum; /* (Lc) */
    float *tmp;    /* (2, max(Dk, Dv)) */
} head_scratch;

static int64_t floats64(int64_t n) { return (n + 15) / 16 * 16; }

static int64_t head_scratch_floats(const col_deltanet_layer *l, int64_t Lc) {
    const int64_t Dk = l->k_head_dim, Dv = l->v_head_dim, wide = Dk > Dv ? Dk : Dv;
    return 5 * floats64(Lc * Dk) + floats64(Lc * Dv) + 2 * floats64(Lc * Lc) + 3 * floats64(Lc) + floats64(2 * wide);
}

static head_scratch head_scratch_at(const col_deltanet_layer *l, int64_t Lc, float *base) {
    const int64_t Dk = l->k_head_dim, Dv = l->v_head_dim, wide = Dk > Dv ? Dk : Dv;
    head_scratch s;
    float *p = base;
    s.q = p, p += floats64(Lc * Dk);
    s.kk = p, p += floats64(Lc * Dk);
    s.kt = p, p += floats64(Lc * Dk);
    s.w = p, p += floats64(Lc * Dk);
    s.kdt = p, p += floats64(Lc * Dk);
    s.u = p, p += floats64(Lc * Dv);
    s.na = p, p += floats64(Lc * Lc);
    s.p = p, p += floats64(Lc * Lc);
    s.beta = p, p += floats64(Lc);
    s.g = p, p += floats64(Lc);
    s.cum = p, p += floats64(Lc);
    s.tmp = p, p += floats64(2 * wide);
    return s;
}

static inline float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

/* torch's softplus (beta 1, threshold 20): log(1 + exp(v)), v itself above 20. */
static inline float softplusf(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* dst = src * scale / sqrt(sum src^2 + 1e-6): transformers' l2norm, the sum in double. */
static void l2norm_scaled(const float *src, int64_t n, float scale, float *dst) {
    double sum_sq = 0.0;
    for (int64_t i = 0; i < n; i++) sum_sq += (double)src[i] * (double)src[i];
    const float inv = 1.0f / sqrtf((float)sum_sq + L2NORM_EPS);
    for (int64_t i = 0; i < n; i++) dst[i] = src[i] * inv * scale;
}

/* Rows [b, e) of the stacked product, the part that falls in matrix m (stack rows
 * [m0, m0 + rows)). */
static void input_rows(const delta_job *j, const col_matrix *m, int64_t m0, int64_t rows, int64_t b, int64_t e) {
    const int64_t r0 = b > m0 ? b - m0 : 0, r1 = e < m0 + rows ? e - m0 : rows;
    if (r0 < r1) col_matrix_rows(j->k, m, r0, r1, j->h, j->hq, j->hq_bytes, j->n_tok, j->proj + m0 + r0, j->R);
}

/* out[c] += tap[c] * in[c] for the channels of [c0, c1): blocks of 16 with restrict pointers,
 * which the compiler vectorizes at -O2 (a fixed trip count, no aliasing to check). */
static void tap_channels(float *restrict out, const float *restrict tap, const float *restrict in, int64_t c0,
                         int64_t c1) {
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16)
        for (int v = 0; v < 16; v++) out[c + v] += tap[c + v] * in[c + v];
    for (; c < c1; c++) out[c] += tap[c] * in[c];
}

/* Phase 2 for channels [c0, c1): out[t][c] = silu(bias[c] + sum_i conv[c][i] * in(t - (Kc - 1) + i)),
 * in(s) = proj[s][c] for s >= 0, conv_state[Kc - 1 + s][c] before; then the state keeps the
 * last Kc - 1 inputs. The taps are first transposed to (Kc, C) rows, so that each tap is one
 * pass over a token's channels. */
static void conv_channels(const delta_job *j, int64_t c0, int64_t c1) {
    const col_deltanet_layer *l = j->l;
    const int64_t T = j->n_tok, C = j->C, R = j->R, Kc = l->conv_kernel, P = Kc - 1;
    for (int64_t c = c0; c < c1; c++)
        for (int64_t i = 0; i < Kc; i++) j->taps[i * C + c] = l->conv[c * Kc + i];
    const col_silu_mul_fn silu_mul = j->k->silu_mul ? j->k->silu_mul : col_silu_mul_portable;
    for (int64_t t = 0; t < T; t++) {
        float *out = j->conv_out + t * C; /* (C) */
        for (int64_t c = c0; c < c1; c++) out[c] = l->conv_bias ? l->conv_bias[c] : 0.0f;
        for (int64_t i = 0; i < Kc; i++) {
            const int64_t s = t - P + i;
            tap_channels(out, j->taps + i * C, s >= 0 ? j->proj + s * R : j->conv_state + (P + s) * C, c0, c1);
        }
        silu_mul(out + c0, j->ones + c0, out + c0, c1 - c0); /* silu(out) * 1 */
    }
    /* row r of the new state is input s = T - P + r; rows read from the old state (s < 0)
     * are at P + s = T + r > r: not yet overwritten when going up */
    for (int64_t r = 0; r < P; r++) {
        const int64_t s = T - P + r;
        float *dst = j->conv_state + r * C;
        for (int64_t c = c0; c < c1; c++) dst[c] = s >= 0 ? j->proj[s * R + c] : j->conv_state[(P + s) * C + c];
    }
}

/* q, k (normalised), beta and g of value head `head` at token t; v's row is returned. */
static const float *head_inputs(const delta_job *j, int64_t head, int64_t t, float *q, float *kv, float *beta,
                                float *g) {
    const col_deltanet_layer *l = j->l;
    const int64_t Hk = l->n_k_heads, Hv = l->n_v_heads, Dk = l->k_head_dim, Dv = l->v_head_dim;
    const int64_t kh = head / (Hv / Hk);
    const float *row = j->conv_out + t * j->C; /* (C) q heads | k heads | v heads */
    l2norm_scaled(row + kh * Dk, Dk, 1.0f / sqrtf((float)Dk), q);
    l2norm_scaled(row + Hk * Dk + kh * Dk, Dk, 1.0f, kv);
    const float *ba = j->proj + t * j->R + j->C + j->Z; /* (2 Hv) b | a */
    *beta = sigmoidf(ba[head]);
    *g = -expf(l->A_log[head]) * softplusf(ba[Hv + head] + l->dt_bias[head]);
    return row + 2 * Hk * Dk + head * Dv;
}

/* The recurrent step of one head for token t (T == 1). */
static void head_recurrent(const delta_job *j, int64_t head, int64_t t, float *S, head_scratch *s) {
    const int64_t Dk = j->l->k_head_dim, Dv = j->l->v_head_dim;
    float *kq = s->q;                                /* (2, Dk): k then q (Lc >= 2) */
    float beta, g;
    const float *v = head_inputs(j, head, t, kq + Dk, kq, &beta, &g);
    float *uw = s->tmp, *delta = s->u;               /* (2, Dv) S^T k | S^T q;  (Dv) */
    j->gemm(uw, Dv, 0.0f, kq, Dk, S, 2, Dk, Dv);
    const float e = expf(g);
    float qk = 0.0f;
    for (int64_t i = 0; i < Dk; i++) qk += kq[Dk + i] * kq[i];
    float *o = j->a + t * j->Z + head * Dv;          /* (Dv) */
    for (int64_t c = 0; c < Dv; c++) {
        delta[c] = beta * (v[c] - e * uw[c]);
        o[c] = e * uw[Dv + c] + qk * delta[c];
    }
    j->gemm(S, Dv, e, kq, 1, delta, Dk, 1, Dv);      /* S = e S + k delta^T */
}

/* One chunk of L tokens t0 .. t0 + L - 1 of one head, from and back into S. */
static void head_chunk(const delta_job *j, int64_t head, int64_t t0, int64_t L, float *S, head_scratch *s) {
    const int64_t Dk = j->l->k_head_dim, Dv = j->l->v_head_dim, Z = j->Z;
    for (int64_t i = 0; i < L; i++) {
        const float *v = head_inputs(j, head, t0 + i, s->q + i * Dk, s->kk + i * Dk, &s->beta[i], &s->g[i]);
        for (int64_t c = 0; c < Dv; c++) s->u[i * Dv + c] = v[c] * s->beta[i];
        s->cum[i] = i ? s->cum[i - 1] + s->g[i] : s->g[i];
    }
    for (int64_t i = 0; i < L; i++)
        for (int64_t c = 0; c < Dk; c++) s->kt[c * L + i] = s->kk[i * Dk + c];
    j->gemm(s->na, L, 0.0f, s->kk, Dk, s->kt, L, Dk, L); /* k_i . k_j */
    j->gemm(s->p, L, 0.0f, s->q, Dk, s->kt, L, Dk, L);   /* q_i . k_j */
    for (int64_t i = 0; i < L; i++) {
        for (int64_t jj = 0; jj < L; jj++) {
            const float decay = jj <= i ? expf(s->cum[i] - s->cum[jj]) : 0.0f;
            s->na[i * L + jj] = jj < i ? -(s->beta[i] * s->na[i * L + jj] * decay) : 0.0f;
            s->p[i * L + jj] *= decay;
        }
        const float wi = -(s->beta[i] * expf(s->cum[i]));
        for (int64_t c = 0; c < Dk; c++) s->w[i * Dk + c] = s->kk[i * Dk + c] * wi;
    }
    for (int64_t i = 1; i < L; i++) { /* forward substitution: row i -= A[i][:i] rows[:i] */
        j->gemm(s->u + i * Dv, Dv, 1.0f, s->na + i * L, L, s->u, 1, i, Dv);
        j->gemm(s->w + i * Dk, Dk, 1.0f, s->na + i * L, L, s->w, 1, i, Dk);
    }
    j->gemm(s->u, Dv, 1.0f, s->w, Dk, S, L, Dk, Dv); /* V' = U - W S */
    for (int64_t i = 0; i < L; i++) {
        const float e = expf(s->cum[i]);
        for (int64_t c = 0; c < Dk; c++) s->q[i * Dk + c] *= e;
    }
    float *o = j->a + t0 * Z + head * Dv; /* (L, Dv) rows Z apart */
    j->gemm(o, Z, 0.0f, s->q, Dk, S, L, Dk, Dv);
    j->gemm(o, Z, 1.0f, s->p, L, s->u, L, L, Dv);
    const float last = s->cum[L - 1];
    for (int64_t i = 0; i < L; i++) {
        const float e = expf(last - s->cum[i]);
        for (int64_t c = 0; c < Dk; c++) s->kdt[c * L + i] = s->kk[i * Dk + c] * e;
    }
    j->gemm(S, Dv, expf(last), s->kdt, L, s->u, Dk, L, Dv); /* S = e S + KD^T V' */
}

/* Phase 3 for one value head: the delta rule over all T tokens, then the gated norm. */
static void head_step(const delta_job *j, int64_t head, float *scratch) {
    const col_deltanet_layer *l = j->l;
    const int64_t T = j->n_tok, Dk = l->k_head_dim, Dv = l->v_head_dim;
    float *S = j->state + head * Dk * Dv; /* (Dk, Dv) */
    if (T == 1) {
        head_scratch s = head_scratch_at(l, j->Lc, scratch);
        head_recurrent(j, head, 0, S, &s);
    } else {
        for (int64_t t0 = 0; t0 < T; t0 += DELTA_CHUNK) {
            const int64_t L = T - t0 < DELTA_CHUNK ? T - t0 : DELTA_CHUNK;
            head_scratch s = head_scratch_at(l, L, scratch);
            head_chunk(j, head, t0, L, S, &s);
        }
    }
    const col_rms_norm_row_fn norm_row = j->k->rms_norm_row ? j->k->rms_norm_row : col_rms_norm_row_portable;
    const col_silu_mul_fn silu_mul = j->k->silu_mul ? j->k->silu_mul : col_silu_mul_portable;
    for (int64_t t = 0; t < T; t++) {
        float *o = j->a + t * j->Z + head * Dv;                 /* (Dv) */
        const float *z = j->proj + t * j->R + j->C + head * Dv; /* (Dv) */
        norm_row(o, l->gate_norm, Dv, l->norm_eps, o);
        silu_mul(z, o, o, Dv); /* o = silu(z) * o */
    }
}

static void delta_task(void *arg, int ith, int nth) {
    delta_job *j = arg;
    const col_deltanet_layer *l = j->l;
    const int64_t T = j->n_tok, D = l->dim, C = j->C, Z = j->Z, Hv = l->n_v_heads;
    int64_t b, e;

    col_input_norm_phase(&j->m_qkv, &j->barrier, ith, nth, T, D, j->x, l->norm, l->eps, j->h, j->hq, j->hq_bytes); /* 0. */

    col_split(j->R, ith, nth, &b, &e); /* 1. qkv | z | b | a */
    input_rows(j, &j->m_qkv, 0, C, b, e);
    input_rows(j, &j->m_z, C, Z, b, e);
    input_rows(j, &j->m_b, C + Z, Hv, b, e);
    input_rows(j, &j->m_a, C + Z + Hv, Hv, b, e);
    col_barrier_wait(&j->barrier, nth);

    col_split(C, ith, nth, &b, &e); /* 2. conv */
    if (b < e) conv_channels(j, b, e);
    col_barrier_wait(&j->barrier, nth);

    float *scratch = j->scratch + ith * j->per_thread; /* 3. heads, round-robin */
    for (int64_t head = ith; head < Hv; head += nth) head_step(j, head, scratch);
    col_barrier_wait(&j->barrier, nth);

    /* 4. quantize the gated outputs, output product and residual */
    col_attention_output(j->k, &j->m_o, &j->barrier, ith, nth, T, D, Z, j->a, j->aq, j->aq_bytes, j->o, j->x, NULL);
}

size_t col_deltanet_layer_size(void) { return sizeof(col_deltanet_layer); }

static int deltanet_layer_valid(const col_deltanet_layer *l) {
    if (l->dim <= 0 || l->n_k_heads <= 0 || l->n_v_heads <= 0 || l->n_v_heads % l->n_k_heads != 0 ||
        l->k_head_dim <= 0 || l->v_head_dim <= 0 || l->conv_kernel <= 0)
        return 0;
    return l->norm && l->wqkv && l->wz && l->wb && l->wa && l->conv && l->A_log && l->dt_bias && l->gate_norm && l->wo;
}

static col_gemm_f32_fn gemm_of(const col_kernel_set *k) {
    const col_gemm_f32_fn simd = k->level == COL_KERNELS_NEON ? col_gemm_f32_neon() : col_gemm_f32_x86(k->level);
    return simd ? simd : col_gemm_f32_portable;
}

int col_deltanet_block(col_pool *pool, const col_deltanet_layer *layer, float *x, int64_t n_tok, float *conv_state,
                       float *recurrent_state) {
    if (!layer || !deltanet_layer_valid(layer) || n_tok < 0) return COL_EINVAL;
    if (n_tok == 0) return COL_OK;
    const col_deltanet_layer *l = layer;
    if (!x || !recurrent_state || (l->conv_kernel > 1 && !conv_state)) return COL_EINVAL;
    delta_job job = {0};
    job.k = col_kernels_active();
    job.l = l;
    job.gemm = gemm_of(job.k);
    job.C = 2 * l->n_k_heads * l->k_head_dim + l->n_v_heads * l->v_head_dim;
    job.Z = l->n_v_heads * l->v_head_dim;
    job.R = job.C + job.Z + 2 * l->n_v_heads;
    if (col_matrix_init(&job.m_qkv, job.k, l->in_type, l->wqkv, l->dim) != COL_OK ||
        col_matrix_init(&job.m_z, job.k, l->in_type, l->wz, l->dim) != COL_OK ||
        col_matrix_init(&job.m_b, job.k, l->in_type, l->wb, l->dim) != COL_OK ||
        col_matrix_init(&job.m_a, job.k, l->in_type, l->wa, l->dim) != COL_OK ||
        col_matrix_init(&job.m_o, job.k, l->o_type, l->wo, job.Z) != COL_OK)
        return COL_EINVAL;
    job.n_tok = n_tok;
    job.Lc = n_tok < 2 ? 2 : n_tok < DELTA_CHUNK ? n_tok : DELTA_CHUNK;
    job.x = x;
    job.conv_state = conv_state;
    job.state = recurrent_state;

    const int nth = col_pool_n_threads(pool);
    const size_t T = (size_t)n_tok;
#define F32_BYTES(n) (((n) * sizeof(float) + 63) / 64 * 64)
    job.per_thread = head_scratch_floats(l, job.Lc);
    const size_t sz_h = F32_BYTES(T * (size_t)l->dim), sz_proj = F32_BYTES(T * (size_t)job.R);
    const size_t sz_conv = F32_BYTES(T * (size_t)job.C), sz_a = F32_BYTES(T * (size_t)job.Z);
    const size_t sz_taps = F32_BYTES((size_t)(l->conv_kernel * job.C)), sz_ones = F32_BYTES((size_t)job.C);
    const size_t sz_scratch = (size_t)nth * (size_t)job.per_thread * sizeof(float);
#undef F32_BYTES
    job.hq_bytes = job.m_qkv.integer ? col_xq_bytes(l->dim / COL_QK_X) : 0;
    job.aq_bytes = job.m_o.integer ? col_xq_bytes(job.Z / COL_QK_X) : 0;
    uint8_t *mem = col_alloc(2 * sz_h + sz_proj + sz_conv + sz_taps + sz_ones + sz_a + sz_scratch +
                             T * (job.hq_bytes + job.aq_bytes));
    if (!mem) return COL_ENOMEM;
    uint8_t *p = mem;
    job.h = (float *)p, p += sz_h;
    job.o = (float *)p, p += sz_h;
    job.proj = (float *)p, p += sz_proj;
    job.conv_out = (float *)p, p += sz_conv;
    job.taps = (float *)p, p += sz_taps;
    job.ones = (float *)p, p += sz_ones;
    for (int64_t c = 0; c < job.C; c++) job.ones[c] = 1.0f;
    job.a = (float *)p, p += sz_a;
    job.scratch = (float *)p, p += sz_scratch;
    job.hq = p, p += T * job.hq_bytes;
    job.aq = p;
    col_pool_run(pool, delta_task, &job);
    col_free(mem);
    return COL_OK;
}
