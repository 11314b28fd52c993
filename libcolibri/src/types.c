/*
 * types.c — the per-type kernel table and the row-looping public entry points
 * (col_quantize, col_dequantize, col_get_rows). Each entry point validates everything
 * first, so a COL_EINVAL return never leaves an output half-written.
 */
#include "col_internal.h"

static const col_type_traits type_traits[COL_TYPE_COUNT] = {
    [COL_TYPE_F32] = {"f32", 1, 4, col_quantize_row_f32, col_dequantize_row_f32, col_vec_dot_f32},
    [COL_TYPE_F16] = {"f16", 1, 2, col_quantize_row_f16, col_dequantize_row_f16, col_vec_dot_f16},
    [COL_TYPE_BF16] = {"bf16", 1, 2, col_quantize_row_bf16, col_dequantize_row_bf16,
                       col_vec_dot_bf16},
    [COL_TYPE_Q8_0] = {"q8_0", COL_QK8_0, sizeof(col_block_q8_0), col_quantize_row_q8_0,
                       col_dequantize_row_q8_0, col_vec_dot_q8_0},
    [COL_TYPE_Q4_G64] = {"q4_g64", COL_QK4_G64, sizeof(col_block_q4_g64),
                         col_quantize_row_q4_g64, col_dequantize_row_q4_g64,
                         col_vec_dot_q4_g64},
    [COL_TYPE_MXFP4] = {"mxfp4", COL_QK_MXFP4, sizeof(col_block_mxfp4), col_quantize_row_mxfp4,
                        col_dequantize_row_mxfp4, col_vec_dot_mxfp4},
};

const col_type_traits *col_get_type_traits(int type) {
    if (type < 0 || type >= COL_TYPE_COUNT) return NULL;
    return &type_traits[type];
}

int64_t col_type_block_elems(int type) {
    const col_type_traits *tt = col_get_type_traits(type);
    return tt ? tt->block_elems : -1;
}

int64_t col_type_row_bytes(int type, int64_t n_cols) {
    const col_type_traits *tt = col_get_type_traits(type);
    if (!tt || n_cols < 0 || n_cols % tt->block_elems != 0) return -1;
    if (n_cols / tt->block_elems > INT64_MAX / tt->block_bytes) return -1;
    return n_cols / tt->block_elems * tt->block_bytes;
}

/* Validates (type, rows, cols) and the two buffers; on success stores the traits and the
 * row size in bytes. A buffer may be NULL only if the matrix is empty. */
static int check_matrix(int type, int64_t rows, int64_t cols, const void *a, const void *b,
                        const col_type_traits **tt, int64_t *row_bytes) {
    *tt = col_get_type_traits(type);
    if (!*tt || rows < 0 || cols < 0) return COL_EINVAL;
    *row_bytes = col_type_row_bytes(type, cols);
    if (*row_bytes < 0) return COL_EINVAL;
    if (rows > 0 && cols > 0 && (!a || !b)) return COL_EINVAL;
    return COL_OK;
}

col_quantize_row_fn col_quantize_row_active(int type) {
    const col_quantize_row_fn fast = col_kernels_active()->quantize_row[type];
    return fast ? fast : type_traits[type].quantize_row;
}

col_dequantize_row_fn col_dequantize_row_active(int type) {
    const col_dequantize_row_fn fast = col_kernels_active()->dequantize_row[type];
    return fast ? fast : type_traits[type].dequantize_row;
}

int col_quantize(int type, const float *src, int64_t rows, int64_t cols, void *dst) {
    const col_type_traits *tt;
    int64_t row_bytes;
    int st = check_matrix(type, rows, cols, src, dst, &tt, &row_bytes);
    if (st != COL_OK || cols == 0) return st;
    const col_quantize_row_fn quantize_row = col_quantize_row_active(type);
    uint8_t *out = dst;
    for (int64_t r = 0; r < rows; r++) {
        st = quantize_row(src + r * cols, out + r * row_bytes, cols);
        if (st != COL_OK) return st;
    }
    return COL_OK;
}

int col_dequantize(int type, const void *src, int64_t rows, int64_t cols, float *dst) {
    const col_type_traits *tt;
    int64_t row_bytes;
    int st = check_matrix(type, rows, cols, src, dst, &tt, &row_bytes);
    if (st != COL_OK || cols == 0) return st;
    const col_dequantize_row_fn dequantize_row = col_dequantize_row_active(type);
    const uint8_t *in = src;
    for (int64_t r = 0; r < rows; r++) dequantize_row(in + r * row_bytes, dst + r * cols, cols);
    return COL_OK;
}

int col_get_rows(int type, const void *w, int64_t cols, const int32_t *ids, int64_t n_ids,
                 float *out) {
    const col_type_traits *tt;
    int64_t row_bytes;
    int st = check_matrix(type, n_ids, cols, w, out, &tt, &row_bytes);
    if (st != COL_OK) return st;
    if (n_ids > 0 && !ids) return COL_EINVAL;
    if (cols == 0) return COL_OK;
    const col_dequantize_row_fn dequantize_row = col_dequantize_row_active(type);
    const uint8_t *rows = w;
    for (int64_t i = 0; i < n_ids; i++)
        dequantize_row(rows + (int64_t)ids[i] * row_bytes, out + i * cols, cols);
    return COL_OK;
}
