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

#define COL_QK_MXFP4 32

typedef struct {
    uint8_t e;                      /* e8m0 shared exponent, scale 2^(e - 127) */
    uint8_t qs[COL_QK_MXFP4 / 2];   /* (16) e2m1 codes: element j low nibble, element j+16 high */
} col_block_mxfp4;
static_assert(sizeof(col_block_mxfp4) == 17, "mxfp4 block must be 17 bytes (4.25 bits per value)");
static_assert(offsetof(col_block_mxfp4, qs) == 1, "mxfp4 codes follow the exponent");

/* Twice the e2m1 value of each code (0..15): integers -12..12, so a code is an int8 weight
 * and a block's value is col_e2m1_x2[code] * 2^(e - 128) (quant_mxfp4.c). */
extern const int8_t col_e2m1_x2[16];

/* 2^(e - 128) as float32, exact for every byte (2^-128 is a float subnormal): half the e8m0
 * scale, the factor that goes with the doubled codes of col_e2m1_x2. */
static inline float col_e8m0_half_to_f32(uint8_t e) {
    const uint32_t bits = e >= 2 ? (uint32_t)(e - 1) << 23 : 0x00200000u << e;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

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

int col_quantize_row_mxfp4(const float *x, uint8_t *dst, int64_t n);
void col_dequantize_row_mxfp4(const uint8_t *src, float *y, int64_t n);
float col_vec_dot_mxfp4(const uint8_t *w, const float *x, int64_t n);

/* col_quantize_row_q4_g64's bytes, one block per SIMD lane (quant_q4_g64_lanes.h), on the
 * AVX2 level (quant_q4_g64_avx2.c) and on the AVX-512 levels (quant_q4_g64_avx512.c). */
int col_quantize_row_q4_g64_avx2(const float *x, uint8_t *dst, int64_t n);
int col_quantize_row_q4_g64_avx512(const float *x, uint8_t *dst, int64_t n);

/* ---------------------------------------------------------------------------------------
 * Activations quantized for the integer kernels (SIMD levels only)
 *
 * One activation row of n values (n a multiple of 32) becomes nb = n / 32 blocks, stored in
 * one 64-byte aligned buffer of col_xq_bytes(nb) bytes, in this order:
 *   qs    (nb, 32) int8     q = nearbyint(x / d), |q| <= 127
 *   bias  (nb, 8) int32     lane 0 = -128 * sum(q), lanes 1..7 = 0: the start value of a
 *                           vpdpbusd sum over (w + 128) so that it yields sum(w * q)
 *   dv    (nb, 8) float32   d repeated 8 times: one 256-bit load per block (scales lanes)
 *   d     (nb) float32      d = max|x| / 127 (0 for an all-zero block)
 *   ds    (nb) float32      d * sum(q): the block sum
 *   ds2   (nb / 2) f32      ds of the two 32-blocks of each 64-value block
 * For q4_g64 weights the activations are quantized in blocks of 64 instead (the weight's
 * block): qs as above, d[k] and ds2[k] per 64-block k, and dv holds them again as pairs
 * (d[k], ds2[k]) at dv[2k], dv[2k + 1]; bias and ds unused (see col_quantize_x).
 * ------------------------------------------------------------------------------------ */
#define COL_QK_X 32

typedef struct {
    const int8_t *qs;    /* (nb, 32) */
    const float *d;      /* (nb) */
    const float *ds;     /* (nb) */
    const float *ds2;    /* (nb / 2) ds[2k] + ds[2k + 1]: the sum over one 64-value block */
    const float *dv;     /* (nb, 8) */
    const int32_t *bias; /* (nb, 8) */
} col_xq_row;

/* Field offsets inside the buffer: nb rounded up to even keeps every array 64-byte aligned
 * at even block indices (the AVX-512 kernels load two blocks at a time). */
static inline int64_t col_xq_nb_even(int64_t nb) { return (nb + 1) & ~(int64_t)1; }
#define COL_XQ_OFF_BIAS(nbe) ((nbe) * 32)
#define COL_XQ_OFF_DV(nbe) ((nbe) * 64)
#define COL_XQ_OFF_D(nbe) ((nbe) * 96)
#define COL_XQ_OFF_DS(nbe) ((nbe) * 100)
#define COL_XQ_OFF_DS2(nbe) ((nbe) * 104)

/* Bytes of one quantized activation row of nb blocks (a multiple of 64). */
static inline size_t col_xq_bytes(int64_t nb) {
    /* + 32 bytes: the AVX-512 q4_g64 kernel reads ds2 eight at a time past the end */
    return (size_t)((col_xq_nb_even(nb) * 106 + 32 + 63) / 64 * 64);
}

/* The row view of a buffer of col_xq_bytes(nb) bytes (64-byte aligned). */
static inline col_xq_row col_xq_view(const uint8_t *base, int64_t nb) {
    const int64_t nbe = col_xq_nb_even(nb);
    col_xq_row r;
    r.qs = (const int8_t *)base;
    r.bias = (const int32_t *)(base + COL_XQ_OFF_BIAS(nbe));
    r.dv = (const float *)(base + COL_XQ_OFF_DV(nbe));
    r.d = (const float *)(base + COL_XQ_OFF_D(nbe));
    r.ds = (const float *)(base + COL_XQ_OFF_DS(nbe));
    r.ds2 = (const float *)(base + COL_XQ_OFF_DS2(nbe));
    return r;
}

/* Quantizes x (n) into the buffer `base` (col_xq_bytes(n / 32) bytes, 64-byte aligned) for
 * products with weights of `type`: q4_g64 gets one scale per 64 values (its own block:
 * d[k], ds2[k] = d[k] * sum(q) for k < n / 64, also as pairs in dv; bias and ds unused), every other type
 * one per 32 (d, ds, dv, bias as above; ds2 the pair sums). Non-finite inputs give garbage
 * values, never a crash. */
void col_quantize_x(int type, const float *x, int64_t n, uint8_t *base);

/* sum over one weight row w (nb * 32 values, encoded) times an activation row. */
typedef float (*col_dot_xq_fn)(const uint8_t *w, const col_xq_row *x, int64_t nb);

/* The kernels of one level. dot_xq[type] is NULL for types computed on float activations
 * with the reference vec_dot. */
/* Float vector helpers (attention): sum a[i] * b[i]; y[i] += a * x[i]. */
typedef float (*col_dot_f32_fn)(const float *a, const float *b, int64_t n);
typedef void (*col_axpy_f32_fn)(float *y, float a, const float *x, int64_t n);
struct col_attend_query;
/* col_attend_block as a level computes it: COL_ATTEND_BLOCK_STEPS with its own dot, axpy and
 * exponentials inlined (and the weighted values in registers), one set of bits per level. */
typedef void (*col_attend_block_fn)(const struct col_attend_query *q, int n, const void *keys, const void *vals,
                                    int kv_f16, int64_t n_kv_heads, int64_t head_dim, int64_t ring, float scale,
                                    float *sc, int64_t stride);

/* One weight row times n (2..4) activation rows x[0..n): out[t] = dot(w, x[t]), with the
 * bits dot_xq gives each token alone; the weight blocks are decoded once for the n tokens. */
typedef void (*col_dotn_xq_fn)(const uint8_t *w, const col_xq_row *x, int64_t nb, int n, float *out);

/* Rows 0..n_rows of w (rows of row_bytes bytes) times activation rows x[0..n_tok):
 * y[t * y_stride + r] = dot(w_r, x[t]). A level's version computes each (row, token) with
 * the same float operations whatever n_rows, n_tok and the row's or token's place in the call,
 * and dot_xq of the level gives the same bits. */
typedef void (*col_rows_xq_fn)(const uint8_t *w, int64_t row_bytes, int64_t n_rows, const col_xq_row *x,
                               int64_t n_tok, int64_t nb, float *y, int64_t y_stride);

/* h[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i] (the experts' SwiGLU). */
typedef void (*col_silu_mul_fn)(const float *g, const float *u, float *h, int64_t n);

/* gpt-oss's clamped SwiGLU: g' = min(g, limit), u' = clamp(u, -limit, limit),
 * h[i] = (u' + 1) * (g' * (1 / (1 + exp(-(g' * alpha))))); a NaN stays NaN. */
typedef void (*col_clamped_swiglu_fn)(const float *g, const float *u, float *h, int64_t n, float alpha, float limit);

/* GeGLU with the tanh-approximated GELU (Gemma's gelu_pytorch_tanh), written through the
 * sigmoid, 0.5 (1 + tanh(y)) = 1 / (1 + exp(-2y)), which keeps full precision where the
 * tanh form cancels: h[i] = g / (1 + exp(-2y)) * u[i], y = sqrt(2/pi) (g + 0.044715 g^3). */
typedef void (*col_gelu_tanh_mul_fn)(const float *g, const float *u, float *h, int64_t n);

/* One activation block of n (32 or 64) values: *d = max|x| / 127, qs = nearbyint(x / d)
 * (round half to even, clamped to +-127; NaN to -127); returns sum(qs). Every level's
 * version gives the same bytes (col_quantize_x's contract). */
typedef int32_t (*col_quantize_block_fn)(const float *x, int n, int8_t *qs, float *d);

/* One RMSNorm row: y = weight * (x / sqrt(sum(x^2) / n + eps)), the sum in double. */
typedef void (*col_rms_norm_row_fn)(const float *x, const float *weight, int64_t n, float eps, float *y);

typedef struct {
    int level;
    col_dot_xq_fn dot_xq[COL_TYPE_COUNT];
    col_dot_f32_fn dot_f32;
    col_axpy_f32_fn axpy_f32;
    col_dotn_xq_fn dotn_xq[COL_TYPE_COUNT]; /* NULL: a dot_xq call per token */
    col_silu_mul_fn silu_mul;               /* NULL: col_silu_mul_portable */
    col_quantize_block_fn quantize_block;   /* NULL: col_quantize_block_portable */
    col_rms_norm_row_fn rms_norm_row;       /* NULL: col_rms_norm_row_portable */
    col_clamped_swiglu_fn clamped_swiglu;   /* NULL: col_clamped_swiglu_portable */
    col_quantize_row_fn quantize_row[COL_TYPE_COUNT]; /* NULL: the type's reference quantizer;
                                                         else the same bytes, faster */
    col_gelu_tanh_mul_fn gelu_tanh_mul;     /* NULL: col_gelu_tanh_mul_portable */
    col_dequantize_row_fn dequantize_row[COL_TYPE_COUNT]; /* NULL: the type's reference
                                                             dequantizer; else the same bits */
    col_rows_xq_fn rows_xq[COL_TYPE_COUNT]; /* NULL: dotn_xq / dot_xq per row */
    col_attend_block_fn attend_block;       /* NULL: COL_ATTEND_BLOCK_STEPS through dot_f32, axpy_f32
                                               and col_exp_sum_portable */
} col_kernel_set;

/* The portable float helpers (kernels.c), also used by levels without their own. */
float col_dot_f32_portable(const float *a, const float *b, int64_t n);
void col_axpy_f32_portable(float *y, float a, const float *x, int64_t n);
/* x[i] = expf(x[i] - mx) for i < n, summed in order: a softmax's numerators and denominator. */
float col_exp_sum_portable(float *x, int64_t n, float mx);
void col_silu_mul_portable(const float *g, const float *u, float *h, int64_t n);
void col_clamped_swiglu_portable(const float *g, const float *u, float *h, int64_t n, float alpha, float limit);
void col_gelu_tanh_mul_portable(const float *g, const float *u, float *h, int64_t n);
int32_t col_quantize_block_portable(const float *x, int n, int8_t *qs, float *d);
void col_rms_norm_row_portable(const float *x, const float *weight, int64_t n, float eps, float *y);

/* The active kernel set (never NULL). */
const col_kernel_set *col_kernels_active(void);

/* The row quantizer of a valid `type` on the active level: the level's faster one if it has
 * one (same bytes), else the reference (types.c). */
col_quantize_row_fn col_quantize_row_active(int type);

/* The row dequantizer of a valid `type` on the active level, likewise (same float bits). */
col_dequantize_row_fn col_dequantize_row_active(int type);

/* Per-level kernel sets, NULL when not compiled in (simd_x86.c, simd_neon.c). */
const col_kernel_set *col_kernels_avx2(void);
const col_kernel_set *col_kernels_avx512(void);
const col_kernel_set *col_kernels_avx512_vnni(void);
const col_kernel_set *col_kernels_neon(void);

/* y[i * y_stride + (r - r0)] = w_r . x[i] for rows r0 <= r < r1 of w and activation rows
 * x[0..n): by the level's rows_xq kernel if it has one, else up to four activation rows at a
 * time where the level has a dotn kernel (matmul.c). */
void col_rows_times_xq(const col_kernel_set *k, int type, const uint8_t *w, int64_t row_bytes, int64_t r0,
                       int64_t r1, const col_xq_row *x, int64_t n, int64_t nb, float *y, int64_t y_stride);

/* One weight matrix as an operand of a product (matmul.c): how its rows meet activations
 * on the active level. */
typedef struct {
    const col_type_traits *tt;
    int type;
    int integer;        /* 1: int8 activations (col_quantize_x rows), level's dot_xq */
    int simd_f32;       /* 1: f32 weights through the level's dot_f32 */
    const uint8_t *w;   /* (n_out, row_bytes) */
    int64_t row_bytes, n_in;
} col_matrix;

/* Describes w (`type`, rows of n_in values) for kernel set k. COL_EINVAL: bad type or n_in. */
int col_matrix_init(col_matrix *m, const col_kernel_set *k, int type, const void *w, int64_t n_in);

/* y[t * y_stride + (r - r_begin)] = w_r . x_t for rows r_begin <= r < r_end and tokens
 * t < n_tok, in tiles of 16 rows by groups of 4 tokens. Integer matrices read the quantized
 * rows xq (n_tok, xq_bytes), the others x (n_tok, n_in). col_matmul is this over a row split. */
void col_matrix_rows(const col_kernel_set *k, const col_matrix *m, int64_t r_begin, int64_t r_end,
                     const float *x, const uint8_t *xq, size_t xq_bytes, int64_t n_tok, float *y,
                     int64_t y_stride);

/* RoPE of one token's n_heads heads (n_heads, head_dim) in place: the first rotary_dim dims of
 * each head rotated (rotate-half within them) by c, s (rotary_dim), the rest untouched. */
void col_rope_heads(float *x, int64_t n_heads, int64_t head_dim, int64_t rotary_dim, const float *c, const float *s);

/* The row of a KV cache that holds position pos: pos % ring in a ring buffer of `ring` rows
 * (ring > 0), else pos. */
static inline int64_t col_cache_row(int64_t pos, int64_t ring) { return ring > 0 ? pos % ring : pos; }

/* Where kv head kh's head_dim values of position pos start, in values from the first of a
 * cache of rows of n_kv_heads * head_dim (of any element type). */
static inline int64_t col_cache_offset(int64_t pos, int64_t ring, int64_t n_kv_heads, int64_t kh, int64_t head_dim) {
    return (col_cache_row(pos, ring) * n_kv_heads + kh) * head_dim;
}

/* Kv head kh's head_dim floats of position pos in a float32 cache. */
static inline const float *col_cache_head(const float *cache, int64_t pos, int64_t ring, int64_t n_kv_heads, int64_t kh,
                                          int64_t head_dim) {
    return cache + col_cache_offset(pos, ring, n_kv_heads, kh, head_dim);
}

/* The same in a float16 cache (col_attention_seq's kv_type COL_TYPE_F16). */
static inline const uint16_t *col_cache_head_f16(const uint16_t *cache, int64_t pos, int64_t ring, int64_t n_kv_heads,
                                                 int64_t kh, int64_t head_dim) {
    return cache + col_cache_offset(pos, ring, n_kv_heads, kh, head_dim);
}

/* y[i] = the float16 h[i] as float32, exactly (kernels.c). */
void col_f16_row_to_f32_portable(const uint16_t *h, float *y, int64_t n);

/* The longest head a float16 cache may have: the portable path converts one row of it at a
 * time into a buffer of this many floats on the stack. */
#define COL_ATTEND_MAX_HEAD_DIM 1024

/* A float16 cache's row as floats, for the portable path: the last one converted, kept while
 * the queries that read it follow each other (a group's query heads, a run's tokens). */
typedef struct col_kv_row_buffer {
    const void *cache;
    int64_t pos, kh;
    float row[COL_ATTEND_MAX_HEAD_DIM];
} col_kv_row_buffer;

static inline const float *col_kv_row_as_f32(col_kv_row_buffer *b, const void *cache, int64_t pos, int64_t ring,
                                             int64_t n_kv_heads, int64_t kh, int64_t head_dim) {
    if (b->cache != cache || b->pos != pos || b->kh != kh) {
        col_f16_row_to_f32_portable(col_cache_head_f16((const uint16_t *)cache, pos, ring, n_kv_heads, kh, head_dim),
                                    b->row, head_dim);
        b->cache = cache, b->pos = pos, b->kh = kh;
    }
    return b->row;
}

/* How attention reads kv head kh's row at position pos (the key_row / val_row of the macros
 * below): COL_KV_ROW_f32 and COL_KV_ROW_f16 in place, for a dot or axpy that reads float32, or
 * float16 converting as it loads (the x86 levels); COL_KV_ROW_AS_F32 either kind as floats,
 * kv_f16 saying which, a float16 row converted first (exactly) into kv_row_, a
 * col_kv_row_buffer the caller declares (the portable path). Either way the arithmetic after
 * it is the float32 cache's on the same values. */
#define COL_KV_ROW_f32(cache, pos, ring, K, kh, Hd) col_cache_head((const float *)(cache), pos, ring, K, kh, Hd)
#define COL_KV_ROW_f16(cache, pos, ring, K, kh, Hd) col_cache_head_f16((const uint16_t *)(cache), pos, ring, K, kh, Hd)
#define COL_KV_ROW_AS_F32(cache, pos, ring, K, kh, Hd)                                                             \
    (kv_f16 ? col_kv_row_as_f32(&kv_row_, cache, pos, ring, K, kh, Hd) : COL_KV_ROW_f32(cache, pos, ring, K, kh, Hd))

/* One query head's attention over the keys at positions lo..hi (ops.c, col_attend_block for
 * one query): ov (Hd) =
 * softmax(scale * q.k_s) v_s, keys/vals read at kv head kh from rows of K * Hd floats: position
 * s in row s % ring of a ring buffer (ring > 0) or row s (ring 0); sc (>= hi - lo + 1) scratch;
 * zeros if hi < lo. With a sink (NULL: none), *sink is one more logit in the softmax
 * denominator, with no value. */
void col_attend_head(const col_kernel_set *k, const float *qv, const float *keys, const float *vals,
                     int64_t n_kv_heads, int64_t kh, int64_t head_dim, int64_t lo, int64_t hi, int64_t ring, float scale,
                     const float *sink, float *sc, float *ov);

/* One query of col_attend_block: its vector (Hd), the key positions lo..hi it sees, its sink
 * (NULL: none), its output (Hd) and the kv head it reads. */
typedef struct col_attend_query {
    const float *qv;
    int64_t lo, hi;
    const float *sink;
    float *ov;
    int64_t kh;
} col_attend_query;

/* The most queries col_attend_block takes at once: 16 score rows and 16 outputs stay in L1
 * and L2 while each key and value row is read once for them. */
#define COL_ATTEND_BLOCK 16

/* col_attend_head for n (1..COL_ATTEND_BLOCK) queries that read the same cache (the tokens of
 * one sequence in a step, the query heads of a group, and neighbouring kv heads: each query's
 * q.kh, best a short run of them, whose parts of a row lie side by side), bit for bit (ops.c);
 * the cache float32, or float16 with kv_f16 (head_dim <= COL_ATTEND_MAX_HEAD_DIM): the bits of
 * a float32 cache holding the same values; sc: (n, stride) scratch, stride >= the most keys
 * one query sees. */
void col_attend_block(const col_kernel_set *k, const col_attend_query *q, int n, const void *keys, const void *vals,
                      int kv_f16, int64_t n_kv_heads, int64_t head_dim, int64_t ring, float scale, float *sc,
                      int64_t stride);

/* Keys ahead of the one being read whose rows are prefetched: one kv head's part of a cache
 * row is a few lines, a row (all kv heads) apart, which the hardware's stream prefetchers
 * do not follow across pages. */
#define COL_ATTEND_AHEAD 8 /* float16 caches too: 4, 8 and 16 keys measured the same there */

static inline void col_prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const uint8_t *)p + i);
}

/* The lines of kv heads kh .. kh + heads - 1 of the row at position pos (side by side),
 * float32 or float16 (f16). */
static inline void col_prefetch_kv_heads(const void *cache, int f16, int64_t pos, int64_t ring, int64_t n_kv_heads,
                                         int64_t kh, int64_t heads, int64_t head_dim) {
    const int64_t size = f16 ? 2 : 4;
    col_prefetch_bytes((const uint8_t *)cache + col_cache_offset(pos, ring, n_kv_heads, kh, head_dim) * size,
                       heads * head_dim * size);
}

/* The body of col_attend_block (COL_ATTEND_BLOCK_STEPS: COL_ATTEND_WEIGHTS, then
 * COL_ATTEND_VALUES), expanded with a level's dot, axpy and exp_sum (function names or
 * pointers) over the parameters of col_attend_block_fn. Each key and value row is brought
 * into L1 once for all n queries instead of once per query (a prompt of 2048 tokens read each
 * row from memory about 2048 times), and the dot products of different queries overlap. Per
 * query the operations depend on nothing but that query: the dot products in key order, the
 * max, the exponentials and their sum (exp_sum), then the weighted values added in key order,
 * so each q[i].ov is bit for bit what the same level gives the query alone. Key
 * position s lives in row s % ring of a ring buffer (ring > 0), else in row s: the keys are
 * visited in position order either way, so a ring gives the same sums as a flat cache.
 * The rows are read through key_row and val_row (COL_KV_ROW_*), as row_t: float32 or float16
 * (kv_f16), the dot and axpy taking that type. */
#define COL_ATTEND_WEIGHTS(dot, exp_sum, row_t, key_row)                                                           \
    const int64_t Hd_ = head_dim, K_ = n_kv_heads;                                                                  \
    int64_t first_ = INT64_MAX, last_ = -1;                                                                         \
    float mx_[COL_ATTEND_BLOCK], inv_[COL_ATTEND_BLOCK];                                                            \
    int64_t kh_first_ = INT64_MAX, kh_last_ = -1; /* the kv heads read */                                          \
    for (int i = 0; i < n; i++) {                                                                                   \
        for (int64_t d = 0; d < Hd_; d++) q[i].ov[d] = 0.0f;                                                        \
        mx_[i] = -INFINITY;                                                                                         \
        if (q[i].hi < q[i].lo) continue;                                                                            \
        if (q[i].lo < first_) first_ = q[i].lo;                                                                     \
        if (q[i].hi > last_) last_ = q[i].hi;                                                                       \
        if (q[i].kh < kh_first_) kh_first_ = q[i].kh;                                                               \
        if (q[i].kh > kh_last_) kh_last_ = q[i].kh;                                                                 \
    }                                                                                                               \
    for (int64_t s = first_; s <= last_; s++) {                                                                     \
        if (s + COL_ATTEND_AHEAD <= last_) /* rows are K * Hd values apart: no stream to detect */                  \
            col_prefetch_kv_heads(keys, kv_f16, s + COL_ATTEND_AHEAD, ring, K_, kh_first_, kh_last_ - kh_first_ + 1, \
                                  Hd_);                                                                             \
        for (int i = 0; i < n; i++) {                                                                               \
            if (s < q[i].lo || s > q[i].hi) continue;                                                               \
            const row_t *ks = key_row(keys, s, ring, K_, q[i].kh, Hd_);                                             \
            const float score = dot(q[i].qv, ks, Hd_) * scale;                                                      \
            sc[i * stride + (s - q[i].lo)] = score;                                                                 \
            if (score > mx_[i]) mx_[i] = score;                                                                     \
        }                                                                                                           \
    }                                                                                                               \
    for (int i = 0; i < n; i++) {                                                                                   \
        if (q[i].hi < q[i].lo) continue;                                                                            \
        const float *sink = q[i].sink;                                                                              \
        if (sink && *sink > mx_[i]) mx_[i] = *sink;                                                                 \
        float sum = exp_sum(sc + i * stride, q[i].hi - q[i].lo + 1, mx_[i]);                                       \
        if (sink) sum += expf(*sink - mx_[i]); /* the sink's share of the denominator; it has no value */           \
        inv_[i] = 1.0f / sum;                                                                                       \
    }

/* Then the weighted values, added to each q[i].ov in key order. */
#define COL_ATTEND_VALUES(axpy, row_t, val_row)                                                                     \
    for (int64_t s = first_; s <= last_; s++)                                                                       \
        for (int i = 0; i < n; i++)                                                                                 \
            if (s >= q[i].lo && s <= q[i].hi)                                                                       \
                axpy(q[i].ov, sc[i * stride + (s - q[i].lo)] * inv_[i], val_row(vals, s, ring, K_, q[i].kh, Hd_), Hd_);

#define COL_ATTEND_BLOCK_STEPS(dot, axpy, exp_sum, row_t, row)                                                      \
    COL_ATTEND_WEIGHTS(dot, exp_sum, row_t, row)                                                                    \
    COL_ATTEND_VALUES(axpy, row_t, row)

/* The first key position a query at pos sees: the start of its sliding window (window > 0),
 * of its attention chunk (chunk > 0: pos - pos % chunk) and of what a ring of `ring` rows
 * still holds (ring > 0), whichever is latest; 0 when none applies. */
int64_t col_first_visible_key(int64_t pos, int64_t window, int64_t chunk, int64_t ring);

/* ---------------------------------------------------------------------------------------
 * Running work on the pool
 * ------------------------------------------------------------------------------------ */

/* One share of a job: called once with ith = 0..nth-1, concurrently. */
typedef void (*col_task_fn)(void *ctx, int ith, int nth);

/* Runs fn on every thread of the pool (share 0 on the caller) and returns when all are
 * done. pool NULL: fn(ctx, 0, 1) on the caller. */
void col_pool_run(col_pool *pool, col_task_fn fn, void *ctx);

/* A spin barrier for the nth threads of one job (phases inside one task). */
typedef struct {
    _Atomic int arrived;
    _Atomic int phase;
} col_barrier;

void col_barrier_wait(col_barrier *b, int nth);

/* The first phase of a fused layer step (attention_block.c, mla_block.c, deltanet_block.c),
 * run by each of the job's nth threads: its share of the T tokens of h (T, D) = rms_norm(x)
 * * norm, each quantized into hq (T, hq_bytes) when m (the first product's matrix) is an
 * integer type; then a barrier. */
void col_input_norm_phase(const col_matrix *m, col_barrier *barrier, int ith, int nth, int64_t T, int64_t D,
                          const float *x, const float *norm, float eps, float *h, uint8_t *hq, size_t hq_bytes);

/* The last phases of a fused attention step (attention_block.c, mla_block.c), run by each of
 * the job's nth threads: the attention output a (T, A) quantized for an integer wo (then a
 * barrier), then this thread's rows of o = a @ wo^T added, with bo (NULL: none), into the
 * residual x (T, D). aq (T, aq_bytes) and o (T, D) are scratch. */
void col_attention_output(const col_kernel_set *k, const col_matrix *mo, col_barrier *barrier, int ith, int nth,
                          int64_t T, int64_t D, int64_t A, const float *a, uint8_t *aq, size_t aq_bytes, float *o,
                          float *x, const float *bo);
/* col_attention_output with a post_norm (D) (Gemma's post-attention norm; NULL: none): each
 * token's whole o + bo is RMS-normed (eps) before the add, so a barrier separates the product
 * (rows split) from the norm and the add (tokens split). */
void col_attention_output_normed(const col_kernel_set *k, const col_matrix *mo, col_barrier *barrier, int ith, int nth,
                                 int64_t T, int64_t D, int64_t A, const float *a, uint8_t *aq, size_t aq_bytes,
                                 float *o, float *x, const float *bo, const float *post_norm, float eps);

/* [begin, end) of share ith of n items split as evenly as possible over nth. */
static inline void col_split(int64_t n, int ith, int nth, int64_t *begin, int64_t *end) {
    *begin = n * ith / nth;
    *end = n * (ith + 1) / nth;
}

/* 64-byte aligned scratch; NULL on failure. Free with col_free. */
void *col_alloc(size_t bytes);
void col_free(void *p);

/* ---------------------------------------------------------------------------------------
 * Small float matrix products of the linear-attention layers (deltanet_block.c)
 * ------------------------------------------------------------------------------------ */

/* Y = s Y + X M:  y[r * y_stride + j] = s * y[r * y_stride + j] + sum_i x[r * x_stride + i] * m[i * cols + j]
 * for r < n, j < cols, i < rows (m is (rows, cols), contiguous). Per element the sum starts
 * from s * y (from 0 when s == 0: y is then only written, so it may hold garbage) and adds
 * the rows in increasing i, so a row's result does not depend on n nor on the other rows.
 * Portable: a multiply and an add per term; SIMD levels: one fused multiply-add per term.
 * y must not overlap x or m. */
typedef void (*col_gemm_f32_fn)(float *y, int64_t y_stride, float s, const float *x, int64_t x_stride,
                                const float *m, int64_t n, int64_t rows, int64_t cols);

void col_gemm_f32_portable(float *y, int64_t y_stride, float s, const float *x, int64_t x_stride, const float *m,
                           int64_t n, int64_t rows, int64_t cols);

/* The SIMD versions of a level, NULL where the level has none or is not compiled in:
 * AVX2, AVX512 and AVX512_VNNI (simd_x86.c), NEON (simd_neon.c). */
col_gemm_f32_fn col_gemm_f32_x86(int level);
col_gemm_f32_fn col_gemm_f32_neon(void);

#endif /* COL_INTERNAL_H */
