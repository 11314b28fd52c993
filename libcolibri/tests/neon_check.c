/*
 * neon_check.c — the NEON kernel level (simd_neon.c) against the portable level, through the
 * public API (col_kernels_set, col_matmul, col_moe_experts, a col_pool). The build machines
 * are x86-64, so tests/test_neon_qemu.py cross-compiles this file with the library sources
 * and runs it under qemu-user:
 *
 *   aarch64-linux-gnu-gcc -O2 -std=c11 -ffp-contract=off -Ilibcolibri/include \
 *       libcolibri/tests/neon_check.c libcolibri/src/\*.c -lm -lpthread -o neon_check
 *   qemu-aarch64 -L /usr/aarch64-linux-gnu ./neon_check
 *
 * It prints one line per failed check and a PASS / FAIL summary; exit status 1 on failure.
 *
 * Tolerances (the reasoning of tests/test_native_kernels.py, which checks the x86 levels):
 *   - the portable level multiplies q8_0 / q4_g64 / mxfp4 weights with float32 activations;
 *     NEON, like every SIMD level, first quantizes each block of activations to int8 (blocks
 *     of 32 for q8_0 and mxfp4, 64 for q4_g64: scale max|x_block| / 127), so each activation
 *     is off by at most max|x_block| / 254 and the product by at most
 *         bound[t, o] = sum_b max|x[t, block b]| / 254 * sum_{j in b} |w[o, j]|,
 *     plus float rounding: NEON must equal portable within 1.001 * bound + 1e-5 * scale,
 *     scale[t, o] = sum_j |x[t, j]| * |w[o, j]|;
 *   - that bound is loose, so the NEON result is also compared with the int8-activation
 *     product computed here in double (the same quantization, written out plainly): the
 *     only difference left is float rounding, within 1e-5 * scale (what the SIMD levels
 *     guarantee among themselves);
 *   - the fused experts quantize activations twice (x, then h): within 4e-2 * max |portable|;
 *   - a Gated DeltaNet step: f32 weights within 1e-4 * max |portable| (float products only),
 *     integer weights within 6e-2 (see check_deltanet);
 *   - bit for bit: the pool's thread count, a token alone or in a batch, weights at an odd
 *     address never change a result.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

#define FLOAT_TOL 1e-5      /* float rounding, relative to scale */
#define BOUND_SLACK 1.001   /* on the activation-quantization bound */
#define MOE_TOL 4e-2        /* fused experts, relative to max |portable| */
#define N_POOLS 3           /* pools of 1, 2 and 3 threads */

static int n_checks, n_failed;

static void check(int ok, const char *fmt, ...) {
    n_checks++;
    if (ok) return;
    n_failed++;
    va_list ap;
    va_start(ap, fmt);
    fputs("FAIL: ", stdout);
    vprintf(fmt, ap);
    fputc('\n', stdout);
    va_end(ap);
}

/* A call that must succeed; a failure is reported and ends the run (nothing to compare). */
static void must(int status, const char *what) {
    if (status == COL_OK) return;
    printf("FAIL: %s: %s\n", what, col_status_string(status));
    printf("neon_check: FAIL (setup error)\n");
    exit(1);
}

static void *must_alloc(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) {
        printf("neon_check: FAIL (out of memory)\n");
        exit(1);
    }
    return p;
}

/* ---- deterministic random numbers (splitmix64, Box-Muller) -------------------------- */

static uint64_t rng_state;

static uint64_t rng_next(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_uniform(void) { return ((double)(rng_next() >> 11) + 0.5) * 0x1p-53; } /* (0, 1) */

static void fill_gaussian(float *v, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++)
        v[i] = (float)(scale * sqrt(-2.0 * log(rng_uniform())) * cos(6.283185307179586 * rng_uniform()));
}

/* ---- a quantized weight matrix ------------------------------------------------------ */

typedef struct {
    int type;
    int64_t n_out, n_in, bytes;
    uint8_t *packed; /* (n_out, row_bytes) */
    float *deq;      /* (n_out, n_in) the values the packed matrix stands for */
} weights;

static weights weights_random(int type, int64_t n_out, int64_t n_in, double scale) {
    weights w = {type, n_out, n_in, n_out * col_type_row_bytes(type, n_in), NULL, NULL};
    float *src = must_alloc((size_t)(n_out * n_in) * sizeof(float));
    fill_gaussian(src, n_out * n_in, scale);
    w.packed = must_alloc((size_t)w.bytes);
    w.deq = must_alloc((size_t)(n_out * n_in) * sizeof(float));
    must(col_quantize(type, src, n_out, n_in, w.packed), "col_quantize");
    must(col_dequantize(type, w.packed, n_out, n_in, w.deq), "col_dequantize");
    free(src);
    return w;
}

static void weights_free(weights *w) {
    free(w->packed);
    free(w->deq);
}

/* y (n_tok, n_out) = x @ w^T on kernel level `level`. */
static void matmul_on(int level, col_pool *pool, const weights *w, const uint8_t *packed, const float *x,
                      int64_t n_tok, float *y) {
    must(col_kernels_set(level), "col_kernels_set");
    must(col_matmul(pool, w->type, packed, w->n_out, w->n_in, x, n_tok, y), "col_matmul");
}

/* What the SIMD levels compute, in double: x quantized to int8 per block of `block` values
 * (d = max|x_block| / 127 in float, q = x / d rounded half to even), times w. */
static double int8_product(const weights *w, const float *xt, int64_t o, int block) {
    double sum = 0.0;
    for (int64_t b0 = 0; b0 < w->n_in; b0 += block) {
        float amax = 0.0f;
        for (int j = 0; j < block; j++) amax = fmaxf(amax, fabsf(xt[b0 + j]));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < block; j++) {
            const float q = nearbyintf(fminf(fmaxf(xt[b0 + j] * id, -127.0f), 127.0f));
            sum += (double)w->deq[o * w->n_in + b0 + j] * (double)d * (double)q;
        }
    }
    return sum;
}

/* ---- checks --------------------------------------------------------------------------- */

typedef struct {
    int64_t n_out, n_in_64, n_tok;
} shape;

/* Row counts that are multiples of neither the 16-row tile nor the thread split; q8_0 and
 * mxfp4 rows get an odd number of 32-blocks (n_in = 32 * (2 * n_in_64 + 1)). */
static const shape SHAPES[] = {{1, 1, 1},  {7, 3, 1},   {37, 5, 2}, {100, 2, 3},
                               {257, 7, 5}, {33, 16, 1}, {129, 32, 4}};

static const char *type_name(int type) {
    return type == COL_TYPE_Q8_0 ? "q8_0" : type == COL_TYPE_Q4_G64 ? "q4_g64" : type == COL_TYPE_F32 ? "f32" : "mxfp4";
}

/* The activation block: the weight's block (32 for q8_0 and mxfp4, 64 for q4_g64). */
static int block_of(int type) { return type == COL_TYPE_Q4_G64 ? 64 : 32; }

static void check_matmul(int type, const shape *s, col_pool *const *pools) {
    const int64_t n_in = type == COL_TYPE_Q4_G64 ? 64 * s->n_in_64 : 32 * (2 * s->n_in_64 + 1);
    const int64_t n_out = s->n_out, n_tok = s->n_tok;
    const int block = block_of(type);
    weights w = weights_random(type, n_out, n_in, 0.1);
    float *x = must_alloc((size_t)(n_tok * n_in) * sizeof(float));
    fill_gaussian(x, n_tok * n_in, 1.0);
    const size_t y_bytes = (size_t)(n_tok * n_out) * sizeof(float);
    float *want = must_alloc(y_bytes), *got[N_POOLS], *alone = must_alloc(y_bytes);
    for (int p = 0; p < N_POOLS; p++) got[p] = must_alloc(y_bytes);

    matmul_on(COL_KERNELS_PORTABLE, pools[0], &w, w.packed, x, n_tok, want);
    for (int p = 0; p < N_POOLS; p++) matmul_on(COL_KERNELS_NEON, pools[p], &w, w.packed, x, n_tok, got[p]);
    for (int p = 1; p < N_POOLS; p++)
        check(memcmp(got[p], got[0], y_bytes) == 0, "%s %lldx%lldx%lld: %d threads differ from 1", type_name(type),
              (long long)n_out, (long long)n_in, (long long)n_tok, p + 1);

    int64_t worst_bound = -1, worst_int8 = -1; /* first failing element of each comparison */
    for (int64_t t = 0; t < n_tok; t++) {
        const float *xt = x + t * n_in;
        for (int64_t o = 0; o < n_out; o++) {
            double scale = 0.0, bound = 0.0;
            for (int64_t b0 = 0; b0 < n_in; b0 += block) {
                double amax = 0.0, wsum = 0.0;
                for (int j = 0; j < block; j++) {
                    const double xa = fabs(xt[b0 + j]), wa = fabs(w.deq[o * n_in + b0 + j]);
                    scale += xa * wa;
                    amax = fmax(amax, xa);
                    wsum += wa;
                }
                bound += amax / 254.0 * wsum;
            }
            const double y = got[0][t * n_out + o];
            if (fabs(y - want[t * n_out + o]) > BOUND_SLACK * bound + FLOAT_TOL * scale && worst_bound < 0)
                worst_bound = t * n_out + o;
            if (fabs(y - int8_product(&w, xt, o, block)) > FLOAT_TOL * scale && worst_int8 < 0)
                worst_int8 = t * n_out + o;
        }
    }
    check(worst_bound < 0, "%s %lldx%lldx%lld: neon %g vs portable %g beyond the activation bound at element %lld",
          type_name(type), (long long)n_out, (long long)n_in, (long long)n_tok,
          worst_bound < 0 ? 0.0 : got[0][worst_bound], worst_bound < 0 ? 0.0 : want[worst_bound],
          (long long)worst_bound);
    check(worst_int8 < 0, "%s %lldx%lldx%lld: neon %g vs the int8-activation product beyond 1e-5 x scale at element %lld",
          type_name(type), (long long)n_out, (long long)n_in, (long long)n_tok,
          worst_int8 < 0 ? 0.0 : got[0][worst_int8], (long long)worst_int8);

    /* decode equals prefill: each token on its own gives the batch's bits */
    for (int64_t t = 0; t < n_tok; t++)
        matmul_on(COL_KERNELS_NEON, NULL, &w, w.packed, x + t * n_in, 1, alone + t * n_out);
    check(memcmp(alone, got[0], y_bytes) == 0, "%s %lldx%lldx%lld: a token alone differs from the batch",
          type_name(type), (long long)n_out, (long long)n_in, (long long)n_tok);

    /* weights one byte past an aligned address */
    uint8_t *shifted = must_alloc((size_t)w.bytes + 1);
    memcpy(shifted + 1, w.packed, (size_t)w.bytes);
    matmul_on(COL_KERNELS_NEON, NULL, &w, shifted + 1, x, n_tok, alone);
    check(memcmp(alone, got[0], y_bytes) == 0, "%s %lldx%lldx%lld: weights at an odd address change the result",
          type_name(type), (long long)n_out, (long long)n_in, (long long)n_tok);

    free(shifted);
    for (int p = 0; p < N_POOLS; p++) free(got[p]);
    free(alone);
    free(want);
    free(x);
    weights_free(&w);
}

/* An identity weight passes each int8 activation through: halves round to even. */
static void check_rounding(int type) {
    enum { N = 64 };
    static const float pattern[8] = {127, 2.5f, -3.5f, 0.5f, -0.5f, 1.5f, 126.5f, -126.5f};
    static const float expect[8] = {127, 2, -4, 0, 0, 2, 126, -126};
    float *eye = must_alloc(N * N * sizeof(float)), x[N], y[N];
    for (int i = 0; i < N; i++) {
        eye[i * N + i] = 1.0f;
        x[i] = pattern[i % 8];
    }
    weights w = {type, N, N, N * col_type_row_bytes(type, N), must_alloc((size_t)(N * col_type_row_bytes(type, N))), NULL};
    must(col_quantize(type, eye, N, N, w.packed), "col_quantize");
    matmul_on(COL_KERNELS_NEON, NULL, &w, w.packed, x, 1, y);
    int ok = 1;
    for (int i = 0; i < 8; i++) ok &= fabsf(y[i] - expect[i]) <= 2e-3f * fabsf(expect[i]) + 1e-5f;
    check(ok, "%s: identity weight gives %g %g %g %g %g %g %g %g, want 127 2 -4 0 0 2 126 -126", type_name(type),
          y[0], y[1], y[2], y[3], y[4], y[5], y[6], y[7]);
    free(w.packed);
    free(eye);
}

static void check_moe(int type, int64_t n_tok, col_pool *const *pools) {
    enum { E = 5, D = 192, F = 128, A = 3 };
    weights gate[E], up[E], down[E];
    const void *g[E], *u[E], *dn[E];
    for (int e = 0; e < E; e++) {
        gate[e] = weights_random(type, F, D, 0.1);
        up[e] = weights_random(type, F, D, 0.1);
        down[e] = weights_random(type, D, F, 0.1);
        g[e] = gate[e].packed;
        u[e] = up[e].packed;
        dn[e] = down[e].packed;
    }
    float *x = must_alloc((size_t)(n_tok * D) * sizeof(float));
    fill_gaussian(x, n_tok * D, 1.0);
    int32_t *expert_of = must_alloc((size_t)(n_tok * A) * sizeof(int32_t));
    float *weight = must_alloc((size_t)(n_tok * A) * sizeof(float));
    for (int64_t t = 0; t < n_tok; t++) { /* A distinct experts per token */
        int perm[E];
        for (int e = 0; e < E; e++) perm[e] = e;
        for (int e = E - 1; e > 0; e--) {
            const int k = (int)(rng_next() % (uint64_t)(e + 1)), tmp = perm[e];
            perm[e] = perm[k];
            perm[k] = tmp;
        }
        for (int a = 0; a < A; a++) {
            expert_of[t * A + a] = perm[a];
            weight[t * A + a] = (float)rng_uniform();
        }
    }
    expert_of[A - 1] = -1; /* a slot without an expert is skipped */

    const size_t out_bytes = (size_t)(n_tok * D) * sizeof(float);
    float *want = must_alloc(out_bytes), *got[N_POOLS];
    must(col_kernels_set(COL_KERNELS_PORTABLE), "col_kernels_set");
    must(col_moe_experts(pools[0], type, E, g, u, dn, D, F, x, n_tok, expert_of, weight, A, want), "col_moe_experts");
    must(col_kernels_set(COL_KERNELS_NEON), "col_kernels_set");
    for (int p = 0; p < N_POOLS; p++) {
        got[p] = must_alloc(out_bytes);
        must(col_moe_experts(pools[p], type, E, g, u, dn, D, F, x, n_tok, expert_of, weight, A, got[p]),
             "col_moe_experts");
    }
    for (int p = 1; p < N_POOLS; p++)
        check(memcmp(got[p], got[0], out_bytes) == 0, "%s moe n_tok=%lld: %d threads differ from 1", type_name(type),
              (long long)n_tok, p + 1);
    double max_want = 0.0, max_diff = 0.0;
    for (int64_t i = 0; i < n_tok * D; i++) { /* plain ifs: gcc 12's aarch64 vectorizer crashes on an fmax pair here */
        const double a = fabs((double)want[i]), diff = fabs((double)got[0][i] - want[i]);
        if (a > max_want) max_want = a;
        if (diff > max_diff) max_diff = diff;
    }
    check(max_diff <= MOE_TOL * max_want + 1e-6, "%s moe n_tok=%lld: max |neon - portable| %g > %g x max |portable| %g",
          type_name(type), (long long)n_tok, max_diff, MOE_TOL, max_want);

    for (int p = 0; p < N_POOLS; p++) free(got[p]);
    free(want);
    free(weight);
    free(expert_of);
    free(x);
    for (int e = 0; e < E; e++) {
        weights_free(&gate[e]);
        weights_free(&up[e]);
        weights_free(&down[e]);
    }
}

/* Latent attention (col_mla_block) with weights of `type`, q's low-rank path on or off: the
NEON level against the portable one (MOE_TOL: int8 activations in several products), and the
same bits for 1, 2 and 3 threads. */
static void check_mla(int type, int64_t q_rank, int64_t n_tok, col_pool *const *pools) {
    enum { D = 64, H = 4, C = 64, N = 32, R = 16, VD = 32, L = C + R };
    const int64_t QH = H * (N + R);
    weights q_a = weights_random(type, q_rank ? q_rank : QH, D, 0.2), q_b = weights_random(type, QH, q_rank ? q_rank : 64, 0.2);
    weights kv_a = weights_random(type, L, D, 0.2), kv_b = weights_random(type, H * (N + VD), C, 0.2);
    weights wo = weights_random(type, D, H * VD, 0.2);
    float norm[D], q_a_norm[64], kv_a_norm[C];
    fill_gaussian(norm, D, 0.2);
    fill_gaussian(q_a_norm, 64, 0.2);
    fill_gaussian(kv_a_norm, C, 0.2);
    for (int i = 0; i < D; i++) norm[i] += 1.0f;
    for (int i = 0; i < 64; i++) q_a_norm[i] += 1.0f;
    for (int i = 0; i < C; i++) kv_a_norm[i] += 1.0f;
    col_mla_layer l = {0};
    l.dim = D, l.n_heads = H, l.q_rank = q_rank, l.kv_rank = C, l.nope_dim = N, l.rope_dim = R, l.v_dim = VD;
    l.eps = 1e-5f, l.scale = 0.15f, l.rope_interleaved = 1;
    l.in_type = l.qb_type = l.kvb_type = l.o_type = type;
    l.norm = norm, l.wkv_a = kv_a.packed, l.kv_a_norm = kv_a_norm, l.wkv_b = kv_b.packed, l.wo = wo.packed;
    if (q_rank) l.wq_a = q_a.packed, l.q_a_norm = q_a_norm, l.wq_b = q_b.packed;
    else l.wq = q_a.packed;
    float *x = must_alloc((size_t)(n_tok * D) * sizeof(float)), *cos_t = must_alloc((size_t)(n_tok * R) * sizeof(float));
    float *sin_t = must_alloc((size_t)(n_tok * R) * sizeof(float));
    fill_gaussian(x, n_tok * D, 1.0);
    for (int64_t t = 0; t < n_tok; t++)
        for (int i = 0; i < R; i++) {
            const double angle = (double)t * pow(10000.0, -(double)(2 * (i % (R / 2))) / R);
            cos_t[t * R + i] = (float)cos(angle);
            sin_t[t * R + i] = (float)sin(angle);
        }
    const size_t x_bytes = (size_t)(n_tok * D) * sizeof(float), cache_bytes = (size_t)(n_tok * L) * sizeof(float);
    float *want = must_alloc(x_bytes), *want_cache = must_alloc(cache_bytes), *got[N_POOLS], *cache[N_POOLS];
    memcpy(want, x, x_bytes);
    must(col_kernels_set(COL_KERNELS_PORTABLE), "col_kernels_set");
    must(col_mla_block(pools[0], &l, want, n_tok, cos_t, sin_t, want_cache, 0), "col_mla_block");
    must(col_kernels_set(COL_KERNELS_NEON), "col_kernels_set");
    for (int p = 0; p < N_POOLS; p++) {
        got[p] = must_alloc(x_bytes);
        cache[p] = must_alloc(cache_bytes);
        memcpy(got[p], x, x_bytes);
        must(col_mla_block(pools[p], &l, got[p], n_tok, cos_t, sin_t, cache[p], 0), "col_mla_block");
    }
    for (int p = 1; p < N_POOLS; p++)
        check(memcmp(got[p], got[0], x_bytes) == 0 && memcmp(cache[p], cache[0], cache_bytes) == 0,
              "%s mla q_rank=%lld n_tok=%lld: %d threads differ from 1", type_name(type), (long long)q_rank,
              (long long)n_tok, p + 1);
    double max_want = 0.0, max_diff = 0.0;
    for (int64_t i = 0; i < n_tok * D; i++) { /* the attention's contribution: x + a - x */
        const double a = fabs((double)want[i] - x[i]), diff = fabs((double)got[0][i] - want[i]);
        if (a > max_want) max_want = a;
        if (diff > max_diff) max_diff = diff;
    }
    check(max_diff <= MOE_TOL * max_want + 1e-6, "%s mla q_rank=%lld n_tok=%lld: max |neon - portable| %g > %g x %g",
          type_name(type), (long long)q_rank, (long long)n_tok, max_diff, MOE_TOL, max_want);
    for (int p = 0; p < N_POOLS; p++) {
        free(got[p]);
        free(cache[p]);
    }
    free(want);
    free(want_cache);
    free(x);
    free(cos_t);
    free(sin_t);
    weights_free(&q_a);
    weights_free(&q_b);
    weights_free(&kv_a);
    weights_free(&kv_b);
    weights_free(&wo);
}

/* One Gated DeltaNet step (col_deltanet_block) of n_tok tokens from non-zero states: the NEON
level against the portable one, and the same bits for 1, 2 and 3 threads. f32 weights isolate
the small float products (the NEON gemm, whose 16-column tiles leave tails here: Dk 20, chunks
of 64 and 6): DELTANET_F32_TOL. Integer weights add int8 activations in the input and output
products, whose rounding every token's state inherits and the gated RMSNorm rescales:
DELTANET_INT8_TOL (tests/test_native_deltanet.py's tolerances). */
#define DELTANET_F32_TOL 1e-4
#define DELTANET_INT8_TOL 6e-2

static void check_deltanet(int type, int64_t n_tok, col_pool *const *pools) {
    enum { D = 64, HK = 1, HV = 2, DK = 20, DV = 32, KC = 4, C = 2 * HK * DK + HV * DV, Z = HV * DV };
    weights qkv = weights_random(type, C, D, 0.12), z = weights_random(type, Z, D, 0.12);
    weights b = weights_random(type, HV, D, 0.12), a = weights_random(type, HV, D, 0.12);
    weights wo = weights_random(type, D, Z, 0.17);
    float norm[D], conv[C * KC], A_log[HV] = {-2.0f, 1.5f}, dt_bias[HV], gate_norm[DV];
    fill_gaussian(norm, D, 0.2);
    fill_gaussian(conv, C * KC, 0.5);
    fill_gaussian(dt_bias, HV, 0.5);
    fill_gaussian(gate_norm, DV, 0.2);
    for (int i = 0; i < D; i++) norm[i] += 1.0f;
    for (int i = 0; i < DV; i++) gate_norm[i] += 1.0f;
    col_deltanet_layer l = {0};
    l.dim = D, l.n_k_heads = HK, l.n_v_heads = HV, l.k_head_dim = DK, l.v_head_dim = DV, l.conv_kernel = KC;
    l.eps = 1e-6f, l.norm_eps = 1e-6f, l.in_type = l.o_type = type;
    l.norm = norm, l.wqkv = qkv.packed, l.wz = z.packed, l.wb = b.packed, l.wa = a.packed, l.wo = wo.packed;
    l.conv = conv, l.A_log = A_log, l.dt_bias = dt_bias, l.gate_norm = gate_norm;
    const size_t x_bytes = (size_t)(n_tok * D) * sizeof(float), conv_bytes = (KC - 1) * C * sizeof(float);
    const size_t state_bytes = HV * DK * DV * sizeof(float);
    float *x = must_alloc(x_bytes), *conv0 = must_alloc(conv_bytes), *state0 = must_alloc(state_bytes);
    fill_gaussian(x, n_tok * D, 1.0);
    fill_gaussian(conv0, (KC - 1) * C, 1.0);
    fill_gaussian(state0, HV * DK * DV, 0.3);
    float *want[3], *got[N_POOLS][3]; /* x, conv state, recurrent state */
    const size_t bytes[3] = {x_bytes, conv_bytes, state_bytes};
    const float *start[3] = {x, conv0, state0};
    for (int p = -1; p < N_POOLS; p++) {
        float **out = p < 0 ? want : got[p];
        for (int i = 0; i < 3; i++) {
            out[i] = must_alloc(bytes[i]);
            memcpy(out[i], start[i], bytes[i]);
        }
        must(col_kernels_set(p < 0 ? COL_KERNELS_PORTABLE : COL_KERNELS_NEON), "col_kernels_set");
        must(col_deltanet_block(pools[p < 0 ? 0 : p], &l, out[0], n_tok, out[1], out[2]), "col_deltanet_block");
    }
    for (int p = 1; p < N_POOLS; p++)
        for (int i = 0; i < 3; i++)
            check(memcmp(got[p][i], got[0][i], bytes[i]) == 0, "%s deltanet n_tok=%lld: %d threads differ from 1 (output %d)",
                  type_name(type), (long long)n_tok, p + 1, i);
    for (int i = 0; i < 3; i++) { /* x: the layer's contribution (x + o - x); the states as they are */
        double max_want = 0.0, max_diff = 0.0;
        for (size_t e = 0; e < bytes[i] / sizeof(float); e++) {
            const double w = (double)want[i][e] - (i == 0 ? x[e] : 0.0), diff = fabs((double)got[0][i][e] - want[i][e]);
            if (fabs(w) > max_want) max_want = fabs(w);
            if (diff > max_diff) max_diff = diff;
        }
        const double tol = type == COL_TYPE_F32 ? DELTANET_F32_TOL : DELTANET_INT8_TOL;
        check(max_diff <= tol * max_want + 1e-6, "%s deltanet n_tok=%lld output %d: max |neon - portable| %g > %g x %g",
              type_name(type), (long long)n_tok, i, max_diff, tol, max_want);
    }
    for (int i = 0; i < 3; i++) {
        free(want[i]);
        for (int p = 0; p < N_POOLS; p++) free(got[p][i]);
    }
    free(x);
    free(conv0);
    free(state0);
    weights_free(&qkv);
    weights_free(&z);
    weights_free(&b);
    weights_free(&a);
    weights_free(&wo);
}

int main(void) {
    /* on aarch64 NEON is always there, and the best level */
    check(col_kernels_supported(COL_KERNELS_NEON), "the neon level is not supported by this build");
    check(col_kernels_get() == COL_KERNELS_NEON, "the default level is %s, not neon", col_kernels_name(col_kernels_get()));
    if (!col_kernels_supported(COL_KERNELS_NEON)) {
        printf("neon_check: FAIL (%d of %d checks)\n", n_failed, n_checks);
        return 1;
    }

    col_pool *pools[N_POOLS];
    for (int p = 0; p < N_POOLS; p++) {
        col_pool_params params = col_pool_default_params();
        params.n_threads = p + 1;
        must(col_pool_create(&params, &pools[p]), "col_pool_create");
    }
    static const int types[] = {COL_TYPE_Q8_0, COL_TYPE_Q4_G64, COL_TYPE_MXFP4};
    for (int i = 0; i < 3; i++) {
        rng_state = 100 + (uint64_t)i;
        for (size_t s = 0; s < sizeof SHAPES / sizeof SHAPES[0]; s++) check_matmul(types[i], &SHAPES[s], pools);
        check_rounding(types[i]);
        check_moe(types[i], 1, pools);
        check_moe(types[i], 5, pools);
        check_mla(types[i], 64, 5, pools);
        check_mla(types[i], 0, 1, pools);
        check_deltanet(types[i], 70, pools);
        check_deltanet(types[i], 1, pools);
    }
    check_deltanet(COL_TYPE_F32, 70, pools);
    check_deltanet(COL_TYPE_F32, 1, pools);
    for (int p = 0; p < N_POOLS; p++) col_pool_destroy(pools[p]);

    printf("neon_check: %s (%d of %d checks failed; q8_0, q4_g64 and mxfp4 matmul on %zu shapes, "
           "rounding, fused experts, latent attention, gated deltanet; neon vs portable)\n",
           n_failed ? "FAIL" : "PASS", n_failed, n_checks, sizeof SHAPES / sizeof SHAPES[0]);
    return n_failed ? 1 : 0;
}
