/*
 * attention_block.c — a decoder layer's whole attention step in one call and one pool job:
 * input RMSNorm, the q/k/v products (one activation quantization, their rows split as one
 * matrix), biases, q/k norms, clamping, RoPE, the KV-cache append, attention, the output
 * product and the residual add. A decode step used to be eight calls from Python with numpy
 * glue between them; now it is one.
 *
 * Legend: T new tokens, D hidden, H query heads, K kv heads, Hd head dim, Q = H * Hd,
 * KV = K * Hd, R = Q + 2 * KV (+ Q with an output gate: rows of q, k, v (and g) stacked),
 * S = n_past + T keys.
 *
 * The T rows may belong to several sequences (col_attention_block_batch): the products run
 * once over every row, and phases 2 and 3 take each row's position and cache from its own
 * sequence, so a batch of decode steps reads the layer's weights once for all of them.
 *
 * Phases, with a barrier between each two:
 *   0. h[t] = rms_norm(x[t]) * norm, quantized for the q/k/v type          tokens split
 *   1. qkv[t] = h[t] @ [wq; wk; wv; wg]^T + [bq; bk; bv; 0]                R rows split
 *   2. q/k/v norms, clamp, RoPE, temperature; k, v stored at n_past + t    tokens split
 *   3. a[t, head] = attention over keys 0 .. n_past + t (window, chunk, sink),
 *      times sigmoid(g[t, head]) with an output gate         blocks of (t, head) dealt
 *   4. a[t] quantized for wo's type (integer kernels only)                  tokens split
 *   5. x[t] += a[t] @ wo^T + bo                                             D rows split
 *      (with a post norm: o = a @ wo^T + bo, D rows split; a barrier; then
 *      x[t] += rms_norm(o[t]) * post_norm, tokens split)
 * Each phase calls the code of the separate entry points (col_rms_norm, col_matrix_rows as in
 * col_matmul, col_rope, and col_attend_block, which col_attention's col_attend_head also
 * runs) on the same values, so this call returns bit for bit what the sequence of those calls
 * returns.
 */
#include <math.h>

#include "col_internal.h"

typedef struct {
    const col_kernel_set *k;
    const col_attention_layer *l;
    col_matrix mq, mk, mv, mo, mg; /* mg: the output gate's, when l->wg */
    int64_t n_tok, Q, KV, R;
    const col_attention_seq *seqs; /* each sequence's cache, position and rows of x */
    int64_t n_seqs;
    const int32_t *seq_of;    /* (T) the sequence of each row */
    const int64_t *first_of;  /* (N) each sequence's first row */
    float *x;                 /* (T, D) */
    const float *cos, *sin;   /* (T, Hr) Hr = rotary_dim or Hd */
    float *h;                 /* (T, D) normed input */
    uint8_t *hq;              /* (T, hq_bytes) h quantized, integer q/k/v only */
    size_t hq_bytes;
    float *qkv;               /* (T, R) q | k | v (| g) of each token */
    float *a;                 /* (T, Q) attention output */
    uint8_t *aq;              /* (T, aq_bytes) a quantized, integer wo only */
    size_t aq_bytes;
    float *o;                 /* (T, D) a @ wo^T */
    float *scores;            /* (nth, COL_ATTEND_BLOCK, scores_per_thread) rows of each thread */
    int64_t scores_per_thread; /* the most keys a query sees: S, or the ring's rows */
    col_barrier barrier;
} block_job;

/* Row t's position in its sequence */
static int64_t position_of(const block_job *j, int64_t t) {
    return j->seqs[j->seq_of[t]].n_past + t - j->first_of[j->seq_of[t]];
}

/* numpy's clip: NaN stays NaN */
static void clamp(float *v, int64_t n, float limit) {
    for (int64_t i = 0; i < n; i++) v[i] = v[i] < -limit ? -limit : (v[i] > limit ? limit : v[i]);
}

/* Rows [b, e) of the stacked q/k/v product, the part that falls in matrix m (rows
 * [m0, m0 + rows) of the stack), plus its bias. */
static void qkv_rows(const block_job *j, const col_matrix *m, const float *bias, int64_t m0, int64_t rows,
                     int64_t b, int64_t e) {
    const int64_t r0 = b > m0 ? b - m0 : 0, r1 = e < m0 + rows ? e - m0 : rows;
    if (r0 >= r1) return;
    float *y = j->qkv + m0 + r0; /* token 0, row r0 of m */
    col_matrix_rows(j->k, m, r0, r1, j->h, j->hq, j->hq_bytes, j->n_tok, y, j->R);
    if (bias)
        for (int64_t t = 0; t < j->n_tok; t++)
            for (int64_t r = r0; r < r1; r++) y[t * j->R + r - r0] += bias[r];
}

/* a *= sigmoid(g) over one head's Hd outputs (the output gate of Qwen3.5 / Qwen3-Next) */
static void gate_head(float *a, const float *g, int64_t Hd) {
    for (int64_t i = 0; i < Hd; i++) a[i] *= 1.0f / (1.0f + expf(-g[i]));
}

/* RoPE on interleaved pairs (x0, x1), (x2, x3) ... of the first Hr dims of each head, in
 * place (Llama 4's complex rotary): pair i turns by the angle of col_rope_heads' dims i and
 * i + Hr / 2, with the same products and sums, so the result is col_rope_heads' on the evens
 * followed by the odds, left in pair order. */
static void rope_pairs(float *x, int64_t n_heads, int64_t head_dim, int64_t rotary_dim, const float *c, const float *s) {
    const int64_t half = rotary_dim / 2;
    for (int64_t h = 0; h < n_heads; h++) {
        float *v = x + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[2 * i], b = v[2 * i + 1];
            v[2 * i] = a * c[i] - b * s[i];
            v[2 * i + 1] = b * c[i + half] + a * s[i + half];
        }
    }
}

/* Phase 2 for token t: the order of colibrid/engine/forward/attention.py. */
static void finish_qkv(const block_job *j, int64_t t) {
    const col_attention_layer *l = j->l;
    const int64_t H = l->n_heads, K = l->n_kv_heads, Hd = l->head_dim;
    float *q = j->qkv + t * j->R, *kt = q + j->Q, *vt = kt + j->KV; /* (Q), (KV), (KV) */
    if (l->qk_norm == COL_QK_NORM_FULL) {
        col_rms_norm(q, l->q_norm, 1, j->Q, l->eps, q);
        col_rms_norm(kt, l->k_norm, 1, j->KV, l->eps, kt);
    }
    if (l->clip_qkv > 0.0f) {
        clamp(q, j->Q, l->clip_qkv);
        clamp(kt, j->KV, l->clip_qkv);
        clamp(vt, j->KV, l->clip_qkv);
    }
    if (l->qk_norm == COL_QK_NORM_HEAD) {
        col_rms_norm(q, l->q_norm, H, Hd, l->eps, q);
        col_rms_norm(kt, l->k_norm, K, Hd, l->eps, kt);
    }
    if (l->v_norm) col_rms_norm(vt, l->v_norm, K, Hd, l->eps, vt);
    if (!l->no_rope) {
        const int64_t Hr = l->rotary_dim > 0 ? l->rotary_dim : Hd; /* rotated dims of each head */
        void (*rope)(float *, int64_t, int64_t, int64_t, const float *, const float *) =
            l->rope_interleaved ? rope_pairs : col_rope_heads;
        rope(q, H, Hd, Hr, j->cos + t * Hr, j->sin + t * Hr);
        rope(kt, K, Hd, Hr, j->cos + t * Hr, j->sin + t * Hr);
    }
    if (l->qk_norm == COL_QK_NORM_HEAD_AFTER_ROPE) {
        col_rms_norm(q, l->q_norm, H, Hd, l->eps, q);
        col_rms_norm(kt, l->k_norm, K, Hd, l->eps, kt);
    }
    if (l->temp_floor > 0.0f) { /* float32 throughout, in transformers' order */
        const float p = (float)position_of(j, t);
        const float gain = log1pf(floorf((p + 1.0f) / l->temp_floor)) * l->temp_scale + 1.0f;
        for (int64_t i = 0; i < j->Q; i++) q[i] *= gain;
    }
    const col_attention_seq *seq = j->seqs + j->seq_of[t];
    const int64_t pos = position_of(j, t);
    const int64_t row = col_cache_row(pos, seq->ring_rows);
    if (seq->kv_type == COL_TYPE_F16) { /* rounded to nearest even, as numpy's astype(float16) */
        uint16_t *kc = (uint16_t *)seq->keys + row * j->KV, *vc = (uint16_t *)seq->vals + row * j->KV;
        for (int64_t i = 0; i < j->KV; i++) {
            kc[i] = col_f32_to_f16(kt[i]);
            vc[i] = col_f32_to_f16(vt[i]);
        }
        return;
    }
    memcpy((float *)seq->keys + row * j->KV, kt, (size_t)j->KV * sizeof(float));
    memcpy((float *)seq->vals + row * j->KV, vt, (size_t)j->KV * sizeof(float));
}


/* Phase 3: items of up to COL_ATTEND_BLOCK queries that read one sequence's cache: a chunk of
 * its tokens, times the query heads of one kv head's group (or part of a large group), times
 * a run of neighbouring kv heads where that still fits: a decode token of a model with few
 * query heads per kv head (OLMoE's one) then reads a run of each key row's kv heads, which lie
 * side by side, rather than one head's few lines a row apart. The runs are at most
 * ceil(K / nth) heads long, so one sequence's token still gives every thread work. Items are
 * numbered chunk-major and dealt round-robin: a later chunk sees more keys, and neighbours in
 * the numbering are the same chunk's other heads. */
static void attend_phase(const block_job *j, int ith, int nth) {
    const col_attention_layer *l = j->l;
    const int64_t H = l->n_heads, K = l->n_kv_heads, Hd = l->head_dim, group = H / K;
    const int64_t heads_per = group < COL_ATTEND_BLOCK ? group : COL_ATTEND_BLOCK;
    const int64_t head_blocks = (group + heads_per - 1) / heads_per, tokens_per = COL_ATTEND_BLOCK / heads_per;
    const int64_t most_run = (K + nth - 1) / nth; /* kv heads an item reads at most */
    const int64_t stride = j->scores_per_thread;
    float *sc = j->scores + ith * COL_ATTEND_BLOCK * stride;
    col_attend_query q[COL_ATTEND_BLOCK];
    int64_t item = 0;
    for (int64_t i = 0; i < j->n_seqs; i++) {
        const col_attention_seq *seq = j->seqs + i;
        const int64_t chunks = (seq->n_tok + tokens_per - 1) / tokens_per;
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t t0 = j->first_of[i] + c * tokens_per;
            const int64_t t1 = t0 + tokens_per < j->first_of[i] + seq->n_tok ? t0 + tokens_per
                                                                              : j->first_of[i] + seq->n_tok;
            int64_t run = head_blocks > 1 ? 1 : COL_ATTEND_BLOCK / ((t1 - t0) * heads_per); /* kv heads an item reads */
            if (run > most_run) run = most_run;
            for (int64_t kh0 = 0; kh0 < K; kh0 += run)
                for (int64_t hb = 0; hb < head_blocks; hb++, item++) {
                    if (item % nth != ith) continue;
                    const int64_t kh1 = kh0 + run < K ? kh0 + run : K;
                    int n = 0;
                    for (int64_t kh = kh0; kh < kh1; kh++) {
                        const int64_t h0 = kh * group + hb * heads_per;
                        const int64_t h1 = h0 + heads_per < (kh + 1) * group ? h0 + heads_per : (kh + 1) * group;
                        for (int64_t t = t0; t < t1; t++) {
                            const int64_t pos = position_of(j, t);
                            const int64_t lo = col_first_visible_key(pos, l->window, l->chunk, seq->ring_rows);
                            for (int64_t head = h0; head < h1; head++, n++)
                                q[n] = (col_attend_query){j->qkv + t * j->R + head * Hd, lo, pos,
                                                          l->sinks ? l->sinks + head : NULL,
                                                          j->a + (t * H + head) * Hd, kh};
                        }
                    }
                    col_attend_block(j->k, q, n, seq->keys, seq->vals, seq->kv_type == COL_TYPE_F16, K, Hd,
                                     seq->ring_rows, l->scale, sc, stride);
                    if (!l->wg) continue;
                    for (int m = 0; m < n; m++) /* each query's gate sits Q + 2 KV values past its q */
                        gate_head(q[m].ov, q[m].qv + j->Q + 2 * j->KV, Hd);
                }
        }
    }
}

static void block_task(void *arg, int ith, int nth) {
    block_job *j = arg;
    const col_attention_layer *l = j->l;
    const int64_t T = j->n_tok, D = l->dim;
    int64_t b, e;

    col_input_norm_phase(&j->mq, &j->barrier, ith, nth, T, D, j->x, l->norm, l->eps, j->h, j->hq, j->hq_bytes); /* 0. */

    col_split(j->R, ith, nth, &b, &e); /* 1. q, k, v */
    qkv_rows(j, &j->mq, l->bq, 0, j->Q, b, e);
    qkv_rows(j, &j->mk, l->bk, j->Q, j->KV, b, e);
    qkv_rows(j, &j->mv, l->bv, j->Q + j->KV, j->KV, b, e);
    if (l->wg) qkv_rows(j, &j->mg, NULL, j->Q + 2 * j->KV, j->Q, b, e);
    col_barrier_wait(&j->barrier, nth);

    col_split(T, ith, nth, &b, &e); /* 2. norms, clamp, rope, cache */
    for (int64_t t = b; t < e; t++) finish_qkv(j, t);
    col_barrier_wait(&j->barrier, nth);

    attend_phase(j, ith, nth); /* 3. */
    col_barrier_wait(&j->barrier, nth);

    /* 4. quantize a, 5. output product and residual */
    col_attention_output_normed(j->k, &j->mo, &j->barrier, ith, nth, T, D, j->Q, j->a, j->aq, j->aq_bytes, j->o, j->x,
                                l->bo, l->post_norm, l->eps);
}

void col_input_norm_phase(const col_matrix *m, col_barrier *barrier, int ith, int nth, int64_t T, int64_t D,
                          const float *x, const float *norm, float eps, float *h, uint8_t *hq, size_t hq_bytes) {
    int64_t b, e;
    col_split(T, ith, nth, &b, &e);
    for (int64_t t = b; t < e; t++) {
        col_rms_norm(x + t * D, norm, 1, D, eps, h + t * D);
        if (m->integer) col_quantize_x(m->type, h + t * D, D, hq + (size_t)t * hq_bytes);
    }
    col_barrier_wait(barrier, nth);
}

void col_attention_output(const col_kernel_set *k, const col_matrix *mo, col_barrier *barrier, int ith, int nth,
                          int64_t T, int64_t D, int64_t A, const float *a, uint8_t *aq, size_t aq_bytes, float *o,
                          float *x, const float *bo) {
    col_attention_output_normed(k, mo, barrier, ith, nth, T, D, A, a, aq, aq_bytes, o, x, bo, NULL, 0.0f);
}

void col_attention_output_normed(const col_kernel_set *k, const col_matrix *mo, col_barrier *barrier, int ith, int nth,
                                 int64_t T, int64_t D, int64_t A, const float *a, uint8_t *aq, size_t aq_bytes,
                                 float *o, float *x, const float *bo, const float *post_norm, float eps) {
    int64_t b, e;
    if (mo->integer) {
        col_split(T, ith, nth, &b, &e);
        for (int64_t t = b; t < e; t++) col_quantize_x(mo->type, a + t * A, A, aq + (size_t)t * aq_bytes);
        col_barrier_wait(barrier, nth);
    }
    col_split(D, ith, nth, &b, &e);
    if (post_norm) { /* the norm needs each token's whole row: product first, then a barrier */
        if (b < e) col_matrix_rows(k, mo, b, e, a, aq, aq_bytes, T, o + b, D);
        for (int64_t t = 0; t < T && bo; t++)
            for (int64_t r = b; r < e; r++) o[t * D + r] += bo[r];
        col_barrier_wait(barrier, nth);
        col_split(T, ith, nth, &b, &e);
        for (int64_t t = b; t < e; t++) {
            float *xt = x + t * D, *ot = o + t * D;
            col_rms_norm(ot, post_norm, 1, D, eps, ot);
            for (int64_t r = 0; r < D; r++) xt[r] += ot[r];
        }
        return;
    }
    if (b >= e) return;
    col_matrix_rows(k, mo, b, e, a, aq, aq_bytes, T, o + b, D);
    for (int64_t t = 0; t < T; t++) {
        float *xt = x + t * D;
        const float *ot = o + t * D;
        if (bo)
            for (int64_t r = b; r < e; r++) xt[r] += ot[r] + bo[r];
        else
            for (int64_t r = b; r < e; r++) xt[r] += ot[r];
    }
}

size_t col_attention_layer_size(void) { return sizeof(col_attention_layer); }

size_t col_attention_seq_size(void) { return sizeof(col_attention_seq); }

static int layer_valid(const col_attention_layer *l) {
    if (l->dim <= 0 || l->n_heads <= 0 || l->n_kv_heads <= 0 || l->head_dim <= 0 || l->head_dim % 2 != 0 ||
        l->n_heads % l->n_kv_heads != 0)
        return 0;
    if (l->rotary_dim < 0 || l->rotary_dim % 2 != 0 || l->rotary_dim > l->head_dim) return 0;
    if (l->qk_norm < COL_QK_NORM_NONE || l->qk_norm > COL_QK_NORM_HEAD_AFTER_ROPE || l->chunk < 0) return 0;
    if (l->qk_norm != COL_QK_NORM_NONE && (!l->q_norm || !l->k_norm)) return 0;
    if (!l->norm || !l->wq || !l->wk || !l->wv || !l->wo) return 0;
    if ((l->rope_interleaved != 0 && l->rope_interleaved != 1) || (l->no_rope != 0 && l->no_rope != 1)) return 0;
    if (!isfinite(l->temp_floor) || l->temp_floor < 0.0f || !isfinite(l->temp_scale)) return 0;
    return 1;
}

/* A ring must still hold, after the n_tok new keys are written, every key the first new token
 * sees: span - 1 keys before it, span the window or chunk (the tighter when both are set). */
static int ring_valid(const col_attention_layer *l, int64_t n_tok, int64_t ring_rows) {
    if (ring_rows == 0) return 1;
    int64_t span = l->window > 0 ? l->window : 0;
    if (l->chunk > 0 && (span == 0 || l->chunk < span)) span = l->chunk;
    return ring_rows > 0 && span > 0 && ring_rows >= span + n_tok - 1;
}

int col_attention_block(col_pool *pool, const col_attention_layer *layer, float *x, int64_t n_tok,
                        const float *cos, const float *sin, float *keys, float *vals, int64_t n_past,
                        int64_t ring_rows) {
    const col_attention_seq seq = {keys, vals, n_past, n_tok, ring_rows, COL_TYPE_F32, 0};
    return col_attention_block_batch(pool, layer, x, cos, sin, &seq, 1);
}

int col_attention_block_batch(col_pool *pool, const col_attention_layer *layer, float *x, const float *cos,
                              const float *sin, const col_attention_seq *seqs, int64_t n_seqs) {
    if (!layer || !layer_valid(layer) || n_seqs < 0 || (n_seqs > 0 && !seqs) || n_seqs > INT32_MAX) return COL_EINVAL;
    int64_t n_tok = 0, most_keys = 0; /* rows in all; the most keys one query sees */
    for (int64_t i = 0; i < n_seqs; i++) {
        const col_attention_seq *q = seqs + i;
        if (q->n_tok < 0 || q->n_past < 0 || !ring_valid(layer, q->n_tok, q->ring_rows)) return COL_EINVAL;
        if (q->n_tok > 0 && (!q->keys || !q->vals)) return COL_EINVAL;
        if (q->kv_type != COL_TYPE_F32 && (q->kv_type != COL_TYPE_F16 || layer->head_dim > COL_ATTEND_MAX_HEAD_DIM))
            return COL_EINVAL;
        const int64_t keys_seen = q->ring_rows > 0 ? q->ring_rows : q->n_past + q->n_tok;
        if (keys_seen > most_keys) most_keys = keys_seen;
        n_tok += q->n_tok;
    }
    if (n_tok == 0) return COL_OK;
    if (!x || !cos || !sin) return COL_EINVAL;
    const col_attention_layer *l = layer;
    block_job job = {0};
    job.k = col_kernels_active();
    job.l = l;
    job.Q = l->n_heads * l->head_dim;
    job.KV = l->n_kv_heads * l->head_dim;
    job.R = job.Q + 2 * job.KV + (l->wg ? job.Q : 0);
    if ((l->wg && col_matrix_init(&job.mg, job.k, l->qkv_type, l->wg, l->dim) != COL_OK) ||
        col_matrix_init(&job.mq, job.k, l->qkv_type, l->wq, l->dim) != COL_OK ||
        col_matrix_init(&job.mk, job.k, l->qkv_type, l->wk, l->dim) != COL_OK ||
        col_matrix_init(&job.mv, job.k, l->qkv_type, l->wv, l->dim) != COL_OK ||
        col_matrix_init(&job.mo, job.k, l->o_type, l->wo, job.Q) != COL_OK)
        return COL_EINVAL;
    job.n_tok = n_tok;
    job.seqs = seqs;
    job.n_seqs = n_seqs;
    job.x = x;
    job.cos = cos;
    job.sin = sin;

    /* scratch: h (T, D) | qkv (T, R) | a (T, Q) | o (T, D) | scores (nth, COL_ATTEND_BLOCK, S) | hq | aq | seq_of (T) | first_of (N) */
    const int nth = col_pool_n_threads(pool);
    const size_t T = (size_t)n_tok, S = (size_t)most_keys;
    job.scores_per_thread = (int64_t)S;
#define F32_BYTES(n) (((n) * sizeof(float) + 63) / 64 * 64)
    const size_t sz_h = F32_BYTES(T * (size_t)l->dim), sz_qkv = F32_BYTES(T * (size_t)job.R);
    const size_t sz_a = F32_BYTES(T * (size_t)job.Q), sz_scores = F32_BYTES((size_t)nth * COL_ATTEND_BLOCK * S);
#undef F32_BYTES
    job.hq_bytes = job.mq.integer ? col_xq_bytes(l->dim / COL_QK_X) : 0;
    job.aq_bytes = job.mo.integer ? col_xq_bytes(job.Q / COL_QK_X) : 0;
    const size_t sz_q = (T * (job.hq_bytes + job.aq_bytes) + 7) / 8 * 8;
    uint8_t *scratch = col_alloc(2 * sz_h + sz_qkv + sz_a + sz_scores + sz_q + T * sizeof(int32_t) +
                                 (size_t)n_seqs * sizeof(int64_t));
    if (!scratch) return COL_ENOMEM;
    job.h = (float *)scratch;
    job.qkv = (float *)(scratch + sz_h);
    job.a = (float *)(scratch + sz_h + sz_qkv);
    job.o = (float *)(scratch + sz_h + sz_qkv + sz_a);
    job.scores = (float *)(scratch + 2 * sz_h + sz_qkv + sz_a);
    job.hq = scratch + 2 * sz_h + sz_qkv + sz_a + sz_scores;
    job.aq = job.hq + T * job.hq_bytes;
    int64_t *first_of = (int64_t *)(job.hq + sz_q);
    int32_t *seq_of = (int32_t *)(first_of + n_seqs);
    for (int64_t i = 0, t = 0; i < n_seqs; i++) {
        first_of[i] = t;
        for (int64_t r = 0; r < seqs[i].n_tok; r++) seq_of[t++] = (int32_t)i;
    }
    job.first_of = first_of;
    job.seq_of = seq_of;
    col_pool_run(pool, block_task, &job);
    col_free(scratch);
    return COL_OK;
}
