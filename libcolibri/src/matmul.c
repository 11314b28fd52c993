/*
 * matmul.c — y = x @ w^T for any weight type, output rows split across the pool.
 *
 * Two inner paths, picked per call from the active kernel set:
 *   - integer: the activations are quantized once per call (col_quantize_x, tokens split
 *     across the pool), then a tile of weight rows meets groups of tokens: up to 64 for a
 *     level's rows_xq kernel, four for its dotn kernel (which decodes each weight block once
 *     for the group);
 *   - float: the reference vec_dot of the type, float32 activations (portable level, and
 *     f32/f16/bf16 weights everywhere).
 * Rows are processed in tiles: a tile of weight rows stays hot in cache while every token
 * passes over it, so prefill reads each weight once per tile, not once per token.
 */
#include "col_internal.h"

/* Output rows per tile (a 2048-wide q8_0 row is ~2.2 KiB: 16 rows sit in L1/L2). */
#define COL_MATMUL_ROW_TILE 16
/* Tokens per group that meets a row tile. A level's rows_xq kernel takes the whole group and
 * walks it in its own smaller groups (four tokens), so a large group lets a kernel that
 * repacks the tile (the AVX-512 VNNI tiles) do so once for many tokens; the activation rows
 * (2048 values: ~2.3 KiB quantized each) stream from L2. Without one, four tokens meet the
 * tile per dotn call. */
#define COL_MATMUL_TOKEN_GROUP 64
#define COL_MATMUL_DOTN_GROUP 4

void col_rows_times_xq(const col_kernel_set *k, int type, const uint8_t *w, int64_t row_bytes, int64_t r0,
                       int64_t r1, const col_xq_row *x, int64_t n, int64_t nb, float *y, int64_t y_stride) {
    if (k->rows_xq[type]) { /* the level tiles rows and tokens itself */
        k->rows_xq[type](w + r0 * row_bytes, row_bytes, r1 - r0, x, n, nb, y, y_stride);
        return;
    }
    const col_dotn_xq_fn dotn = k->dotn_xq[type];
    const col_dot_xq_fn dot = k->dot_xq[type];
    int64_t i = 0;
    if (dotn) { /* groups of four, then the two or three left as one group */
        while (n - i >= 2) {
            const int g = n - i >= 4 ? 4 : (int)(n - i);
            for (int64_t r = r0; r < r1; r++) {
                float v[4];
                dotn(w + r * row_bytes, x + i, nb, g, v);
                for (int j = 0; j < g; j++) y[(i + j) * y_stride + (r - r0)] = v[j];
            }
            i += g;
        }
    }
    for (; i < n; i++)
        for (int64_t r = r0; r < r1; r++) y[i * y_stride + (r - r0)] = dot(w + r * row_bytes, &x[i], nb);
}

int col_matrix_init(col_matrix *m, const col_kernel_set *k, int type, const void *w, int64_t n_in) {
    m->tt = col_get_type_traits(type);
    m->row_bytes = col_type_row_bytes(type, n_in);
    if (!m->tt || m->row_bytes < 0) return COL_EINVAL;
    m->type = type;
    m->integer = k->dot_xq[type] != NULL;
    m->simd_f32 = type == COL_TYPE_F32 && k->level != COL_KERNELS_PORTABLE;
    m->w = w;
    m->n_in = n_in;
    return COL_OK;
}

void col_matrix_rows(const col_kernel_set *k, const col_matrix *m, int64_t r_begin, int64_t r_end,
                     const float *x, const uint8_t *xq, size_t xq_bytes, int64_t n_tok, float *y,
                     int64_t y_stride) {
    const int64_t nb = m->n_in / COL_QK_X;
    for (int64_t r0 = r_begin; r0 < r_end; r0 += COL_MATMUL_ROW_TILE) {
        const int64_t r1 = r0 + COL_MATMUL_ROW_TILE < r_end ? r0 + COL_MATMUL_ROW_TILE : r_end;
        const int64_t group = k->rows_xq[m->type] ? COL_MATMUL_TOKEN_GROUP : COL_MATMUL_DOTN_GROUP;
        for (int64_t t0 = 0; t0 < n_tok; t0 += group) {
            const int64_t n = n_tok - t0 < group ? n_tok - t0 : group;
            float *yg = y + t0 * y_stride + (r0 - r_begin); /* token t0, row r0 */
            if (m->integer) {
                col_xq_row xr[COL_MATMUL_TOKEN_GROUP];
                for (int64_t i = 0; i < n; i++) xr[i] = col_xq_view(xq + (size_t)(t0 + i) * xq_bytes, nb);
                col_rows_times_xq(k, m->type, m->w, m->row_bytes, r0, r1, xr, n, nb, yg, y_stride);
                continue;
            }
            for (int64_t i = 0; i < n; i++) {
                const float *xt = x + (t0 + i) * m->n_in; /* (n_in) */
                float *yt = yg + i * y_stride;            /* rows r0.. of token t0 + i */
                if (m->simd_f32) /* f32 weights on a SIMD level: the level's float dot */
                    for (int64_t r = r0; r < r1; r++)
                        yt[r - r0] = k->dot_f32((const float *)(const void *)(m->w + r * m->row_bytes), xt, m->n_in);
                else
                    for (int64_t r = r0; r < r1; r++) yt[r - r0] = m->tt->vec_dot(m->w + r * m->row_bytes, xt, m->n_in);
            }
        }
    }
}

typedef struct {
    const col_kernel_set *k;
    col_matrix m;
    int64_t n_out, n_tok;
    const float *x;        /* (n_tok, n_in) */
    uint8_t *xq;           /* (n_tok, xq_bytes) quantized activations, integer path only */
    size_t xq_bytes;
    float *y;              /* (n_tok, n_out) */
    col_barrier barrier;
} matmul_job;

static void matmul_task(void *arg, int ith, int nth) {
    matmul_job *j = arg;
    if (j->m.integer) {
        int64_t t0, t1;
        col_split(j->n_tok, ith, nth, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) col_quantize_x(j->m.type, j->x + t * j->m.n_in, j->m.n_in, j->xq + t * j->xq_bytes);
        col_barrier_wait(&j->barrier, nth);
    }
    int64_t r_begin, r_end;
    col_split(j->n_out, ith, nth, &r_begin, &r_end);
    col_matrix_rows(j->k, &j->m, r_begin, r_end, j->x, j->xq, j->xq_bytes, j->n_tok, j->y + r_begin, j->n_out);
}

int col_matmul(col_pool *pool, int type, const void *w, int64_t n_out, int64_t n_in, const float *x,
               int64_t n_tok, float *y) {
    const col_type_traits *tt = col_get_type_traits(type);
    if (!tt || n_out < 0 || n_in < 0 || n_tok < 0) return COL_EINVAL;
    const int64_t row_bytes = col_type_row_bytes(type, n_in);
    if (row_bytes < 0) return COL_EINVAL;
    if (n_out == 0 || n_tok == 0) return COL_OK;
    if (!y || (n_in > 0 && (!w || !x))) return COL_EINVAL;
    if (n_in == 0) { /* empty sums */
        memset(y, 0, (size_t)(n_out * n_tok) * sizeof(float));
        return COL_OK;
    }
    matmul_job job = {col_kernels_active(), {0}, n_out, n_tok, x, NULL, 0, y, {0, 0}};
    col_matrix_init(&job.m, job.k, type, w, n_in); /* type and n_in checked above */
    if (job.m.integer) {
        job.xq_bytes = col_xq_bytes(n_in / COL_QK_X);
        job.xq = col_alloc(job.xq_bytes * (size_t)n_tok);
        if (!job.xq) return COL_ENOMEM;
    }
    col_pool_run(pool, matmul_task, &job);
    col_free(job.xq);
    return COL_OK;
}
