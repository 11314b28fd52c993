/*
 * ops.c — the small dense steps of a decoder layer: RMSNorm, RoPE and attention over the
 * KV cache. All float32; attention's inner products go through the active level's float
 * vector helpers (dot_f32 / axpy_f32).
 */
#include <math.h>

#include "col_internal.h"

void col_rms_norm_row_portable(const float *x, const float *weight, int64_t n, float eps, float *y) {
    double sum_sq = 0.0; /* double: the mean does not depend on n's size */
    for (int64_t i = 0; i < n; i++) sum_sq += (double)x[i] * (double)x[i];
    const float rms = sqrtf((float)(sum_sq / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) y[i] = weight[i] * (x[i] / rms);
}

int col_rms_norm(const float *x, const float *weight, int64_t rows, int64_t n, float eps, float *y) {
    if (rows < 0 || n < 0) return COL_EINVAL;
    if (rows == 0 || n == 0) return COL_OK;
    if (!x || !weight || !y) return COL_EINVAL;
    const col_kernel_set *k = col_kernels_active();
    const col_rms_norm_row_fn row = k->rms_norm_row ? k->rms_norm_row : col_rms_norm_row_portable;
    for (int64_t r = 0; r < rows; r++) row(x + r * n, weight, n, eps, y + r * n);
    return COL_OK;
}

/* Why in C: numpy's cumsum and search take 166 us over a 50k-entry vocabulary, this 39 (Xeon
 * Emerald Rapids), once per sampled token of every sequence. The sums are non-decreasing, so
 * the binary search ends where numpy's does. */
int col_draw_cumulative(double *c, int64_t n, double u, int64_t *position) {
    if (n < 1 || !c || !position) return COL_EINVAL;
    double sum = c[0];
    for (int64_t i = 1; i < n; i++) c[i] = sum = sum + c[i];
    const double target = u * c[n - 1];
    int64_t lo = 0, hi = n; /* the answer is in [lo, hi]: c[lo-1] <= target, c[hi] > target */
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (c[mid] <= target) lo = mid + 1;
        else hi = mid;
    }
    *position = lo;
    return COL_OK;
}

int col_silu_mul(const float *g, const float *u, float *h, int64_t n) {
    if (n < 0) return COL_EINVAL;
    if (n == 0) return COL_OK;
    if (!g || !u || !h) return COL_EINVAL;
    const col_kernel_set *k = col_kernels_active();
    (k->silu_mul ? k->silu_mul : col_silu_mul_portable)(g, u, h, n);
    return COL_OK;
}

int col_gelu_tanh_mul(const float *g, const float *u, float *h, int64_t n) {
    if (n < 0) return COL_EINVAL;
    if (n == 0) return COL_OK;
    if (!g || !u || !h) return COL_EINVAL;
    const col_kernel_set *k = col_kernels_active();
    (k->gelu_tanh_mul ? k->gelu_tanh_mul : col_gelu_tanh_mul_portable)(g, u, h, n);
    return COL_OK;
}

void col_rope_heads(float *x, int64_t n_heads, int64_t head_dim, int64_t rotary_dim, const float *c, const float *s) {
    const int64_t half = rotary_dim / 2;
    for (int64_t h = 0; h < n_heads; h++) {
        float *v = x + h * head_dim; /* (Hd): rotary_dim rotated, the rest passed through */
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * c[i] - b * s[i];
            v[i + half] = b * c[i + half] + a * s[i + half];
        }
    }
}

int col_rope_partial(float *x, int64_t n_tok, int64_t n_heads, int64_t head_dim, int64_t rotary_dim,
                     const float *cos, const float *sin) {
    if (n_tok < 0 || n_heads < 0 || head_dim < 0 || rotary_dim < 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
        return COL_EINVAL;
    if (n_tok == 0 || n_heads == 0 || rotary_dim == 0) return COL_OK;
    if (!x || !cos || !sin) return COL_EINVAL;
    for (int64_t t = 0; t < n_tok; t++)
        col_rope_heads(x + t * n_heads * head_dim, n_heads, head_dim, rotary_dim, cos + t * rotary_dim,
                       sin + t * rotary_dim);
    return COL_OK;
}

int col_rope(float *x, int64_t n_tok, int64_t n_heads, int64_t head_dim, const float *cos,
             const float *sin) {
    if (head_dim < 0 || head_dim % 2 != 0) return COL_EINVAL;
    return col_rope_partial(x, n_tok, n_heads, head_dim, head_dim, cos, sin);
}

typedef struct {
    const col_kernel_set *k;
    const float *q, *keys, *vals; /* (Tq, H, Hd), (S, K, Hd), (S, K, Hd) */
    int64_t n_q, n_keys, n_heads, n_kv_heads, head_dim, window, chunk, ring;
    const int64_t *positions;     /* (Tq) */
    float scale;
    float *scores;                /* (nth, S) one row per thread */
    float *out;                   /* (Tq, H * Hd) */
} attention_job;

void col_attend_head(const col_kernel_set *k, const float *qv, const float *keys, const float *vals,
                     int64_t n_kv_heads, int64_t kh, int64_t head_dim, int64_t lo, int64_t hi, int64_t ring, float scale,
                     const float *sink, float *sc, float *ov) {
    const col_attend_query q = {qv, lo, hi, sink, ov, kh};
    col_attend_block(k, &q, 1, keys, vals, 0, n_kv_heads, head_dim, ring, scale, sc, 0);
}

/* col_attend_block (col_internal.h): the level's own, with its dot and axpy inlined, or
 * these steps through the level's dot_f32 and axpy_f32. */
void col_attend_block(const col_kernel_set *k, const col_attend_query *q, int n, const void *keys, const void *vals,
                      int kv_f16, int64_t n_kv_heads, int64_t head_dim, int64_t ring, float scale, float *sc,
                      int64_t stride) {
    if (k->attend_block) {
        k->attend_block(q, n, keys, vals, kv_f16, n_kv_heads, head_dim, ring, scale, sc, stride);
        return;
    }
    col_kv_row_buffer kv_row_; /* a float16 row as floats (COL_KV_ROW_AS_F32); the row is left unset */
    kv_row_.cache = NULL, kv_row_.pos = kv_row_.kh = -1;
    COL_ATTEND_BLOCK_STEPS(k->dot_f32, k->axpy_f32, col_exp_sum_portable, float, COL_KV_ROW_AS_F32)
}

int64_t col_first_visible_key(int64_t pos, int64_t window, int64_t chunk, int64_t ring) {
    int64_t lo = 0;
    if (window > 0 && pos - window + 1 > lo) lo = pos - window + 1;
    if (chunk > 0 && pos - pos % chunk > lo) lo = pos - pos % chunk;
    if (ring > 0 && pos - ring + 1 > lo) lo = pos - ring + 1; /* older keys are overwritten */
    return lo;
}

static void attention_task(void *arg, int ith, int nth) {
    attention_job *j = arg;
    const int64_t Hd = j->head_dim, group = j->n_heads / j->n_kv_heads;
    float *sc = j->scores + ith * j->n_keys; /* (S) */
    /* items dealt round-robin: a later query sees more keys, so contiguous shares of a
     * prompt would leave the last thread the most work */
    for (int64_t item = ith; item < j->n_q * j->n_heads; item += nth) {
        const int64_t t = item / j->n_heads, h = item % j->n_heads;
        const int64_t pos = j->positions[t];
        const int64_t hi = j->ring > 0 ? pos : (pos < j->n_keys - 1 ? pos : j->n_keys - 1);
        const int64_t lo = col_first_visible_key(pos, j->window, j->chunk, j->ring);
        col_attend_head(j->k, j->q + item * Hd, j->keys, j->vals, j->n_kv_heads, h / group, Hd, lo, hi, j->ring,
                        j->scale, NULL, sc, j->out + item * Hd);
    }
}

int col_attention(col_pool *pool, const float *q, const float *keys, const float *vals, int64_t n_q,
                  int64_t n_keys, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                  const int64_t *positions, int64_t window, int64_t chunk, int64_t ring, float scale, float *out) {
    if (n_q < 0 || n_keys < 0 || n_heads < 0 || n_kv_heads <= 0 || head_dim < 0 || n_heads % n_kv_heads != 0 ||
        chunk < 0 || ring < 0 || (ring > 0 && ring != n_keys))
        return COL_EINVAL;
    if (n_q == 0 || n_heads == 0 || head_dim == 0) return COL_OK;
    if (!q || !positions || !out || (n_keys > 0 && (!keys || !vals))) return COL_EINVAL;
    const int nth = col_pool_n_threads(pool);
    float *scores = col_alloc((size_t)nth * (size_t)(n_keys > 0 ? n_keys : 1) * sizeof(float));
    if (!scores) return COL_ENOMEM;
    attention_job job = {col_kernels_active(), q, keys, vals, n_q, n_keys, n_heads, n_kv_heads,
                         head_dim, window, chunk, ring, positions, scale, scores, out};
    col_pool_run(pool, attention_task, &job);
    col_free(scores);
    return COL_OK;
}
