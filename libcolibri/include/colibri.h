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
    COL_EIO       = 5, /* a read failed or came back short; the errno is in the result. */
    COL_ECHECKSUM = 6, /* a record's bytes do not match its crc32c. */
    COL_EBUSY     = 7, /* no slot is free or evictable: every slot is pinned or loading. */
    COL_ESYSTEM   = 8, /* the operating system refused a resource that was required (mmap,
                          mlock, hugetlb pages, O_DIRECT, a thread); the errno is reported in
                          the object's info struct or the function's errno output. */
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
 *   COL_TYPE_MXFP4   blocks of 32 values, 17 bytes (4.25 bits/value), the OCP MX FP4 type as
 *                    gpt-oss publishes it (and byte-identical to ggml's MXFP4 block):
 *                      uint8_t e;       e8m0 shared exponent: scale = 2^(e - 127)
 *                      uint8_t qs[16];  e2m1 codes; value j (0..15) in the LOW nibble of
 *                                       qs[j], value j + 16 in the HIGH nibble of qs[j]
 *                    value = e2m1(code) * 2^(e - 127), e2m1 codes 0..15 meaning
 *                    0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, -1, -1.5, -2, -3, -4, -6.
 *                    Decoding is exact in float32 for every byte (e = 255, NaN in the OCP
 *                    spec, decodes as 2^128 like ldexp: +-0 stays +-0, the rest overflows to
 *                    +-inf). The quantizer (not needed for published MXFP4 weights, which are
 *                    copied) tries the OCP exponent floor(log2(max|x|)) - 2 and the one above
 *                    it, rounds each value to the nearest code (ties to an even code,
 *                    saturating at +-6) and keeps the exponent with the lower squared error.
 * ------------------------------------------------------------------------------------ */
typedef enum {
    COL_TYPE_F32    = 0,
    COL_TYPE_F16    = 1,
    COL_TYPE_BF16   = 2,
    COL_TYPE_Q8_0   = 3,
    COL_TYPE_Q4_G64 = 4,
    COL_TYPE_MXFP4  = 5,
} col_type;

#define COL_TYPE_COUNT 6

/* Values per block: 1, 1, 1, 32, 64, 32 for the types above; -1 for an unknown type. */
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
 * COL_ERANGE: (q8_0, q4_g64, mxfp4 only) a block holds a NaN or inf, or (q8_0, q4_g64) a
 *   value too large for an f16 scale (|x| above ~65504); dst is partially written. */
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
 * Kernel selection (runtime CPU dispatch)
 *
 * Every compute entry point runs the kernels of the active level. At load the library picks
 * the best level the CPU supports; col_kernels_set forces another (tests and benchmarks use
 * COL_KERNELS_PORTABLE as the reference; colibrid.native reads $COLIBRI_KERNELS).
 *
 *   COL_KERNELS_PORTABLE     plain C, float32 activations: the reference semantics stated at
 *                            each entry point below.
 *   COL_KERNELS_AVX2         x86-64 AVX2 + FMA + F16C.
 *   COL_KERNELS_AVX512       AVX-512 F/BW/DQ/VL (512-bit integer dot products).
 *   COL_KERNELS_AVX512_VNNI  AVX-512 as above plus VNNI (vpdpbusd).
 *   COL_KERNELS_NEON         aarch64 Advanced SIMD.
 * On every SIMD level, products with q8_0 / q4_g64 / mxfp4 weights first quantize the
 * activations to int8 in blocks of the weight's block size (32 for q8_0 and mxfp4, 64 for
 * q4_g64; scale = max|x_block| / 127, kept in float32) and multiply in integers (mxfp4 codes
 * become the int8 values 2 x e2m1, -12..12, by table lookup; the scale 2^(e - 128) is applied
 * per block in float); each activation then
 * carries an error of at most half its block's step, max|x_block| / 254. f32 / f16 / bf16
 * weights always use float32 activations. A token's result never depends on the other
 * tokens of the call (nor on the pool's thread count): decode equals prefill bit for bit.
 * ------------------------------------------------------------------------------------ */
enum col_kernels {
    COL_KERNELS_PORTABLE    = 0,
    COL_KERNELS_AVX2        = 1,
    COL_KERNELS_AVX512      = 2,
    COL_KERNELS_AVX512_VNNI = 3,
    COL_KERNELS_NEON        = 4,
};
#define COL_KERNELS_COUNT 5

/* The active level (one of enum col_kernels). */
COL_API int col_kernels_get(void);

/* 1 if this CPU (and this build) can run `level`, else 0. */
COL_API int col_kernels_supported(int level);

/* Makes `level` active for the whole process. Not for use while another thread computes.
 * COL_EINVAL: unknown level. COL_ENOTSUP: this CPU cannot run it. Either way the active
 * level is unchanged. */
COL_API int col_kernels_set(int level);

/* "portable", "avx2", "avx512", "avx512_vnni", "neon"; "unknown" for anything else. Static. */
COL_API const char *col_kernels_name(int level);

/* ---------------------------------------------------------------------------------------
 * Worker pool
 *
 * A pool owns n_threads - 1 worker threads, started once by col_pool_create and each pinned
 * to one CPU; the thread that calls a compute entry point runs share 0 of the work itself
 * (it is the application's thread and is not re-pinned), so a call never waits for a wake-up
 * on the critical path. Between calls a worker spins for spin_us microseconds, then sleeps.
 * Every compute entry point takes a pool; NULL runs everything on the calling thread. Calls
 * on one pool from several threads are serialised.
 * ------------------------------------------------------------------------------------ */
typedef struct col_pool col_pool;

typedef struct col_pool_params {
    int32_t n_threads;   /* threads including the caller's; 0: one per CPU in cpus */
    int32_t n_cpus;      /* entries in cpus; 0: every CPU the process may use
                            (sched_getaffinity) */
    const int32_t *cpus; /* (n_cpus) CPU ids; worker i (1..n_threads-1) is pinned to
                            cpus[i % n_cpus] */
    int32_t spin_us;     /* how long an idle worker spins before it sleeps; < 0: default */
} col_pool_params;

/* sizeof(col_pool_params), for bindings that mirror the struct. */
COL_API size_t col_pool_params_size(void);

/* n_threads 0, every allowed CPU, default spin. */
COL_API col_pool_params col_pool_default_params(void);

/* Starts a pool. *out is set to the pool on COL_OK and to NULL otherwise.
 * COL_EINVAL: negative counts, a CPU id outside the process's affinity mask, cpus NULL with
 *   n_cpus > 0, or more than 1024 threads. COL_ENOMEM: allocation or thread creation failed
 *   (threads already started are stopped again). */
COL_API int col_pool_create(const col_pool_params *params, col_pool **out);

/* Stops and joins the workers and frees the pool. NULL is a no-op. The pool must be idle. */
COL_API void col_pool_destroy(col_pool *pool);

/* Threads of the pool including the caller's share; 1 for NULL. */
COL_API int col_pool_n_threads(const col_pool *pool);

/* The CPU worker `i` is pinned to (1 <= i < n_threads), -1 otherwise. */
COL_API int col_pool_worker_cpu(const col_pool *pool, int i);

/* ---------------------------------------------------------------------------------------
 * Conversion of checkpoint tensors on the pool (colibri-convert)
 * ------------------------------------------------------------------------------------ */

/* A checkpoint matrix as published: rows of `cols` elements of one of these source types.
 *   COL_SOURCE_F32, _F16, _BF16  IEEE binary32 / binary16 / bfloat16, widened exactly.
 *   COL_SOURCE_F8_E4M3           float8_e4m3fn codes (bias 7, 0x7f / 0xff are NaN), each value
 *                                multiplied by its block's scale_inv, a float32 product rounded
 *                                once (DeepSeek-V3's weight_scale_inv; NULL scale_inv: 1).
 * Output row i is source row row0 + i * row_step (row_step 2 picks the even or odd rows of an
 * interleaved gate/up tensor; the block scales are those of the source row). */
enum col_source_dtype {
    COL_SOURCE_F32 = 0,
    COL_SOURCE_F16 = 1,
    COL_SOURCE_BF16 = 2,
    COL_SOURCE_F8_E4M3 = 3,
};

typedef struct col_source_matrix {
    int32_t dtype;            /* enum col_source_dtype */
    int32_t reserved;         /* 0 */
    const void *data;         /* (n_src_rows, cols) elements, rows contiguous, any alignment */
    int64_t n_src_rows;       /* rows of data */
    int64_t row0, row_step;   /* output row i reads source row row0 + i * row_step (step >= 1) */
    const float *scale_inv;   /* F8_E4M3 only, or NULL: (ceil(n_src_rows / block_rows),
                                 ceil(cols / block_cols)) float32, one factor per block */
    int64_t block_rows, block_cols; /* > 0 when scale_inv is set */
} col_source_matrix;

/* sizeof(col_source_matrix), for bindings that mirror the struct. */
COL_API size_t col_source_matrix_size(void);

/* dst = col_quantize(type, decode(src)) for `rows` output rows of `cols` values, the rows
 * split over the pool; every row's bytes equal col_quantize's on the decoded row, whatever
 * the thread count or kernel level. Decoding is fused: no float32 copy of the matrix is made
 * (each thread holds one decoded row).
 *   dst: (rows, row_bytes(type, cols)) bytes
 * COL_EINVAL: bad type / sizes / NULL, a source row out of range, a bad dtype or block;
 *   dst untouched. COL_ENOMEM: a row buffer could not be allocated.
 * COL_ERANGE: as col_quantize (an F8 NaN code included); dst is partially written. */
COL_API int col_convert(col_pool *pool, const col_source_matrix *src, int64_t rows, int64_t cols, int type,
                        void *dst);

/* ---------------------------------------------------------------------------------------
 * Matrix product
 * ------------------------------------------------------------------------------------ */

/* y[t, o] = sum_i w[o, i] * x[t, i]   (y = x @ w^T), output rows split across the pool.
 *   w: (n_out, row_bytes(type, n_in)) bytes, any alignment
 *   x: (n_tok, n_in) float32
 *   y: (n_tok, n_out) float32, must not overlap x or w
 * n_out and n_tok are arbitrary; n_in must be a multiple of the type's block.
 * Portable level: accumulates in float32, each block (32 values for f32/f16/bf16/q8_0/mxfp4,
 * 64 for q4_g64) summed on its own, then added to the row total. SIMD levels: see
 * "Kernel selection" (int8 activations for q8_0 / q4_g64 / mxfp4).
 * COL_EINVAL: bad type / sizes / NULL; y untouched. COL_ENOMEM: scratch allocation failed;
 * y untouched. */
COL_API int col_matmul(col_pool *pool, int type, const void *w, int64_t n_out, int64_t n_in,
                       const float *x, int64_t n_tok, float *y);

/* ---------------------------------------------------------------------------------------
 * Fused routed experts: one call per MoE layer step
 * ------------------------------------------------------------------------------------ */

/* For every selected expert e (0 <= e < n_experts) and every (token t, slot a) routed to it
 * (expert_of[t, a] == e):
 *     h        = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T)      (F)
 *     out[t]  += weight[t, a] * (h @ down_e^T)                 (D)
 * Experts are added to out[t] in increasing e. All experts share one type.
 *   gate, up:  (n_experts) pointers, each (F, row_bytes(type, D)) bytes
 *   down:      (n_experts) pointers, each (D, row_bytes(type, F)) bytes
 *   x:         (n_tok, D) float32
 *   expert_of: (n_tok, n_slots) int32 in [0, n_experts), or -1 for "no expert"
 *   weight:    (n_tok, n_slots) float32
 *   out:       (n_tok, D) float32, accumulated into (must not overlap the inputs)
 * D and F must be multiples of the type's block.
 * COL_EINVAL: bad type, sizes, NULL pointers or an expert_of entry out of range; out
 *   untouched. COL_ENOMEM: scratch allocation failed; out untouched. */
COL_API int col_moe_experts(col_pool *pool, int type, int64_t n_experts, const void *const *gate,
                            const void *const *up, const void *const *down, int64_t dim,
                            int64_t ffn, const float *x, int64_t n_tok, const int32_t *expert_of,
                            const float *weight, int64_t n_slots, float *out);

/* The expert activation (col_expert_ffn.activation). */
enum col_expert_activation {
    COL_ACT_SWIGLU         = 0, /* h = silu(g) * u, silu(g) = g / (1 + exp(-g)) */
    COL_ACT_CLAMPED_SWIGLU = 1, /* gpt-oss: g = min(g, limit), u = clamp(u, -limit, limit),
                                   h = (u + 1) * (g * sigmoid(alpha * g)) */
    COL_ACT_GELU_TANH      = 2, /* Gemma 4: h = gelu_tanh(g) * u (see col_gelu_tanh_mul) */
};

/* What an expert's feed-forward computes beyond col_moe_experts' plain SwiGLU: the activation
 * and per-expert biases of the three products (gpt-oss). */
typedef struct col_expert_ffn {
    int32_t activation;            /* enum col_expert_activation */
    float alpha;                   /* CLAMPED_SWIGLU: the sigmoid's gain (gpt-oss: 1.702) */
    float limit;                   /* CLAMPED_SWIGLU: the clamp, > 0 (gpt-oss: 7) */
    int32_t reserved;              /* 0 */
    const float *const *gate_bias; /* (n_experts) pointers, each (F) float32; or NULL: no biases */
    const float *const *up_bias;   /* (n_experts) each (F); NULL exactly when gate_bias is */
    const float *const *down_bias; /* (n_experts) each (D); NULL exactly when gate_bias is */
    int32_t weight_on_input;       /* 1: the routing weight scales the expert's input, and its
                                      output is added unweighted (Llama 4):
                                      out[t] += ffn_e(weight[t, a] * x[t]); 0: as below */
    int32_t reserved2;             /* 0 */
} col_expert_ffn;

/* sizeof(col_expert_ffn), for bindings that mirror the struct. */
COL_API size_t col_expert_ffn_size(void);

/* col_moe_experts with the expert feed-forward `ffn_kind` describes (NULL: plain SwiGLU, no
 * biases, exactly col_moe_experts):
 *     g = x[t] @ gate_e^T + gate_bias_e,  u = x[t] @ up_e^T + up_bias_e      (F)
 *     h = activation(g, u)                                                    (F)
 *     out[t] += weight[t, a] * (h @ down_e^T + down_bias_e)                   (D)
 * With weight_on_input, x[t] above is the float32 product weight[t, a] * x[t] (quantized per
 * assignment on the integer levels, as any input row) and the output is added with weight 1.
 * The activation is computed elementwise in float32 on every level (expf). Arguments and
 * errors as col_moe_experts; also COL_EINVAL for an unknown activation, a limit that is not
 * > 0 or finite, a non-finite alpha, or bias pointers missing for some expert. */
COL_API int col_moe_experts_ffn(col_pool *pool, const col_expert_ffn *ffn_kind, int type, int64_t n_experts,
                                const void *const *gate, const void *const *up, const void *const *down,
                                int64_t dim, int64_t ffn, const float *x, int64_t n_tok,
                                const int32_t *expert_of, const float *weight, int64_t n_slots, float *out);

/* ---------------------------------------------------------------------------------------
 * Small dense steps
 * ------------------------------------------------------------------------------------ */

/* RMSNorm over rows: y[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps), float32 throughout.
 *   x, y: (rows, n) float32 (y may equal x); weight: (n) float32.
 * COL_EINVAL: negative sizes or NULL buffers; y untouched. */
COL_API int col_rms_norm(const float *x, const float *weight, int64_t rows, int64_t n, float eps,
                         float *y);

/* A sampler's draw by inverting a cumulative distribution, in place:
 *   c: (n) float64 probabilities (>= 0), replaced by their running sums, added in order
 *   (c[i] = c[i-1] + c[i]: numpy's cumsum, bit for bit); *position = the number of running
 *   sums <= u * c[n-1] (numpy's searchsorted(c, u * c[-1], side="right")), in 0..n.
 * COL_EINVAL: n < 1 or NULL buffers; c untouched. */
COL_API int col_draw_cumulative(double *c, int64_t n, double u, int64_t *position);

/* Rotary embedding, rotate-half convention, in place:
 *   x: (n_tok, n_heads, head_dim) float32; cos, sin: (n_tok, head_dim) float32.
 *   x[t,h,i] = x[t,h,i] * cos[t,i] + r[t,h,i] * sin[t,i], r = (-x[half:], x[:half]).
 * COL_EINVAL: odd head_dim, negative sizes or NULL buffers; x untouched. */
COL_API int col_rope(float *x, int64_t n_tok, int64_t n_heads, int64_t head_dim, const float *cos,
                     const float *sin);

/* Partial rotary embedding (GLM-4.5's partial_rotary_factor), in place: the first rotary_dim
 * dims of each head rotate as col_rope rotates a head of rotary_dim dims; the other
 * head_dim - rotary_dim dims pass through. col_rope is this with rotary_dim = head_dim.
 *   x: (n_tok, n_heads, head_dim) float32; cos, sin: (n_tok, rotary_dim) float32.
 * COL_EINVAL: odd rotary_dim, rotary_dim > head_dim, negative sizes or NULL buffers; x untouched. */
COL_API int col_rope_partial(float *x, int64_t n_tok, int64_t n_heads, int64_t head_dim, int64_t rotary_dim,
                             const float *cos, const float *sin);

/* SwiGLU's elementwise step, as the fused expert call computes it on the active level:
 * h[i] = g[i] / (1 + exp(-g[i])) * u[i]. Portable: expf; AVX-512 levels: a vectorized exp
 * within 2 ulp of expf (inf and 0 at the ends, NaN stays NaN).
 *   g, u, h: (n) float32 (h may equal g or u).
 * COL_EINVAL: negative n or NULL buffers; h untouched. */
COL_API int col_silu_mul(const float *g, const float *u, float *h, int64_t n);

/* GeGLU's elementwise step with the tanh-approximated GELU (transformers' gelu_pytorch_tanh),
 * as the fused expert call computes it on the active level:
 * h[i] = 0.5 g (1 + tanh(y)) u[i] = g / (1 + exp(-2y)) * u[i], y = sqrt(2/pi) (g + 0.044715 g^3)
 * (the sigmoid form: no cancellation where tanh(y) nears -1). Portable: expf; AVX-512 levels:
 * the vectorized exp of col_silu_mul. NaN stays NaN; g = +inf gives +inf * u, g = -inf NaN
 * (-inf / inf; torch's tanh form gives -inf * 0).
 *   g, u, h: (n) float32 (h may equal g or u).
 * COL_EINVAL: negative n or NULL buffers; h untouched. */
COL_API int col_gelu_tanh_mul(const float *g, const float *u, float *h, int64_t n);

/* Causal grouped-query attention of n_q query tokens over n_keys cached keys, heads split
 * across the pool:
 *   q:         (n_q, n_heads, head_dim) float32
 *   keys, vals:(n_keys, n_kv_heads, head_dim) float32 (the KV cache, new tokens included)
 *   positions: (n_q) int64; query t sees key j iff j <= positions[t] and (window <= 0 or
 *              positions[t] - j < window) and (chunk <= 0 or j >= positions[t] - positions[t] % chunk)
 *   ring:      0: key j is row j of keys/vals (n_keys rows); > 0: keys/vals are a ring buffer
 *              of ring == n_keys rows, key j in row j % ring, and query t sees at most the last
 *              ring keys up to positions[t] (the caller keeps those in the ring)
 *   out:       (n_q, n_heads * head_dim) float32
 * softmax(scale * q k^T) v in float32 with a max-shifted softmax. n_heads must be a
 * multiple of n_kv_heads. A query that sees no key gets zeros.
 * COL_EINVAL: bad sizes or NULL buffers; out untouched. COL_ENOMEM: scratch; out untouched. */
COL_API int col_attention(col_pool *pool, const float *q, const float *keys, const float *vals,
                          int64_t n_q, int64_t n_keys, int64_t n_heads, int64_t n_kv_heads,
                          int64_t head_dim, const int64_t *positions, int64_t window, int64_t chunk,
                          int64_t ring, float scale, float *out);

/* ---------------------------------------------------------------------------------------
 * Fused decoder steps: one call per attention step, one per routing decision
 * ------------------------------------------------------------------------------------ */

enum col_qk_norm {
    COL_QK_NORM_NONE = 0, /* no q/k normalisation */
    COL_QK_NORM_FULL = 1, /* RMSNorm over all heads of a token: q (H * Hd), k (K * Hd) */
    COL_QK_NORM_HEAD = 2, /* RMSNorm over each head: q and k (Hd) */
    COL_QK_NORM_HEAD_AFTER_ROPE = 3, /* as HEAD, but after RoPE (Llama 4's L2 norm: weights of ones) */
};

/* One layer's attention weights and shape, set up once and passed to every step. Weights
 * are only read, during each call. Shapes: D dim, H n_heads, K n_kv_heads, Hd head_dim. */
typedef struct col_attention_layer {
    int64_t dim;          /* D */
    int64_t n_heads;      /* H, a multiple of K */
    int64_t n_kv_heads;   /* K */
    int64_t head_dim;     /* Hd, even */
    int64_t window;       /* sliding window in tokens; <= 0: full causal */
    float eps;            /* RMSNorm epsilon of the input norm and the q/k norms */
    float scale;          /* softmax scale, usually Hd^-0.5 */
    float clip_qkv;       /* > 0: q, k, v clamped to [-clip_qkv, clip_qkv]; 0: no clamp */
    int32_t qk_norm;      /* enum col_qk_norm */
    int32_t qkv_type;     /* type of wq, wk, wv (one type: one activation quantization) */
    int32_t o_type;       /* type of wo */
    const float *norm;    /* (D) input RMSNorm weight */
    const void *wq;       /* (H * Hd, row_bytes(qkv_type, D)) */
    const void *wk;       /* (K * Hd, row_bytes(qkv_type, D)) */
    const void *wv;       /* (K * Hd, row_bytes(qkv_type, D)) */
    const void *wo;       /* (D, row_bytes(o_type, H * Hd)) */
    const float *bq;      /* (H * Hd) or NULL */
    const float *bk;      /* (K * Hd) or NULL */
    const float *bv;      /* (K * Hd) or NULL */
    const float *bo;      /* (D) or NULL */
    const float *q_norm;  /* FULL: (H * Hd), HEAD: (Hd); NULL with COL_QK_NORM_NONE */
    const float *k_norm;  /* FULL: (K * Hd), HEAD: (Hd); NULL with COL_QK_NORM_NONE */
    int64_t rotary_dim;   /* Hr: leading dims of each head RoPE rotates, even, <= Hd; 0: all Hd */
    const float *sinks;   /* (H) learned per-head sink logits (gpt-oss), or NULL: none. A sink is
                             one more logit in its head's softmax denominator, with no value */
    int64_t chunk;        /* chunked local attention (Llama 4): a query at position p sees keys
                             from p - p % chunk on; <= 0: none */
    const void *wg;       /* (H * Hd, row_bytes(qkv_type, D)) output gate (Qwen3.5, Qwen3-Next), or
                             NULL: none. The attention output is multiplied by sigmoid(h wg^T) */
    /* Llama 4; all 0 (off) for the other families */
    int32_t rope_interleaved; /* 1: RoPE turns interleaved pairs (x0, x1), (x2, x3) ... of each head's
                                 rotated dims (Llama 4's complex rotary) instead of (x_i, x_i+Hr/2);
                                 pair i by the angle of cos/sin column i */
    int32_t no_rope;      /* 1: no RoPE on this layer (a NoPE layer); cos and sin are not read */
    float temp_floor;     /* > 0: attention temperature tuning: the query of position p is multiplied by
                             log1p(floor((p + 1) / temp_floor)) * temp_scale + 1; 0: off */
    float temp_scale;
    const float *v_norm;  /* (Hd) RMSNorm weight of each value head before it is cached (Gemma 4,
                             whose v norm has no weight: pass ones), or NULL: none */
    const float *post_norm; /* (D) RMSNorm weight of the attention output before the residual
                               add (Gemma's post-attention norm), or NULL: none */
} col_attention_layer;

/* sizeof(col_attention_layer), for bindings that mirror the struct. */
COL_API size_t col_attention_layer_size(void);

/* A whole attention step of n_tok new tokens at positions n_past .. n_past + n_tok - 1,
 * residual included, in one pool job:
 *     h = rms_norm(x) * norm
 *     q = h wq^T + bq,  k = h wk^T + bk,  v = h wv^T + bv
 *     FULL: q, k = rms_norm(q) * q_norm, rms_norm(k) * k_norm
 *     clip: q, k, v clamped to [-clip_qkv, clip_qkv]
 *     HEAD: each head of q, k = rms_norm(head) * q_norm / k_norm
 *     v_norm: each head of v = rms_norm(head) * v_norm
 *     q, k = rope(q, cos, sin), rope(k, cos, sin)   (the first Hr dims of each head, in pairs
 *         with rope_interleaved; not at all with no_rope)
 *     HEAD_AFTER_ROPE: each head of q, k = rms_norm(head) * q_norm / k_norm
 *     temperature: q[t] *= log1p(floor((n_past + t + 1) / temp_floor)) * temp_scale + 1
 *     keys[n_past + t], vals[n_past + t] = k[t], v[t]   (row (n_past + t) % ring_rows of a ring)
 *     a = attention(q, keys[0 : n_past + n_tok], vals, positions n_past + t, window, chunk, scale)
 *         with sinks: head h's softmax also holds the logit sinks[h] (unscaled, never masked):
 *         m = max(max_s scale q.k_s, sinks[h]), p_s = exp(scale q.k_s - m) /
 *         (sum_s exp(scale q.k_s - m) + exp(sinks[h] - m)), a = sum_s p_s v_s
 *     gate: a = a * sigmoid(h wg^T)     (1 / (1 + expf(-g)), elementwise)
 *     x += a wo^T + bo                 (post_norm: x += rms_norm(a wo^T + bo) * post_norm)
 * each step with the arithmetic of col_rms_norm, col_matmul, col_rope and col_attention, so
 * the result equals that sequence of calls (and numpy's float32 adds and clamps) bit for bit.
 *   x:          (n_tok, D) float32, read and updated in place
 *   cos, sin:   (n_tok, Hr) float32, the rotary tables of the new tokens (Hr = rotary_dim or Hd)
 *   keys, vals: the layer's KV cache, float32: (>= n_past + n_tok, K, Hd) with ring_rows 0, rows
 *               n_past .. n_past + n_tok - 1 written and rows before read; or a ring buffer of
 *               (ring_rows, K, Hd), key position p in row p % ring_rows. A ring must hold every
 *               key a new token sees after the new keys are written: ring_rows >= span + n_tok
 *               - 1, span the layer's window or chunk (COL_EINVAL otherwise, or without either)
 * COL_EINVAL: bad sizes, types or NULL pointers; nothing written. COL_ENOMEM: scratch
 * allocation failed; nothing written. */
COL_API int col_attention_block(col_pool *pool, const col_attention_layer *layer, float *x, int64_t n_tok,
                                const float *cos, const float *sin, float *keys, float *vals,
                                int64_t n_past, int64_t ring_rows);

/* One sequence's part of a batched attention step: its cache (as col_attention_block's keys,
 * vals, n_past and ring_rows, of kv_type's values) and how many of the step's rows are its,
 * in order. */
typedef struct col_attention_seq {
    void *keys;
    void *vals;
    int64_t n_past;
    int64_t n_tok;
    int64_t ring_rows;
    int32_t kv_type;  /* COL_TYPE_F32, or COL_TYPE_F16 (head_dim <= 1024): each new key and value
                         is rounded to float16 (nearest even) as it is stored, and read back
                         exactly, so a step gives the bits of a float32 cache holding the same
                         rounded values; half the memory and half the reads */
    int32_t reserved; /* 0 */
} col_attention_seq;

/* sizeof(col_attention_seq), for bindings to check their mirror of it */
COL_API size_t col_attention_seq_size(void);

/* col_attention_block over the rows of several sequences at once: x (T, D) holds seqs[0]'s
 * n_tok rows, then seqs[1]'s ..., cos and sin (T, Hr) their rotary tables. The q/k/v and
 * output products run once over all T rows (each row computed as if alone, so every row
 * gets the bits col_attention_block gives it); each row attends over its own sequence's cache.
 * col_attention_block is this with one sequence. Errors as there, for any sequence. */
COL_API int col_attention_block_batch(col_pool *pool, const col_attention_layer *layer, float *x,
                                      const float *cos, const float *sin, const col_attention_seq *seqs,
                                      int64_t n_seqs);

/* One layer's multi-head latent attention (DeepSeek-V2/V3, Kimi K2), set up once and passed
 * to every step. Weights are only read, during each call. Shapes: D dim, H n_heads, Cq q_rank,
 * C kv_rank, N nope_dim, R rope_dim, Vd v_dim, L = C + R. */
typedef struct col_mla_layer {
    int64_t dim;            /* D */
    int64_t n_heads;        /* H */
    int64_t q_rank;         /* Cq: q = (rms_norm(h wq_a^T) * q_a_norm) wq_b^T; 0: q = h wq^T */
    int64_t kv_rank;        /* C: the latent's width */
    int64_t nope_dim;       /* N: dims of each q/k head without RoPE (first in the head) */
    int64_t rope_dim;       /* R: dims of each q/k head with RoPE (last in the head), even */
    int64_t v_dim;          /* Vd: dims of each value head */
    float eps;              /* RMSNorm epsilon of the input, q_a and kv_a norms */
    float scale;            /* softmax scale ((N + R)^-0.5 times any YaRN mscale^2) */
    int32_t rope_interleaved; /* 1: each rope part holds interleaved pairs (DeepSeek's layout) */
    int32_t in_type;        /* type of wq_a (or wq) and wkv_a: one activation quantization */
    int32_t qb_type;        /* type of wq_b (q_rank > 0) */
    int32_t kvb_type;       /* type of wkv_b */
    int32_t o_type;         /* type of wo */
    int32_t reserved;
    const float *norm;      /* (D) input RMSNorm weight */
    const void *wq_a;       /* (Cq, row_bytes(in_type, D)), q_rank > 0 */
    const float *q_a_norm;  /* (Cq), q_rank > 0 */
    const void *wq_b;       /* (H * (N + R), row_bytes(qb_type, Cq)), q_rank > 0 */
    const void *wq;         /* (H * (N + R), row_bytes(in_type, D)), q_rank == 0 */
    const void *wkv_a;      /* (C + R, row_bytes(in_type, D)) */
    const float *kv_a_norm; /* (C) */
    const void *wkv_b;      /* (H * (N + Vd), row_bytes(kvb_type, C)): per head N key rows, Vd value rows */
    const void *wo;         /* (D, row_bytes(o_type, H * Vd)) */
    const float *bo;        /* (D) or NULL */
} col_mla_layer;

/* sizeof(col_mla_layer), for bindings that mirror the struct. */
COL_API size_t col_mla_layer_size(void);

/* A whole latent-attention step of n_tok new tokens at positions n_past .. n_past + n_tok - 1,
 * residual included, in one pool job (see mla_block.c for the arithmetic):
 *     h = rms_norm(x) * norm;  q = (H, N + R) per token as above;  kv = h wkv_a^T
 *     cache[n_past + t] = [rms_norm(kv[:C]) * kv_a_norm, rope(kv[C:])]
 *     per head j: attention of [Wk_j^T q_nope, rope(q_rope)] over cache[0 : n_past + t + 1]
 *                 (causal), its latent output multiplied by Wv_j
 *     x += a wo^T + bo
 * RoPE rotates R dims (rotate-half; after de-interleaving pairs when rope_interleaved), so
 * the cache holds the rope key in that rotated layout.
 *   x:        (n_tok, D) float32, read and updated in place
 *   cos, sin: (n_tok, R) float32, the rotary tables of the new tokens
 *   cache:    (>= n_past + n_tok, C + R) float32, the layer's latent cache; rows n_past ..
 *             n_past + n_tok - 1 are written, rows before are read
 * Each (token, head) is computed on its own: the result does not depend on the thread count
 * or on how a sequence is split into calls.
 * COL_EINVAL: bad sizes, types or NULL pointers; nothing written. COL_ENOMEM: scratch
 * allocation failed; nothing written. */
COL_API int col_mla_block(col_pool *pool, const col_mla_layer *layer, float *x, int64_t n_tok, const float *cos,
                          const float *sin, float *cache, int64_t n_past);

/* One Gated DeltaNet layer (the linear-attention layers of Qwen3.5-MoE and Qwen3-Next), set up
 * once and passed to every step. Weights are only read, during each call. Shapes: D dim, Hk
 * n_k_heads, Hv n_v_heads, Dk k_head_dim, Dv v_head_dim, Kc conv_kernel, C = 2 Hk Dk + Hv Dv
 * (the conv channels: q heads | k heads | v heads). */
typedef struct col_deltanet_layer {
    int64_t dim;             /* D */
    int64_t n_k_heads;       /* Hk: q/k heads */
    int64_t n_v_heads;       /* Hv: value heads, a multiple of Hk; value head h reads q/k head
                                h / (Hv / Hk) (transformers' repeat_interleave) */
    int64_t k_head_dim;      /* Dk */
    int64_t v_head_dim;      /* Dv */
    int64_t conv_kernel;     /* Kc >= 1: taps of the causal depthwise conv */
    float eps;               /* epsilon of the input RMSNorm */
    float norm_eps;          /* epsilon of the gated output RMSNorm */
    int32_t in_type;         /* type of wqkv, wz, wb, wa (one activation quantization) */
    int32_t o_type;          /* type of wo */
    const float *norm;       /* (D) input RMSNorm weight (plain: y = norm * x / rms) */
    const void *wqkv;        /* (C, row_bytes(in_type, D)) in_proj_qkv */
    const void *wz;          /* (Hv * Dv, row_bytes(in_type, D)) in_proj_z: the output gate */
    const void *wb;          /* (Hv, row_bytes(in_type, D)) in_proj_b: beta = sigmoid(b) */
    const void *wa;          /* (Hv, row_bytes(in_type, D)) in_proj_a: the decay's input */
    const float *conv;       /* (C, Kc) depthwise conv taps, the last one on the newest token */
    const float *conv_bias;  /* (C) or NULL */
    const float *A_log;      /* (Hv) */
    const float *dt_bias;    /* (Hv) */
    const float *gate_norm;  /* (Dv) weight of the gated RMSNorm */
    const void *wo;          /* (D, row_bytes(o_type, Hv * Dv)) out_proj */
} col_deltanet_layer;

/* sizeof(col_deltanet_layer), for bindings that mirror the struct. */
COL_API size_t col_deltanet_layer_size(void);

/* A whole Gated DeltaNet step of n_tok new tokens of one sequence, residual included, in one
 * pool job (see deltanet_block.c for the phases and the chunked form):
 *     h = rms_norm(x) * norm
 *     qkv = h wqkv^T (C),  z = h wz^T (Hv, Dv),  b = h wb^T (Hv),  a = h wa^T (Hv)
 *     qkv = silu(conv_bias + sum_j conv[:, j] * qkv at token t - (Kc - 1) + j), the tokens
 *           before this call taken from conv_state
 *     per value head h (q, k of head h / (Hv / Hk)):
 *         q = l2norm(q) * Dk^-0.5,  k = l2norm(k)   (l2norm(v) = v / sqrt(sum v^2 + 1e-6))
 *         beta = sigmoid(b_h),  g = -exp(A_log_h) * softplus(a_h + dt_bias_h)
 *         S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q      (S: (Dk, Dv))
 *         o = rms_norm(o) * gate_norm * silu(z_h)      (norm_eps)
 *     x += o wo^T
 * n_tok == 1 runs that recurrence; n_tok > 1 its chunked form (chunks of 64 tokens, as
 * transformers' torch_chunk_gated_delta_rule): the same function in another order of float
 * operations, so a prompt and the same tokens one call each agree within float rounding, not
 * bit for bit. The thread count never changes a result.
 *   x:               (n_tok, D) float32, read and updated in place
 *   conv_state:      (Kc - 1, C) float32, the pre-conv qkv rows of the sequence's last Kc - 1
 *                    tokens, oldest first (zeros for a new sequence); updated in place. May be
 *                    NULL when Kc == 1.
 *   recurrent_state: (Hv, Dk, Dv) float32, S of every value head (zeros for a new sequence);
 *                    updated in place
 * COL_EINVAL: bad sizes, types or NULL pointers; nothing written. COL_ENOMEM: scratch
 * allocation failed; nothing written. */
COL_API int col_deltanet_block(col_pool *pool, const col_deltanet_layer *layer, float *x, int64_t n_tok,
                               float *conv_state, float *recurrent_state);

/* Router of a MoE layer step: logits = x @ router^T (as col_matmul), then per token a
 * float32 softmax over the n_experts logits, the top_k most probable experts (ties: the
 * lower index first) best first, and their probabilities, renormalised to sum to 1 if
 * `normalize`.
 *   router:  (n_experts, row_bytes(type, D)) bytes
 *   x:       (n_tok, D) float32
 *   experts: (n_tok, top_k) int32 out;  weights: (n_tok, top_k) float32 out
 * COL_EINVAL: bad sizes (top_k must be in 1..n_experts), type or NULL; outputs untouched.
 * COL_ENOMEM: scratch; outputs untouched. */
COL_API int col_moe_route(col_pool *pool, int type, const void *router, int64_t n_experts, int64_t dim,
                          const float *x, int64_t n_tok, int64_t top_k, int normalize, int32_t *experts,
                          float *weights);

/* How a router scores experts (col_moe_router.scoring). */
enum col_router_scoring {
    COL_ROUTER_SOFTMAX = 0, /* softmax over the n_experts logits */
    COL_ROUTER_SIGMOID = 1, /* sigmoid of each logit on its own (DeepSeek-V3, GLM-4.5) */
    COL_ROUTER_TOPK_SOFTMAX = 2, /* the top_k logits chosen first, then a softmax over those
                                    only (gpt-oss): the weights sum to 1 without `normalize` */
    COL_ROUTER_TOPK_SIGMOID = 3, /* the top_k logits chosen first, then the sigmoid of each
                                    chosen one (Llama 4) */
};

/* How a group of experts is scored for the group limit (col_moe_router.group_score). */
enum col_group_score {
    COL_GROUP_SCORE_MAX = 0,      /* its best expert's choice score (DeepSeek-V2) */
    COL_GROUP_SCORE_TOP2_SUM = 1, /* the sum of its best two (DeepSeek-V3, GLM-4.5) */
};

/* One MoE layer's router, set up once and passed to every step. Shapes: D dim, E n_experts,
 * G n_groups (experts e of group e / (E / G)), A top_k. */
typedef struct col_moe_router {
    int64_t n_experts;        /* E */
    int64_t dim;              /* D */
    int64_t top_k;            /* A, 1 .. groups_kept * E / G */
    int64_t n_groups;         /* G, divides E; 1: no group limit */
    int64_t groups_kept;      /* groups whose experts may be chosen, 1 .. G */
    int32_t type;             /* type of weight */
    int32_t scoring;          /* enum col_router_scoring */
    int32_t group_score;      /* enum col_group_score (used when groups_kept < G) */
    int32_t normalize;        /* 1: the A weights renormalised to sum 1 */
    float scaling;            /* the weights times this (routed_scaling_factor), finite */
    const void *weight;       /* (E, row_bytes(type, D)) */
    const float *choice_bias; /* (E) added to the scores for choosing only, or NULL */
    const float *logit_bias;  /* (E) added to the logits before anything else (gpt-oss's
                                 router bias), or NULL */
    const float *expert_scale; /* (E) each chosen expert's weight times its entry, after
                                  normalize and before scaling (Gemma 4's per_expert_scale),
                                  or NULL */
} col_moe_router;

/* sizeof(col_moe_router), for bindings that mirror the struct. */
COL_API size_t col_moe_router_size(void);

/* Routing of a MoE layer step for every token: logits = x @ weight^T (as col_matmul)
 * + logit_bias (if given), then per token
 *     s      = softmax(logits) or sigmoid(logits)                 (E)
 *              (TOPK_SOFTMAX: s = logits; the weights below are then the softmax of the
 *              chosen experts' s, before normalize and scaling; TOPK_SIGMOID: s = logits,
 *              the weights the sigmoid of each chosen s)
 *     c      = s + choice_bias (or s)                             (E)
 *     if groups_kept < G: keep the groups_kept best groups by group_score of c; the experts
 *            of the other groups cannot be chosen
 *     experts[t] = the top_k allowed experts by c, best first
 *     weights[t] = s[experts[t]], / (their sum + 1e-20) if normalize,
 *                  * expert_scale[experts[t]] if given, * scaling
 * Every choice prefers the larger value and, on equal values, the lower index. col_moe_route
 * is this with softmax scoring, no bias, one group and scaling 1.
 *   x:       (n_tok, D) float32
 *   experts: (n_tok, top_k) int32 out;  weights: (n_tok, top_k) float32 out
 * COL_EINVAL: bad sizes, type, enum values or NULL pointers; outputs untouched.
 * COL_ENOMEM: scratch; outputs untouched. */
COL_API int col_moe_router_route(col_pool *pool, const col_moe_router *router, const float *x, int64_t n_tok,
                                 int32_t *experts, float *weights);

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

/* ---------------------------------------------------------------------------------------
 * The Active Expert Page Cache (AEPC): slab pool, loader, expert cache
 *
 * Routed experts stream from the pack's experts file into a slab pool of fixed slots, one
 * expert record per slot.
 *
 *   col_slab          one region of n_slots * slot_bytes, hugepage-backed and locked when
 *                     possible, with a free map of slots.
 *   col_loader        O_DIRECT reads of whole records into caller memory by a pool of I/O
 *                     threads, at most queue_depth in flight, every record's crc32c checked.
 *   col_expert_cache  (layer, expert) -> slot over a slab and a loader: acquire pins experts
 *                     and starts the reads of the misses, wait blocks until they are loaded,
 *                     release unpins. Eviction never touches a pinned slot.
 *
 * The handles are opaque; every object is made by *_create and freed by *_destroy. All
 * functions of one object may be called from several threads at once. The Python side is
 * colibrid/native/aepc.py (the ctypes bindings) and colibrid/engine/experts/cache.py.
 * These functions add the status codes COL_EIO, COL_ECHECKSUM, COL_EBUSY and COL_ESYSTEM.
 * ------------------------------------------------------------------------------------ */

/* Dimension letters: S slots, L layers, E experts per layer, N experts named in a call. */

/* ---- the slab pool (col_slab; col_pool is the compute worker pool) ---- */

typedef struct col_slab col_slab;

enum col_aepc_mode {
    COL_MODE_OFF      = 0, /* do not try */
    COL_MODE_TRY      = 1, /* try; on failure fall back and report it in col_slab_info */
    COL_MODE_REQUIRED = 2, /* try; on failure col_slab_create fails with COL_ESYSTEM */
};

enum col_slab_backing {
    COL_BACKING_PAGES   = 0, /* ordinary 4 KiB pages */
    COL_BACKING_THP     = 1, /* ordinary mapping advised MADV_HUGEPAGE (transparent hugepages) */
    COL_BACKING_HUGETLB = 2, /* MAP_HUGETLB, 2 MiB pages from vm.nr_hugepages */
};

typedef struct {
    int64_t slot_bytes; /* bytes per slot: a multiple of 4096, > 0 */
    int64_t n_slots;    /* number of slots, > 0 */
    int32_t hugetlb;    /* col_aepc_mode for MAP_HUGETLB (default TRY) */
    int32_t thp;        /* col_aepc_mode for MADV_HUGEPAGE when hugetlb is not used (default TRY) */
    int32_t lock;       /* col_aepc_mode for mlock of the whole region (default TRY) */
    int32_t reserved;   /* 0 */
} col_slab_params;

/* slot_bytes 0 and n_slots 0 (must be set), hugetlb TRY, thp TRY, lock TRY. */
COL_API col_slab_params col_slab_default_params(void);
COL_API size_t col_slab_params_size(void);

typedef struct {
    int64_t slot_bytes;    /* as requested */
    int64_t n_slots;       /* as requested */
    int64_t region_bytes;  /* mapped bytes: slot_bytes * n_slots rounded up to 2 MiB (hugetlb,
                              THP) or 4 KiB (pages) */
    int64_t n_free;        /* slots in the free map now */
    int32_t backing;       /* col_slab_backing obtained */
    int32_t locked;        /* 1 if the whole region is mlock'ed */
    int32_t hugetlb_errno; /* errno of the failed MAP_HUGETLB mmap; 0 if not tried or it worked */
    int32_t thp_errno;     /* errno of the failed madvise(MADV_HUGEPAGE); 0 if not tried or it worked */
    int32_t lock_errno;    /* errno of the failed mlock (EPERM, ENOMEM, EAGAIN); 0 if not tried or it worked */
    int32_t mmap_errno;    /* errno of the failed ordinary mmap; 0 if it worked */
} col_slab_info;

/* sizeof(col_slab_info); the Python binding checks its Structure against it. */
COL_API size_t col_slab_info_size(void);

/* Maps the region and builds the free map (every slot free).
 * info (may be NULL) is filled in every case, so a failure says what was refused.
 * COL_OK: *out is a new slab.
 * COL_EINVAL: bad params; *out = NULL, nothing mapped.
 * COL_ENOMEM: the region or the bookkeeping could not be allocated; *out = NULL.
 * COL_ESYSTEM: a REQUIRED mode could not be met (hugetlb_errno / thp_errno / lock_errno say
 *   why); *out = NULL, nothing stays mapped. */
COL_API int col_slab_create(const col_slab_params *params, col_slab **out, col_slab_info *info);

/* Unmaps the region. NULL is a no-op. Every pointer into the region becomes invalid. While an
 * expert cache built on the slab exists, the unmapping is deferred to that cache's destroy. */
COL_API void col_slab_destroy(col_slab *slab);

/* A snapshot of the slab's state. COL_EINVAL if slab or out is NULL. */
COL_API int col_slab_get_info(col_slab *slab, col_slab_info *out);

/* Base of the region: slot s is at base + s * slot_bytes. */
COL_API void *col_slab_data(col_slab *slab);

/* Takes the lowest-numbered free slot out of the free map.
 * COL_OK: *slot is it. COL_EBUSY: no slot is free; *slot = -1. */
COL_API int col_slab_slot_alloc(col_slab *slab, int32_t *slot);

/* Returns a slot to the free map. COL_EINVAL: slot out of range or already free (the map is
 * unchanged). */
COL_API int col_slab_slot_free(col_slab *slab, int32_t slot);

/* ---- the loader ---- */

typedef struct col_loader col_loader;

typedef struct {
    int32_t max_queue_depth; /* I/O threads started, the upper bound of queue_depth (default 32) */
    int32_t queue_depth;     /* reads in flight at most, 1..max_queue_depth (default 16) */
    int32_t direct;          /* col_aepc_mode for O_DIRECT (default TRY: fall back to buffered
                                reads only when the file system refuses O_DIRECT with EINVAL) */
    int32_t reserved;        /* 0 */
} col_loader_params;

COL_API col_loader_params col_loader_default_params(void);
COL_API size_t col_loader_params_size(void);

typedef struct {
    int32_t direct;          /* 1 while reads use O_DIRECT */
    int32_t direct_errno;    /* EINVAL if O_DIRECT was refused (then reads are buffered), else 0 */
    int32_t queue_depth;     /* current limit of reads in flight */
    int32_t max_queue_depth; /* I/O threads */
    int64_t reads;           /* reads completed (ok or failed) */
    int64_t bytes_read;      /* bytes of successful reads */
    int64_t failures;        /* reads that failed (I/O error, short read or crc mismatch) */
    int64_t busy_ns;         /* time with at least one read in flight */
    int64_t file_bytes;      /* size of the file (of a block device: its capacity) */
} col_loader_info;

COL_API size_t col_loader_info_size(void);

/* One read of `length` bytes at `offset` into dst, checked against crc32c. With O_DIRECT, dst,
 * offset and length must be multiples of 4096. */
typedef struct {
    void *dst;        /* (length) bytes */
    int64_t offset;
    int64_t length;
    uint32_t crc32c;  /* expected CRC-32C of all length bytes */
    int32_t reserved; /* 0 */
} col_read;

typedef struct {
    int32_t status;     /* COL_OK, COL_EIO or COL_ECHECKSUM */
    int32_t sys_errno;  /* errno for COL_EIO (0 for a short read) */
    uint32_t crc32c;    /* CRC-32C of the bytes read (COL_ECHECKSUM: the wrong one) */
    int32_t reserved;
    int64_t latency_ns; /* from submission to completion */
} col_read_result;

COL_API size_t col_read_size(void);
COL_API size_t col_read_result_size(void);

/* Opens `path` for reading and starts the I/O threads. info (may be NULL) is filled in
 * every case.
 * COL_OK: *out is a new loader.
 * COL_EINVAL: bad params or path NULL; *out = NULL.
 * COL_EIO: the file cannot be opened (info->direct_errno = 0, *err = errno); *out = NULL.
 * COL_ESYSTEM: direct is REQUIRED and the file system refuses O_DIRECT, or a thread cannot be
 *   started; *err is the errno; *out = NULL.
 * err (may be NULL) receives the errno of the failure, 0 on success. */
COL_API int col_loader_create(const char *path, const col_loader_params *params, col_loader **out,
                              int32_t *err);

/* As col_loader_create, on a file or block device the caller has open as `fd` (read by the
 * loader through a file description of its own, opened again via /proc/self/fd so that it has
 * its own O_DIRECT flag; `fd` stays the caller's, to close when it likes). A block device's
 * file_bytes is its capacity.
 * COL_EINVAL: bad params, fd < 0 or out NULL. COL_EIO: fd cannot be opened again, or the new
 *   open is not the same file (*err = ESTALE). COL_ESYSTEM: as col_loader_create. */
COL_API int col_loader_create_fd(int fd, const col_loader_params *params, col_loader **out, int32_t *err);

/* Completes the queued reads, stops the threads, closes the file. NULL is a no-op. While an
 * expert cache built on the loader exists, all this is deferred to that cache's destroy. */
COL_API void col_loader_destroy(col_loader *loader);

COL_API int col_loader_get_info(col_loader *loader, col_loader_info *out);

/* Changes how many reads may be in flight, effective for the next read started.
 * COL_EINVAL: depth outside 1..max_queue_depth; unchanged. */
COL_API int col_loader_set_queue_depth(col_loader *loader, int32_t depth);

/* Submits n reads, keeps up to queue_depth in flight, and waits for all of them.
 *   reads: (n), results: (n)
 * COL_OK: every read succeeded. COL_EIO / COL_ECHECKSUM: the first failure in index order;
 * results[i] tells each read's outcome; the bytes of a failed read are undefined.
 * COL_EINVAL: n < 0 or a NULL pointer with n > 0; nothing was read. */
COL_API int col_loader_read(col_loader *loader, const col_read *reads, int32_t n, col_read_result *results);

/* ---- the expert cache ---- */

typedef struct col_expert_cache col_expert_cache;

enum col_cache_policy {
    COL_POLICY_LRU  = 0, /* evict the least recently used unpinned expert */
    COL_POLICY_LFRU = 1, /* per-layer quotas (n_slots / layers with records) and, within the
                            layer that gives up a slot, the least frequently used expert
                            (counts halve every 8 * n_slots accesses), ties to the least recent */
    COL_POLICY_DECAYED_LFU = 2, /* frequency with exponential decay: each request adds 1 to the
                            expert's score and every score halves each decay_half_life requests
                            (a continuous decay, not a periodic halving); the lowest decayed
                            score goes, ties to the least recent. A prefetched expert not yet
                            requested has score 0 and goes first. */
    COL_POLICY_NEXT_USE = 3, /* the expert whose next request is expected farthest ahead, in
                            layer steps: the steps until its layer's turn comes round (layers
                            with records, in index order), plus that many for each token it is
                            expected to wait, (1 - p) / p at its per-token rate p: the tokens
                            that requested it, decayed with half-life next_use_half_life tokens.
                            A token is a pass over the layers: the clock ticks when a request's
                            layer is below the previous request's. Ties to the least recent. */
};
#define COL_POLICY_COUNT 4

/* Where each (layer, expert) record lives in the experts file. */
typedef struct {
    int64_t offset;   /* bytes into the experts file, a multiple of 4096 */
    int64_t length;   /* bytes of the padded record, <= slot_bytes; 0 = no record */
    uint32_t crc32c;  /* CRC-32C of the length bytes */
    int32_t reserved; /* 0 */
} col_expert_record;

COL_API size_t col_expert_record_size(void);

typedef struct {
    int32_t n_layers;   /* L */
    int32_t n_experts;  /* E */
    int32_t policy;     /* col_cache_policy (default LRU) */
    int32_t wait_for_pins; /* 1: an acquire that finds too few unpinned slots waits for other
                              threads' releases instead of failing with COL_EBUSY (it holds no
                              pins while it waits). Never acquire again while holding pins in
                              the same thread with this on. Default 0. */
    int32_t decay_half_life; /* COL_POLICY_DECAYED_LFU's half-life in requested experts (cache
                                requests, hits and misses); <= 0: 1024 (16 tokens of a model
                                with 8 MoE layers of top-8) */
    int32_t next_use_half_life; /* COL_POLICY_NEXT_USE's half-life in tokens; <= 0: 16 */
} col_expert_cache_params;

COL_API col_expert_cache_params col_expert_cache_default_params(void);
COL_API size_t col_expert_cache_params_size(void);

#define COL_LATENCY_BUCKETS 96 /* bucket b >= 4 holds latencies in [lo(b), lo(b + 1)) microseconds,
                                  lo(b) = (4 + b % 4) << (b / 4) >> 3; bucket 0: < 1 us;
                                  the last bucket also holds everything above it */

typedef struct {
    int64_t hits;             /* requested experts that were loaded */
    int64_t inflight_hits;    /* requested experts whose (prefetch) read was already running */
    int64_t misses;           /* requested experts that had to be read */
    int64_t loads;            /* reads completed without error */
    int64_t load_failures;    /* reads that failed (I/O error or crc mismatch) */
    int64_t bytes_read;       /* bytes of reads completed without error */
    int64_t evictions;        /* experts of this layer evicted */
    int64_t prefetch_issued;  /* prefetch reads started */
    int64_t prefetch_useful;  /* prefetched experts requested before being evicted */
    int64_t prefetch_skipped; /* prefetch requests dropped: no slot could be evicted for them */
    int64_t latency_us[COL_LATENCY_BUCKETS]; /* histogram of read latencies (all reads) */
} col_expert_cache_layer_stats;

COL_API size_t col_expert_cache_layer_stats_size(void);

/* Per acquired expert, what wait found. */
typedef struct {
    int32_t status;    /* COL_OK, COL_EIO or COL_ECHECKSUM */
    int32_t sys_errno; /* errno of an I/O error */
    uint32_t crc32c;   /* CRC-32C of the bytes read (for COL_ECHECKSUM) */
    int32_t reserved;
} col_expert_load_result;

COL_API size_t col_expert_load_result_size(void);

/* Builds a cache over `slab` and `loader`, which it uses but does not own; they may be
 * destroyed in any order with it (theirs is deferred until the cache's). records: (L * E)
 * row-major by layer; copied.
 * COL_OK: *out is a new cache, empty.
 * COL_EINVAL: bad params, NULL pointers, or a record longer than the slab's slots; *out = NULL.
 * COL_ENOMEM: *out = NULL. */
COL_API int col_expert_cache_create(const col_expert_cache_params *params, const col_expert_record *records,
                                    col_slab *slab, col_loader *loader, col_expert_cache **out);

/* Waits for every read the cache started, then frees its bookkeeping; the slab's slots it
 * held are returned to the free map. NULL is a no-op. */
COL_API void col_expert_cache_destroy(col_expert_cache *cache);

/* Pins experts[0..n) of `layer` and starts the reads of those not in the cache (evicting
 * unpinned experts as the policy says). Does not wait for the reads: call wait.
 *   experts: (N) distinct expert ids; slots: (N) out, the slot of each expert
 * COL_OK: all N are pinned; slots[] is filled. Every slot must be released exactly once.
 * COL_EINVAL: layer/expert out of range, an expert without a record, or a duplicate; nothing
 *   is pinned.
 * COL_EBUSY: there are not enough unpinned slots for the misses (with wait_for_pins: N is
 *   larger than the slab, or nothing pinned or loading could ever free a slot); nothing stays
 *   pinned (reads already started continue and land in the cache unpinned). */
COL_API int col_expert_cache_acquire(col_expert_cache *cache, int32_t layer, const int32_t *experts, int32_t n,
                                     int32_t *slots);

/* Blocks until every slot in slots[0..n) (pinned by acquire) is loaded or has failed.
 * results: (N) out, may be NULL.
 * COL_OK: all are loaded. COL_EIO / COL_ECHECKSUM: the first failure in index order; the
 * failed experts are no longer in the map (the next acquire reads them again) and their slots
 * go back to the free map when released. Pins are unchanged: release them in every case. */
COL_API int col_expert_cache_wait(col_expert_cache *cache, const int32_t *slots, int32_t n,
                                  col_expert_load_result *results);

/* Unpins slots[0..n). COL_EINVAL: a slot that is not pinned (the others are still released). */
COL_API int col_expert_cache_release(col_expert_cache *cache, const int32_t *slots, int32_t n);

/* Starts reads of those experts[0..n) of `layer` that are not in the cache, without pinning
 * them, evicting only experts that are neither pinned nor themselves unused prefetches; when
 * no slot can be had, the rest are skipped (counted in prefetch_skipped). Never blocks on I/O.
 * *issued (may be NULL) = reads started.
 * COL_OK in every case but COL_EINVAL (bad layer/expert/pointers; nothing started). */
COL_API int col_expert_cache_prefetch(col_expert_cache *cache, int32_t layer, const int32_t *experts, int32_t n,
                                      int32_t *issued);

/* A snapshot of one layer's statistics. COL_EINVAL: layer out of range. */
COL_API int col_expert_cache_get_stats(col_expert_cache *cache, int32_t layer, col_expert_cache_layer_stats *out);

/* Zeroes every layer's statistics. */
COL_API void col_expert_cache_reset_stats(col_expert_cache *cache);

/* Experts currently in the cache (loaded or loading), and of those, how many are pinned. */
COL_API int col_expert_cache_count(col_expert_cache *cache, int32_t *resident, int32_t *pinned);

/* 1 if (layer, expert) is loaded in the cache now, 0 if not (or out of range). */
COL_API int col_expert_cache_contains(col_expert_cache *cache, int32_t layer, int32_t expert);

/* Changes the eviction policy (COL_EINVAL for an unknown one; unchanged). */
COL_API int col_expert_cache_set_policy(col_expert_cache *cache, int32_t policy);

/* ---------------------------------------------------------------------------------------
 * I/O priority of a thread (Linux ioprio): a verify of the whole pack reads at IDLE, so the
 * disk serves the expert loads first. Threads inherit it from the thread that creates them.
 * ------------------------------------------------------------------------------------ */

enum col_io_class {
    COL_IO_CLASS_NONE        = 0, /* not set: derived from the CPU niceness */
    COL_IO_CLASS_REALTIME    = 1,
    COL_IO_CLASS_BEST_EFFORT = 2,
    COL_IO_CLASS_IDLE        = 3, /* served only when no one else uses the disk */
};

/* Sets the calling thread's I/O class (col_io_class) and level (0 highest .. 7).
 * COL_OK. COL_EINVAL: class or level out of range. COL_ESYSTEM: the kernel refused (*err is
 * the errno, e.g. EPERM for REALTIME without CAP_SYS_ADMIN). COL_ENOTSUP: not Linux (*err
 * ENOSYS). err may be NULL. */
COL_API int col_io_priority_set(int io_class, int level, int32_t *err);

/* The I/O class and level of thread `thread_id` (0: the calling thread), as ioprio_get says.
 * COL_OK. COL_EINVAL: NULL outputs or a negative id. COL_ESYSTEM: the kernel refused (*err:
 * ESRCH, no such thread). COL_ENOTSUP: not Linux. */
COL_API int col_io_priority_get(int32_t thread_id, int *io_class, int *level, int32_t *err);

#ifdef __cplusplus
}
#endif

#endif /* COLIBRI_H */
