/*
 * col_internal.h — what the .c files of libcolibri share and the public header does not show:
 * the block structs (for their sizes and offsets), scalar f16/bf16 conversions, byte loads,
 * and the per-type kernel table that col_quantize / col_dequantize / col_matmul dispatch on.
 *
 * The kernel table is where SIMD variants slot in: a later col_kernels_init() can replace the
 * function pointers of an entry with AVX-512 versions after checking the CPU, and the public
 * entry points do not change.
 */
#ifndef COL_INTERNAL_H
#define COL_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <assert.h>

#include "colibri.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libcolibri assumes a little-endian host (the pack format is little-endian)"
#endif

/* ---------------------------------------------------------------------------------------
 * Block layouts. Kernels never dereference these structs (row data can sit at any byte
 * offset of an mmap); they exist to pin sizes and field offsets at compile time.
 * ------------------------------------------------------------------------------------ */
#define COL_QK8_0 32
#define COL_QK4_G64 64

typedef struct {
    uint16_t d;              /* f16 scale */
    int8_t qs[COL_QK8_0];    /* (32) quants */
} col_block_q8_0;
static_assert(sizeof(col_block_q8_0) == 34, "q8_0 block must be 34 bytes");
static_assert(offsetof(col_block_q8_0, qs) == 2, "q8_0 quants follow the scale");

typedef struct {
    uint16_t d;                   /* f16 scale */
    uint16_t m;                   /* f16 offset */
    uint8_t qs[COL_QK4_G64 / 2];  /* (32) element j low nibble, element j+32 high nibble */
} col_block_q4_g64;
static_assert(sizeof(col_block_q4_g64) == 36, "q4_g64 block must be 36 bytes");
static_assert(offsetof(col_block_q4_g64, m) == 2, "q4_g64 offset follows the scale");
static_assert(offsetof(col_block_q4_g64, qs) == 4, "q4_g64 quants follow the offset");

/* ---------------------------------------------------------------------------------------
 * Unaligned little-endian loads and stores
 * ------------------------------------------------------------------------------------ */
static inline uint16_t col_load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline void col_store_u16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static inline float col_load_f32(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }
static inline uint32_t col_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float col_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---------------------------------------------------------------------------------------
 * Scalar conversions
 * ------------------------------------------------------------------------------------ */

/* binary32 -> binary16, round to nearest even. Overflow gives inf; NaN keeps its sign and
 * top payload bits and is made quiet (what x86 F16C does). Exact on subnormals. */
static inline uint16_t col_f32_to_f16(float f) {
    const uint32_t u = col_f32_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) { /* inf or NaN */
        if (a == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    }
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (a >= 0x38800000u) {                                    /* >= 2^-14: normal half */
        a += 0xfffu + ((a >> 13) & 1u);                         /* round to nearest even */
        a -= (uint32_t)(127 - 15) << 23;                        /* rebias exponent */
        return (uint16_t)(sign | (a >> 13));
    }
    /* Half subnormal (or zero): q = value / 2^-24 = mant * 2^(e - 126), rounded to even. */
    const uint32_t e = a >> 23;
    const uint32_t shift = 126u - e; /* >= 14 here */
    if (e == 0 || shift > 24u) return sign;
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q += 1u; /* may carry into the smallest normal */
    return (uint16_t)(sign | q);
}

static inline float col_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu) return col_bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        const float v = (float)mant * 0x1p-24f; /* exact: subnormal or zero */
        return sign ? -v : v;
    }
    return col_bits_f32(sign | ((exp + (127 - 15)) << 23) | (mant << 13));
}

/* binary32 -> bfloat16, round to nearest even (torch's rule); NaN stays NaN (made quiet,
 * sign and top payload kept). */
static inline uint16_t col_f32_to_bf16(float f) {
    const uint32_t u = col_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float col_bf16_to_f32(uint16_t h) { return col_bits_f32((uint32_t)h << 16); }

/* ---------------------------------------------------------------------------------------
 * Per-type kernel table
 * ------------------------------------------------------------------------------------ */

/* x: (n) float32 -> dst: n / block_elems blocks. Returns COL_OK or COL_ERANGE. */
typedef int (*col_quantize_row_fn)(const float *x, uint8_t *dst, int64_t n);
/* src: n / block_elems blocks -> y: (n) float32. */
typedef void (*col_dequantize_row_fn)(const uint8_t *src, float *y, int64_t n);
/* sum_i w[i] * x[i] over one weight row w (n values, encoded) and x: (n) float32. */
typedef float (*col_vec_dot_fn)(const uint8_t *w, const float *x, int64_t n);

typedef struct {
    const char *name;                     /* as in the pack manifest: "q8_0" */
    int64_t block_elems;                  /* values per block */
    int64_t block_bytes;                  /* bytes per block */
    col_quantize_row_fn quantize_row;
    col_dequantize_row_fn dequantize_row;
    col_vec_dot_fn vec_dot;
} col_type_traits;

/* The traits of `type`, or NULL if it is not a valid col_type. */
const col_type_traits *col_get_type_traits(int type);

/* Reference row kernels, one set per type (quant_float.c, quant_q8_0.c, quant_q4_g64.c). */
int col_quantize_row_f32(const float *x, uint8_t *dst, int64_t n);
void col_dequantize_row_f32(const uint8_t *src, float *y, int64_t n);
float col_vec_dot_f32(const uint8_t *w, const float *x, int64_t n);

int col_quantize_row_f16(const float *x, uint8_t *dst, int64_t n);
void col_dequantize_row_f16(const uint8_t *src, float *y, int64_t n);
float col_vec_dot_f16(const uint8_t *w, const float *x, int64_t n);

int col_quantize_row_bf16(const float *x, uint8_t *dst, int64_t n);
void col_dequantize_row_bf16(const uint8_t *src, float *y, int64_t n);
float col_vec_dot_bf16(const uint8_t *w, const float *x, int64_t n);

int col_quantize_row_q8_0(const float *x, uint8_t *dst, int64_t n);
void col_dequantize_row_q8_0(const uint8_t *src, float *y, int64_t n);
float col_vec_dot_q8_0(const uint8_t *w, const float *x, int64_t n);

int col_quantize_row_q4_g64(const float *x, uint8_t *dst, int64_t n);
void col_dequantize_row_q4_g64(const uint8_t *src, float *y, int64_t n);
float col_vec_dot_q4_g64(const uint8_t *w, const float *x, int64_t n);

#endif /* COL_INTERNAL_H */
