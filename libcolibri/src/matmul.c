/*
 * matmul.c — y = x @ w^T for any weight type, driven by the type's vec_dot kernel.
 *
 * The work is split into independent ranges of output rows (col_matmul_rows): the thread
 * pool of a later issue hands each worker a range, and nothing else changes.
 */
#include "col_internal.h"

/* Output rows per tile: a tile of weight rows is reused for every token while it is hot in
 * cache (a 4096-wide q8_0 row is ~4.3 KiB, so 16 rows fit in L1/L2 comfortably). */
#define COL_MATMUL_ROW_TILE 16

/* Computes y[:, row_begin:row_end]. Arguments are already validated. */
static void col_matmul_rows(const col_type_traits *tt, const uint8_t *w /* (n_out, row_bytes) */,
                            int64_t row_bytes, int64_t n_out, int64_t n_in,
                            const float *x /* (n_tok, n_in) */, int64_t n_tok,
                            float *y /* (n_tok, n_out) */, int64_t row_begin, int64_t row_end) {
    for (int64_t r0 = row_begin; r0 < row_end; r0 += COL_MATMUL_ROW_TILE) {
        const int64_t r1 = r0 + COL_MATMUL_ROW_TILE < row_end ? r0 + COL_MATMUL_ROW_TILE : row_end;
        for (int64_t t = 0; t < n_tok; t++) {
            const float *xt = x + t * n_in; /* (n_in) */
            float *yt = y + t * n_out;      /* (n_out) */
            for (int64_t r = r0; r < r1; r++) yt[r] = tt->vec_dot(w + r * row_bytes, xt, n_in);
        }
    }
}

int col_matmul(int type, const void *w, int64_t n_out, int64_t n_in, const float *x,
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
    col_matmul_rows(tt, w, row_bytes, n_out, n_in, x, n_tok, y, 0, n_out);
    return COL_OK;
}
