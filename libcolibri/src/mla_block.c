/*
 * mla_block.c — a decoder layer's multi-head latent attention step (DeepSeek-V2/V3, Kimi K2)
 * in one call and one pool job, over a cache of compressed latents instead of keys/values.
 *
 * Legend: T new tokens, D hidden, H heads, Cq q rank (0: no low-rank q), C kv rank (latent),
 * N nope dims, R rope dims, Vd value dims per head, L = C + R cache floats per token,
 * QH = H * (N + R), S = n_past + T keys.
 *
 * Per token, with h = rms_norm(x) * norm:
 *   q      = Cq ? (rms_norm(h wq_a^T) * q_a_norm) wq_b^T : h wq^T           (H, N + R)
 *   kv     = h wkv_a^T                                                      (C + R)
 *   cache[n_past + t] = [rms_norm(kv[:C]) * kv_a_norm, rope(kv[C:])]        (L)
 * and per head, splitting wkv_b's rows of head j into Wk_j (N, C) and Wv_j (Vd, C):
 *   q_lat  = Wk_j^T q_nope_j                                                (C)
 *   score_s = scale * (q_lat . cache_s[:C] + rope(q_rope_j) . cache_s[C:])
 *   o_lat  = sum_s softmax(score)_s cache_s[:C]                             (C)
 *   a_j    = Wv_j o_lat                                                     (Vd)
 *   x     += a wo^T + bo
 * This is the absorbed form: the per-head keys Wk_j latent_s and values Wv_j latent_s are
 * never built, their products are folded into the query (q_lat) and the output (a_j). It is
 * the same attention as the expanded one (q_nope . Wk latent = (Wk^T q_nope) . latent) with
 * the sums taken in another order.
 *
 * Prefill uses the absorbed form as well. Expanding the keys and values of a T-token prompt
 * costs the same products as absorbing T queries (T * H * (N + Vd) * C multiply-adds both
 * ways) and then makes each (query, key, head) cheaper (N + R + Vd instead of 2C + R), so an
 * expanded prefill would be faster for long prompts; but then a prompt and the same tokens
 * fed one at a time would give different numbers, and every path of the engine computes
 * each query row on its own so that they do not (see layers.linear).
 *
 * Phases, with a barrier between each two:
 *   0. h[t] = rms_norm(x[t]) * norm, quantized for the input type          tokens split
 *   1. [q_a or q ; kv][t] = h[t] @ [wq_a or wq ; wkv_a]^T                  rows split
 *   2. kv: latent norm, rope, cache store; q_a: norm (and quantize)          tokens split
 *   3. q[t] = q_a[t] @ wq_b^T (only with Cq > 0)                            rows split
 *   4. a[t, head] = absorbed attention over keys 0 .. n_past + t            (t, head) dealt;
 *      a prompt (T > 1) deals heads instead, so that each head's key rows Wk_j are
 *      dequantized once for all T tokens rather than once per token
 *   5. a[t] quantized for wo's type (integer kernels only)                  tokens split
 *   6. x[t] += a[t] @ wo^T + bo                                             D rows split
 * A (t, head) item's numbers do not depend on how many threads run nor on the other tokens
 * of the call.
 */
#include <math.h>

#include "col_internal.h"

typedef struct {
    const col_kernel_set *k;
    const col_mla_layer *l;
    col_dequantize_row_fn kvb_row; /* wkv_b's key rows to float, one at a time (the level's dequantizer) */
    col_matrix m_in, m_kv, m_qb, m_o, m_kvb; /* m_kvb: wkv_b, whose value rows meet o_lat as a product */
    size_t olq_bytes;         /* o_lat quantized for wkv_b's type (integer kernels only; else 0) */
    int64_t n_tok, n_past, QH, L, rows_in; /* rows_in: rows of wq_a (Cq) or wq (QH) */
    float *x;                 /* (T, D) */
    const float *cos, *sin;   /* (T, R) */
    float *cache;             /* (>= S, L) */
    float *h;                 /* (T, D) normed input */
    uint8_t *hq;              /* (T, hq_bytes) */
    size_t hq_bytes;
    float *qa;                /* (T, Cq) q's low-rank activation */
    uint8_t *qaq;             /* (T, qaq_bytes) */
    size_t qaq_bytes;
    float *q;                 /* (T, QH) */
    float *kv;                /* (T, L) kv_a output before norm and rope */
    float *a;                 /* (T, H * Vd) attention output */
    uint8_t *aq;              /* (T, aq_bytes) */
    size_t aq_bytes;
    float *o;                 /* (T, D) a @ wo^T */
    float *scratch;           /* (nth, per_thread) scores (S) | rope (R) | q_lat (C) | o_lat (C) | row (C)
                                 | Wk_j dequantized (N, C), T > 1 only, at wk_off
                                 | o_lat quantized (olq_bytes, 64-byte aligned) */
    int64_t wk_off;           /* floats from a thread's scratch to its Wk_j buffer */
    int64_t per_thread;
    col_barrier barrier;
} mla_job;

/* DeepSeek stores each rope part as interleaved pairs (x0, x1), (x2, x3) ...; rotating pair
 * i by frequency i is rotate-half on the evens followed by the odds, which is what
 * transformers' interleaved rotary returns. */
static void rope_part(const mla_job *j, float *v, const float *c, const float *s, float *tmp) {
    const int64_t R = j->l->rope_dim;
    if (j->l->rope_interleaved) {
        for (int64_t i = 0; i < R / 2; i++) {
            tmp[i] = v[2 * i];
            tmp[i + R / 2] = v[2 * i + 1];
        }
        memcpy(v, tmp, (size_t)R * sizeof(float));
    }
    col_rope_heads(v, 1, R, R, c, s);
}

/* Rows [b, e) of the stacked input product: rows_in rows of wq_a / wq, then C + R of wkv_a. */
static void input_rows(const mla_job *j, int64_t b, int64_t e) {
    const int64_t n1 = j->rows_in, n2 = j->L;
    float *y1 = j->l->q_rank > 0 ? j->qa : j->q;
    const int64_t s1 = j->l->q_rank > 0 ? j->l->q_rank : j->QH;
    if (b < n1) {
        const int64_t r1 = e < n1 ? e : n1;
        col_matrix_rows(j->k, &j->m_in, b, r1, j->h, j->hq, j->hq_bytes, j->n_tok, y1 + b, s1);
    }
    if (e > n1) {
        const int64_t r0 = b > n1 ? b - n1 : 0, r1 = e - n1 < n2 ? e - n1 : n2;
        col_matrix_rows(j->k, &j->m_kv, r0, r1, j->h, j->hq, j->hq_bytes, j->n_tok, j->kv + r0, n2);
    }
}

/* Phase 2 for token t. */
static void finish_latent(const mla_job *j, int64_t t, float *tmp) {
    const col_mla_layer *l = j->l;
    const int64_t C = l->kv_rank, R = l->rope_dim;
    const float *kv = j->kv + t * j->L;
    float *row = j->cache + (j->n_past + t) * j->L; /* (L) */
    col_rms_norm(kv, l->kv_a_norm, 1, C, l->eps, row);
    memcpy(row + C, kv + C, (size_t)R * sizeof(float));
    rope_part(j, row + C, j->cos + t * R, j->sin + t * R, tmp);
    if (l->q_rank > 0) {
        float *qa = j->qa + t * l->q_rank;
        col_rms_norm(qa, l->q_a_norm, 1, l->q_rank, l->eps, qa);
        if (j->m_qb.integer) col_quantize_x(j->m_qb.type, qa, l->q_rank, j->qaq + (size_t)t * j->qaq_bytes);
    }
}

/* Phase 4 for one query head: the absorbed attention of token t, head `head`. wk_f: the head's
 * key rows already dequantized (N, C), or NULL to dequantize them one at a time here; the
 * same numbers either way. */
static void attend_latent(const mla_job *j, int64_t t, int64_t head, float *th, const float *wk_f) {
    const col_kernel_set *k = j->k;
    const col_mla_layer *l = j->l;
    const int64_t C = l->kv_rank, R = l->rope_dim, N = l->nope_dim, Vd = l->v_dim, L = j->L;
    const int64_t pos = j->n_past + t;
    float *sc = th, *pe = sc + (j->n_past + j->n_tok), *q_lat = pe + R, *o_lat = q_lat + C, *row = o_lat + C;
    const float *qh = j->q + t * j->QH + head * (N + R); /* (N + R) */
    const int64_t kvb_row_bytes = col_type_row_bytes(l->kvb_type, C);
    const uint8_t *wk = (const uint8_t *)l->wkv_b + (size_t)(head * (N + Vd)) * (size_t)kvb_row_bytes; /* (N, C) */

    memcpy(pe, qh + N, (size_t)R * sizeof(float));
    rope_part(j, pe, j->cos + t * R, j->sin + t * R, row);
    for (int64_t c = 0; c < C; c++) q_lat[c] = 0.0f;
    for (int64_t n = 0; n < N; n++) { /* q_lat = Wk^T q_nope, row by row of Wk */
        const float *wk_n = wk_f ? wk_f + n * C : row; /* (C) */
        if (!wk_f) j->kvb_row(wk + (size_t)n * (size_t)kvb_row_bytes, row, C);
        k->axpy_f32(q_lat, qh[n], wk_n, C);
    }

    float mx = -INFINITY;
    for (int64_t s = 0; s <= pos; s++) {
        const float *cs = j->cache + s * L;
        sc[s] = (k->dot_f32(q_lat, cs, C) + k->dot_f32(pe, cs + C, R)) * l->scale;
        if (sc[s] > mx) mx = sc[s];
    }
    float sum = 0.0f;
    for (int64_t s = 0; s <= pos; s++) {
        sc[s] = expf(sc[s] - mx);
        sum += sc[s];
    }
    const float inv = 1.0f / sum;
    for (int64_t c = 0; c < C; c++) o_lat[c] = 0.0f;
    for (int64_t s = 0; s <= pos; s++) k->axpy_f32(o_lat, sc[s] * inv, j->cache + s * L, C);

    /* (Vd) = Wv o_lat: an ordinary product of Vd weight rows with one activation row, so
     * the level's matrix kernels (o_lat quantized to int8 once, as every other product's
     * activations) instead of dequantizing Vd x C weights per token and head */
    float *out = j->a + t * l->n_heads * Vd + head * Vd;
    uint8_t *olq = (uint8_t *)(th + j->per_thread) - j->olq_bytes; /* the end of this thread's scratch */
    if (j->m_kvb.integer) col_quantize_x(j->m_kvb.type, o_lat, C, olq);
    const int64_t v0 = head * (N + Vd) + N; /* Wv_j's first row in wkv_b */
    col_matrix_rows(k, &j->m_kvb, v0, v0 + Vd, o_lat, olq, j->olq_bytes, 1, out, Vd);
}

/* Head `head`'s N key rows of wkv_b to float: wk_f (N, C). */
static void dequantize_keys(const mla_job *j, int64_t head, float *wk_f) {
    const int64_t C = j->l->kv_rank, N = j->l->nope_dim;
    const int64_t row_bytes = col_type_row_bytes(j->l->kvb_type, C);
    const uint8_t *wk = (const uint8_t *)j->l->wkv_b + (size_t)(head * (N + j->l->v_dim)) * (size_t)row_bytes;
    for (int64_t n = 0; n < N; n++) j->kvb_row(wk + (size_t)n * (size_t)row_bytes, wk_f + n * C, C);
}

static void mla_task(void *arg, int ith, int nth) {
    mla_job *j = arg;
    const col_mla_layer *l = j->l;
    const int64_t T = j->n_tok, D = l->dim, H = l->n_heads, AV = l->n_heads * l->v_dim;
    float *th = j->scratch + ith * j->per_thread;
    int64_t b, e;

    col_input_norm_phase(&j->m_in, &j->barrier, ith, nth, T, D, j->x, l->norm, l->eps, j->h, j->hq, j->hq_bytes); /* 0. */

    col_split(j->rows_in + j->L, ith, nth, &b, &e); /* 1. q_a (or q) and kv_a */
    if (b < e) input_rows(j, b, e);
    col_barrier_wait(&j->barrier, nth);

    col_split(T, ith, nth, &b, &e); /* 2. latents into the cache, q_a norm */
    for (int64_t t = b; t < e; t++) finish_latent(j, t, th);
    col_barrier_wait(&j->barrier, nth);

    if (l->q_rank > 0) { /* 3. q = q_a wq_b^T */
        col_split(j->QH, ith, nth, &b, &e);
        if (b < e) col_matrix_rows(j->k, &j->m_qb, b, e, j->qa, j->qaq, j->qaq_bytes, T, j->q + b, j->QH);
        col_barrier_wait(&j->barrier, nth);
    }

    if (T == 1) { /* 4. attention, round-robin as col_attention */
        for (int64_t head = ith; head < H; head += nth) attend_latent(j, 0, head, th, NULL);
    } else {
        float *wk_f = th + j->wk_off; /* (N, C) */
        for (int64_t head = ith; head < H; head += nth) {
            dequantize_keys(j, head, wk_f);
            for (int64_t t = 0; t < T; t++) attend_latent(j, t, head, th, wk_f);
        }
    }
    col_barrier_wait(&j->barrier, nth);

    /* 5. quantize a, 6. output product and residual */
    col_attention_output(j->k, &j->m_o, &j->barrier, ith, nth, T, D, AV, j->a, j->aq, j->aq_bytes, j->o, j->x, l->bo);
}

size_t col_mla_layer_size(void) { return sizeof(col_mla_layer); }

static int mla_layer_valid(const col_mla_layer *l) {
    if (l->dim <= 0 || l->n_heads <= 0 || l->q_rank < 0 || l->kv_rank <= 0 || l->nope_dim < 0 || l->rope_dim <= 0 ||
        l->rope_dim % 2 != 0 || l->v_dim <= 0)
        return 0;
    if (!l->norm || !l->wkv_a || !l->kv_a_norm || !l->wkv_b || !l->wo) return 0;
    if (l->q_rank > 0 ? (!l->wq_a || !l->q_a_norm || !l->wq_b) : !l->wq) return 0;
    return col_get_type_traits(l->kvb_type) != NULL && col_type_row_bytes(l->kvb_type, l->kv_rank) > 0;
}

int col_mla_block(col_pool *pool, const col_mla_layer *layer, float *x, int64_t n_tok, const float *cos,
                  const float *sin, float *cache, int64_t n_past) {
    if (!layer || !mla_layer_valid(layer) || n_tok < 0 || n_past < 0) return COL_EINVAL;
    if (n_tok == 0) return COL_OK;
    if (!x || !cos || !sin || !cache) return COL_EINVAL;
    const col_mla_layer *l = layer;
    mla_job job = {0};
    job.k = col_kernels_active();
    job.l = l;
    job.kvb_row = col_dequantize_row_active(l->kvb_type);
    job.QH = l->n_heads * (l->nope_dim + l->rope_dim);
    job.L = l->kv_rank + l->rope_dim;
    job.rows_in = l->q_rank > 0 ? l->q_rank : job.QH;
    const int64_t AV = l->n_heads * l->v_dim;
    if (col_matrix_init(&job.m_in, job.k, l->in_type, l->q_rank > 0 ? l->wq_a : l->wq, l->dim) != COL_OK ||
        col_matrix_init(&job.m_kv, job.k, l->in_type, l->wkv_a, l->dim) != COL_OK ||
        col_matrix_init(&job.m_o, job.k, l->o_type, l->wo, AV) != COL_OK)
        return COL_EINVAL;
    if (l->q_rank > 0 && col_matrix_init(&job.m_qb, job.k, l->qb_type, l->wq_b, l->q_rank) != COL_OK) return COL_EINVAL;
    if (col_matrix_init(&job.m_kvb, job.k, l->kvb_type, l->wkv_b, l->kv_rank) != COL_OK) return COL_EINVAL;
    job.olq_bytes = job.m_kvb.integer ? col_xq_bytes(l->kv_rank / COL_QK_X) : 0;
    job.n_tok = n_tok;
    job.n_past = n_past;
    job.x = x;
    job.cos = cos;
    job.sin = sin;
    job.cache = cache;

    const int nth = col_pool_n_threads(pool);
    const size_t T = (size_t)n_tok, S = (size_t)(n_past + n_tok);
    const size_t Cq = (size_t)l->q_rank, C = (size_t)l->kv_rank;
#define F32_BYTES(n) (((n) * sizeof(float) + 63) / 64 * 64)
    const size_t wk_bytes = T > 1 ? F32_BYTES((size_t)l->nope_dim * C) : 0; /* a prompt's Wk_j buffer */
    job.wk_off = (int64_t)(F32_BYTES(S + (size_t)l->rope_dim + 3 * C) / sizeof(float));
    job.per_thread = job.wk_off + (int64_t)((wk_bytes + job.olq_bytes) / sizeof(float));
    const size_t sz_h = F32_BYTES(T * (size_t)l->dim), sz_qa = F32_BYTES(T * Cq), sz_q = F32_BYTES(T * (size_t)job.QH);
    const size_t sz_kv = F32_BYTES(T * (size_t)job.L), sz_a = F32_BYTES(T * (size_t)AV);
    const size_t sz_scratch = (size_t)nth * (size_t)job.per_thread * sizeof(float);
#undef F32_BYTES
    job.hq_bytes = job.m_in.integer ? col_xq_bytes(l->dim / COL_QK_X) : 0;
    job.qaq_bytes = l->q_rank > 0 && job.m_qb.integer ? col_xq_bytes(l->q_rank / COL_QK_X) : 0;
    job.aq_bytes = job.m_o.integer ? col_xq_bytes(AV / COL_QK_X) : 0;
    const size_t floats = 2 * sz_h + sz_qa + sz_q + sz_kv + sz_a + sz_scratch;
    uint8_t *mem = col_alloc(floats + T * (job.hq_bytes + job.qaq_bytes + job.aq_bytes));
    if (!mem) return COL_ENOMEM;
    uint8_t *p = mem;
    job.h = (float *)p, p += sz_h;
    job.o = (float *)p, p += sz_h;
    job.qa = (float *)p, p += sz_qa;
    job.q = (float *)p, p += sz_q;
    job.kv = (float *)p, p += sz_kv;
    job.a = (float *)p, p += sz_a;
    job.scratch = (float *)p, p += sz_scratch;
    job.hq = p, p += T * job.hq_bytes;
    job.qaq = p, p += T * job.qaq_bytes;
    job.aq = p;
    col_pool_run(pool, mla_task, &job);
    col_free(mem);
    return COL_OK;
}
