/*
 * colibri.h — the C interface of libcolibri, the compute and I/O core of Colibri.
 *
 * Conventions (read these once, they hold for every function below):
 *   - Every symbol starts with `col_`; names are object-then-verb.
 *   - The library never prints, exits or aborts. Functions that can fail return an `int`
 *     status: COL_OK (0) or one of the COL_E* codes below. Each function documents what
 *     state its outputs are in when it fails.
 *   - Matrices are row-major. A "row" of a quantized matrix is a whole number of blocks
 *     (see col_type_row_bytes); shapes are given in comments as `(rows, cols)`.
 *   - Pointers may be NULL only when the element count they go with is zero.
 *   - No function keeps a pointer it was given after it returns. All functions are safe to
 *     call from several threads at once on distinct output buffers.
 *
 * Dimension letters used in shape comments:
 *   T tokens, I input features (n_in), O output features (n_out), R rows, C columns.
 */
#ifndef COLIBRI_H
#define COLIBRI_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define COL_API __attribute__((visibility("default")))
#else
#define COL_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define COL_VERSION_STRING "0.1.0"

/* ---------------------------------------------------------------------------------------
 * Status codes
 * ------------------------------------------------------------------------------------ */
enum col_status {
    COL_OK      = 0, /* success */
    COL_EINVAL  = 1, /* invalid argument: unknown type, negative size, a column count that is
                        not a multiple of the type's block, NULL buffer with non-zero size.
                        Checked before anything is written: outputs are untouched. */
    COL_ENOMEM  = 2, /* an allocation failed; outputs are untouched. */
    COL_ERANGE  = 3, /* a value cannot be represented (e.g. a non-finite input to a
                        quantized type, or a block scale that overflows f16). Outputs may be
                        partially written and must be discarded. */
    COL_ENOTSUP = 4, /* the operation is not supported for this type or on this machine;
                        outputs are untouched. */
};

/* A short, static, human-readable description of a status code ("invalid argument").
 * Never NULL; unknown codes give "unknown status". */
COL_API const char *col_status_string(int status);

/* The library version, e.g. "0.1.0". Static string. */
COL_API const char *col_version(void);

/* ---------------------------------------------------------------------------------------
 * Element types and their on-disk block layouts (all little-endian; this is the pack format)
 *
 *   COL_TYPE_F32     4 bytes per value, IEEE binary32.
 *   COL_TYPE_F16     2 bytes per value, IEEE binary16; conversion rounds to nearest even,
 *                    overflows to inf, keeps subnormals, inf and NaN (NaN stays NaN).
 *   COL_TYPE_BF16    2 bytes per value, the upper 16 bits of binary32 after rounding to
 *                    nearest even (same as torch's .to(torch.bfloat16)); NaN stays NaN.
 *   COL_TYPE_Q8_0    blocks of 32 values, 34 bytes (8.5 bits/value), identical to ggml Q8_0:
 *                      uint16_t d;      f16 scale, d = max|x| / 127
 *                      int8_t   qs[32]; q = roundf(x / d) (half away from zero)
 *                    value = d * q. An all-zero block has d = 0, q = 0.
 *   COL_TYPE_Q4_G64  blocks of 64 values, 36 bytes (4.5 bits/value):
 *                      uint16_t d;      f16 scale
 *                      uint16_t m;      f16 offset (about the block minimum)
 *                      uint8_t  qs[32]; value j (0..31) in the LOW nibble of qs[j],
 *                                       value j + 32 in the HIGH nibble of qs[j]
 *                    value = d * q + m, q in 0..15. A constant block has d = 0, m = value.
 *                    The quantizer refines (d, m) by least squares from the min/max start and
 *                    keeps the lowest squared error among candidates whose every element is
 *                    within d/2 of its input (no element is clipped by more than half a step).
 * ------------------------------------------------------------------------------------ */
typedef enum {
    COL_TYPE_F32    = 0,
    COL_TYPE_F16    = 1,
    COL_TYPE_BF16   = 2,
    COL_TYPE_Q8_0   = 3,
    COL_TYPE_Q4_G64 = 4,
} col_type;

#define COL_TYPE_COUNT 5

/* Values per block: 1, 1, 1, 32, 64 for the types above; -1 for an unknown type. */
COL_API int64_t col_type_block_elems(int type);

/* Bytes of one row of n_cols values. -1 if the type is unknown, n_cols is negative, or
 * n_cols is not a multiple of the type's block. */
COL_API int64_t col_type_row_bytes(int type, int64_t n_cols);

/* ---------------------------------------------------------------------------------------
 * Conversion
 * ------------------------------------------------------------------------------------ */

/* Converts src to `type`, row by row.
 *   src: (rows, cols) float32
 *   dst: (rows, row_bytes(type, cols)) bytes, any alignment
 * COL_EINVAL: bad type / sizes / NULL; dst untouched.
 * COL_ERANGE: (q8_0, q4_g64 only) a block holds a NaN or inf, or a value too large for an
 *   f16 scale (|x| above ~65504); dst is partially written. */
COL_API int col_quantize(int type, const float *src, int64_t rows, int64_t cols, void *dst);

/* Converts `type` back to float32.
 *   src: (rows, row_bytes(type, cols)) bytes, any alignment
 *   dst: (rows, cols) float32
 * COL_EINVAL: bad type / sizes / NULL; dst untouched. */
COL_API int col_dequantize(int type, const void *src, int64_t rows, int64_t cols, float *dst);

/* Embedding lookup: out[i, :] = dequantize(w[ids[i], :]).
 *   w:   (n_rows, row_bytes(type, cols)) bytes; n_rows is not passed
 *   ids: (n_ids) row indices
 *   out: (n_ids, cols) float32
 * BOUNDS ARE THE CALLER'S JOB: every ids[i] must be in [0, n_rows). The library cannot check
 * this (it does not know n_rows); an out-of-range id reads out of bounds. The Python wrapper
 * (colibrid.native.get_rows) checks ids against the buffer size before calling.
 * COL_EINVAL: bad type / sizes / NULL; out untouched. */
COL_API int col_get_rows(int type, const void *w, int64_t cols, const int32_t *ids, int64_t n_ids,
                         float *out);

/* ---------------------------------------------------------------------------------------
 * Matrix product
 * ------------------------------------------------------------------------------------ */

/* y[t, o] = sum_i w[o, i] * x[t, i]   (y = x @ w^T)
 *   w: (n_out, row_bytes(type, n_in)) bytes, any alignment
 *   x: (n_tok, n_in) float32
 *   y: (n_tok, n_out) float32, must not overlap x or w
 * n_out and n_tok are arbitrary; n_in must be a multiple of the type's block.
 * Accumulates in float32: each block (32 values for f32/f16/bf16/q8_0, 64 for q4_g64) is
 * summed on its own, then added to the row total.
 * COL_EINVAL: bad type / sizes / NULL; y untouched. */
COL_API int col_matmul(int type, const void *w, int64_t n_out, int64_t n_in, const float *x,
                       int64_t n_tok, float *y);

/* ---------------------------------------------------------------------------------------
 * CRC-32C (Castagnoli, reflected polynomial 0x82F63B78)
 * ------------------------------------------------------------------------------------ */

/* Standard CRC-32C with chaining: pass 0 to start, the previous result to continue.
 * col_crc32c(0, "123456789", 9) == 0xE3069283, and
 * col_crc32c(col_crc32c(0, a, n), b, m) == crc of a followed by b.
 * Uses the SSE4.2 crc32 instruction when the CPU has it, else a table-driven loop. */
COL_API uint32_t col_crc32c(uint32_t crc, const void *buf, size_t len);

/* The table-driven software path, always available; same results as col_crc32c. */
COL_API uint32_t col_crc32c_sw(uint32_t crc, const void *buf, size_t len);

/* 1 if col_crc32c uses the hardware (SSE4.2) path on this machine, else 0. */
COL_API int col_crc32c_hw(void);

#ifdef __cplusplus
}
#endif

#endif /* COLIBRI_H */
