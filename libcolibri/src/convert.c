/*
 * convert.c — col_convert: checkpoint rows (f32, f16, bf16, or FP8 e4m3 with block scales)
 * decoded and quantized on the worker pool, one row at a time per thread.
 *
 * Each output row depends only on its source row, and is made by the same row quantizer
 * col_quantize uses, so the bytes do not depend on how rows are shared out. Threads take
 * chunks of rows from an atomic counter (a converter shares the machine with its own reader
 * thread and with whatever else runs: a static split would wait for the slowest thread).
 */
#include <stdatomic.h>

#include "col_internal.h"

#define CONVERT_CHUNK_ROWS 8

size_t col_source_matrix_size(void) { return sizeof(col_source_matrix); }

static int64_t source_elem_bytes(int dtype) {
    switch (dtype) {
    case COL_SOURCE_F32: return 4;
    case COL_SOURCE_F16:
    case COL_SOURCE_BF16: return 2;
    case COL_SOURCE_F8_E4M3: return 1;
    default: return -1;
    }
}

/* The float32 value of a float8_e4m3fn byte: bias 7, no infinities, 0x7f / 0xff NaN,
 * exponent 0 subnormal (mantissa / 8 * 2^-6). Every value is exact in float32. */
static float e4m3_to_f32(uint8_t code) {
    const uint32_t sign = (uint32_t)(code & 0x80u) << 24;
    const uint32_t exponent = (code >> 3) & 0x0fu, mantissa = code & 0x07u;
    if ((code & 0x7fu) == 0x7fu) return col_bits_f32(sign | 0x7fc00000u);
    if (exponent == 0) {
        const float v = (float)mantissa * 0x1p-9f;
        return sign ? -v : v;
    }
    return col_bits_f32(sign | ((exponent - 7u + 127u) << 23) | (mantissa << 20));
}

typedef struct {
    const col_source_matrix *src;
    col_quantize_row_fn quantize_row;
    int64_t rows, cols, src_row_bytes, dst_row_bytes;
    uint8_t *dst;
    float *row_buffers;       /* (nth, cols) one decoded row per thread */
    float e4m3[256];          /* value of each FP8 code */
    _Atomic int64_t next_row; /* first row of the next chunk to take */
    _Atomic int status;       /* the first error, COL_OK if none */
} convert_job;

/* Source row `r` (an index into data) decoded into y (cols). */
static void decode_row(const convert_job *job, int64_t r, float *y) {
    const col_source_matrix *s = job->src;
    const uint8_t *row = (const uint8_t *)s->data + r * job->src_row_bytes;
    const int64_t n = job->cols;
    switch (s->dtype) {
    case COL_SOURCE_F32:
        memcpy(y, row, (size_t)n * sizeof(float));
        break;
    case COL_SOURCE_F16:
        for (int64_t c = 0; c < n; c++) y[c] = col_f16_to_f32(col_load_u16(row + 2 * c));
        break;
    case COL_SOURCE_BF16:
        for (int64_t c = 0; c < n; c++) y[c] = col_bf16_to_f32(col_load_u16(row + 2 * c));
        break;
    case COL_SOURCE_F8_E4M3:
        if (!s->scale_inv) {
            for (int64_t c = 0; c < n; c++) y[c] = job->e4m3[row[c]];
            break;
        }
        {
            const int64_t grid_cols = (n + s->block_cols - 1) / s->block_cols;
            const float *scales = s->scale_inv + (r / s->block_rows) * grid_cols; /* (grid_cols) */
            for (int64_t c = 0; c < n; c++) y[c] = job->e4m3[row[c]] * scales[c / s->block_cols];
        }
        break;
    }
}

static void convert_task(void *ctx, int ith, int nth) {
    (void)nth;
    convert_job *job = ctx;
    float *y = job->row_buffers + (int64_t)ith * job->cols; /* (cols) */
    for (;;) {
        const int64_t first = atomic_fetch_add_explicit(&job->next_row, CONVERT_CHUNK_ROWS, memory_order_relaxed);
        if (first >= job->rows || atomic_load_explicit(&job->status, memory_order_relaxed) != COL_OK) return;
        const int64_t last = first + CONVERT_CHUNK_ROWS < job->rows ? first + CONVERT_CHUNK_ROWS : job->rows;
        for (int64_t i = first; i < last; i++) {
            decode_row(job, job->src->row0 + i * job->src->row_step, y);
            const int st = job->quantize_row(y, job->dst + i * job->dst_row_bytes, job->cols);
            if (st != COL_OK) {
                int expected = COL_OK;
                atomic_compare_exchange_strong(&job->status, &expected, st);
                return;
            }
        }
    }
}

/* Everything col_convert checks before writing. */
static int check_source(const col_source_matrix *s, int64_t rows, int64_t cols) {
    if (!s || source_elem_bytes(s->dtype) < 0 || s->reserved != 0 || s->n_src_rows < 0 || s->row0 < 0 ||
        s->row_step < 1)
        return COL_EINVAL;
    if (rows > 0 && cols > 0) {
        if (!s->data) return COL_EINVAL;
        /* the last source row, computed without overflow */
        if (s->row0 >= s->n_src_rows || (rows - 1) > (s->n_src_rows - 1 - s->row0) / s->row_step) return COL_EINVAL;
        if (cols > INT64_MAX / 4 / (s->n_src_rows > 0 ? s->n_src_rows : 1)) return COL_EINVAL;
    }
    if (s->scale_inv && (s->dtype != COL_SOURCE_F8_E4M3 || s->block_rows < 1 || s->block_cols < 1)) return COL_EINVAL;
    return COL_OK;
}

int col_convert(col_pool *pool, const col_source_matrix *src, int64_t rows, int64_t cols, int type, void *dst) {
    const col_type_traits *tt = col_get_type_traits(type);
    const int64_t dst_row_bytes = col_type_row_bytes(type, cols);
    if (!tt || rows < 0 || cols < 0 || dst_row_bytes < 0) return COL_EINVAL;
    const int st = check_source(src, rows, cols);
    if (st != COL_OK) return st;
    if (rows == 0 || cols == 0) return COL_OK;
    if (!dst) return COL_EINVAL;

    const int nth = col_pool_n_threads(pool);
    convert_job *job = col_alloc(sizeof *job);
    if (!job) return COL_ENOMEM;
    job->src = src;
    job->quantize_row = col_quantize_row_active(type);
    job->rows = rows;
    job->cols = cols;
    job->src_row_bytes = cols * source_elem_bytes(src->dtype);
    job->dst_row_bytes = dst_row_bytes;
    job->dst = dst;
    for (int code = 0; code < 256; code++) job->e4m3[code] = e4m3_to_f32((uint8_t)code);
    atomic_init(&job->next_row, 0);
    atomic_init(&job->status, COL_OK);
    job->row_buffers = col_alloc((size_t)nth * (size_t)cols * sizeof(float));
    if (!job->row_buffers) {
        col_free(job);
        return COL_ENOMEM;
    }
    col_pool_run(pool, convert_task, job);
    const int result = atomic_load(&job->status);
    col_free(job->row_buffers);
    col_free(job);
    return result;
}
