/*
 * kernels.c — runtime kernel selection and the activation quantizer shared by every SIMD
 * level. The portable level has no integer kernels: it multiplies with float activations
 * through the reference vec_dot of each type (types.c), which is the semantics the public
 * header states.
 */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "col_internal.h"

float col_dot_f32_portable(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

float col_exp_sum_portable(float *x, int64_t n, float mx) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    return sum;
}

void col_axpy_f32_portable(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

void col_f16_row_to_f32_portable(const uint16_t *h, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = col_f16_to_f32(h[i]);
}

void col_silu_mul_portable(const float *g, const float *u, float *h, int64_t n) {
    for (int64_t i = 0; i < n; i++) h[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* In transformers' order of operations; the comparisons keep a NaN a NaN. */
void col_clamped_swiglu_portable(const float *g, const float *u, float *h, int64_t n, float alpha, float limit) {
    for (int64_t i = 0; i < n; i++) {
        const float gc = g[i] > limit ? limit : g[i];
        const float uc = u[i] > limit ? limit : (u[i] < -limit ? -limit : u[i]);
        h[i] = (uc + 1.0f) * (gc * (1.0f / (1.0f + expf(-(gc * alpha)))));
    }
}

/* sqrt(2 / pi) and the cubic coefficient of the tanh approximation, as torch writes them. */
#define GELU_BETA 0.7978845608028654f
#define GELU_KAPPA 0.044715f

void col_gelu_tanh_mul_portable(const float *g, const float *u, float *h, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i], y = GELU_BETA * (x + GELU_KAPPA * (x * x * x));
        h[i] = x / (1.0f + expf(-2.0f * y)) * u[i];
    }
}

static const col_kernel_set portable_kernels = {COL_KERNELS_PORTABLE, {NULL}, col_dot_f32_portable,
                                                col_axpy_f32_portable, {NULL}, col_silu_mul_portable,
                                                col_quantize_block_portable, col_rms_norm_row_portable,
                                                col_clamped_swiglu_portable, {NULL}, col_gelu_tanh_mul_portable, {NULL},
                                                {NULL}, NULL};

static _Atomic(const col_kernel_set *) active_kernels = NULL;

static const col_kernel_set *kernels_of(int level) {
    switch (level) {
    case COL_KERNELS_PORTABLE: return &portable_kernels;
    case COL_KERNELS_AVX2: return col_kernels_avx2();
    case COL_KERNELS_AVX512: return col_kernels_avx512();
    case COL_KERNELS_AVX512_VNNI: return col_kernels_avx512_vnni();
    case COL_KERNELS_NEON: return col_kernels_neon();
    default: return NULL;
    }
}

static const col_kernel_set *best_kernels(void) {
    static const int preference[] = {COL_KERNELS_AVX512_VNNI, COL_KERNELS_AVX512, COL_KERNELS_AVX2,
                                     COL_KERNELS_NEON};
    for (size_t i = 0; i < sizeof preference / sizeof preference[0]; i++) {
        const col_kernel_set *k = kernels_of(preference[i]);
        if (k) return k;
    }
    return &portable_kernels;
}

const col_kernel_set *col_kernels_active(void) {
    const col_kernel_set *k = atomic_load_explicit(&active_kernels, memory_order_acquire);
    if (!k) { /* first use: every thread computes the same answer, so a race is harmless */
        k = best_kernels();
        atomic_store_explicit(&active_kernels, k, memory_order_release);
    }
    return k;
}

int col_kernels_get(void) { return col_kernels_active()->level; }

int col_kernels_supported(int level) { return kernels_of(level) != NULL; }

int col_kernels_set(int level) {
    if (level < 0 || level >= COL_KERNELS_COUNT) return COL_EINVAL;
    const col_kernel_set *k = kernels_of(level);
    if (!k) return COL_ENOTSUP;
    atomic_store_explicit(&active_kernels, k, memory_order_release);
    return COL_OK;
}

const char *col_kernels_name(int level) {
    switch (level) {
    case COL_KERNELS_PORTABLE: return "portable";
    case COL_KERNELS_AVX2: return "avx2";
    case COL_KERNELS_AVX512: return "avx512";
    case COL_KERNELS_AVX512_VNNI: return "avx512_vnni";
    case COL_KERNELS_NEON: return "neon";
    default: return "unknown";
    }
}

int32_t col_quantize_block_portable(const float *x, int n, int8_t *qs, float *d) {
    float amax = 0.0f;
    for (int j = 0; j < n; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    *d = amax / 127.0f;
    int32_t sum = 0;
    for (int j = 0; j < n; j++) { /* NaN and overflow never reach the int conversion */
        const float v = fminf(fmaxf(x[j] * id, -127.0f), 127.0f);
        const int q = (int)((v + 12582912.0f) - 12582912.0f); /* round half to even */
        qs[j] = (int8_t)q;
        sum += q;
    }
    return sum;
}

void col_quantize_x(int type, const float *x, int64_t n, uint8_t *base) {
    const int64_t nb = n / COL_QK_X;
    const int64_t nbe = col_xq_nb_even(nb);
    int8_t *qs = (int8_t *)base;                                 /* (nb, 32) */
    int32_t *bias = (int32_t *)(base + COL_XQ_OFF_BIAS(nbe));    /* (nb, 8) */
    float *dv = (float *)(base + COL_XQ_OFF_DV(nbe));            /* (nb, 8) */
    float *d = (float *)(base + COL_XQ_OFF_D(nbe));              /* (nb) */
    float *ds = (float *)(base + COL_XQ_OFF_DS(nbe));            /* (nb) */
    float *ds2 = (float *)(base + COL_XQ_OFF_DS2(nbe));          /* (nb / 2) */
    const col_kernel_set *kernels = col_kernels_active();
    const col_quantize_block_fn quantize_block =
        kernels->quantize_block ? kernels->quantize_block : col_quantize_block_portable;
    if (type == COL_TYPE_Q4_G64) { /* one scale per 64 values, the weight's own block */
        for (int64_t k = 0; k < n / 64; k++) {
            const int32_t sum = quantize_block(x + k * 64, 64, qs + k * 64, &d[k]);
            ds2[k] = d[k] * (float)sum;
            dv[2 * k] = d[k]; /* (d, ds2) pairs: four blocks' factors in one load */
            dv[2 * k + 1] = ds2[k];
        }
        return;
    }
    for (int64_t b = 0; b < nb; b++) {
        float db;
        const int32_t sum = quantize_block(x + b * COL_QK_X, COL_QK_X, qs + b * COL_QK_X, &db);
        d[b] = db;
        ds[b] = db * (float)sum;
        for (int l = 0; l < 8; l++) {
            dv[b * 8 + l] = db;
            bias[b * 8 + l] = 0;
        }
        bias[b * 8] = -128 * sum;
        if (b & 1) ds2[b / 2] = ds[b - 1] + ds[b];
    }
}

void *col_alloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? (bytes + 63) / 64 * 64 : 64) != 0) return NULL;
    return p;
}

void col_free(void *p) { free(p); }

void col_gemm_f32_portable(float *y, int64_t y_stride, float s, const float *x, int64_t x_stride, const float *m,
                           int64_t n, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < n; r++) {
        float *yr = y + r * y_stride;        /* (cols) */
        const float *xr = x + r * x_stride;  /* (rows) */
        for (int64_t j = 0; j < cols; j++) yr[j] = s == 0.0f ? 0.0f : s * yr[j];
        for (int64_t i = 0; i < rows; i++) {
            const float xi = xr[i];
            const float *mi = m + i * cols;
            for (int64_t j = 0; j < cols; j++) yr[j] += xi * mi[j];
        }
    }
}
