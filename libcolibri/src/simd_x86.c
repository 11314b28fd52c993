/*
 * simd_x86.c — integer dot products of q8_0 / q4_g64 / mxfp4 weight rows with int8 activations
 * (col_xq_row, see col_internal.h) for AVX2, AVX-512 and AVX-512 VNNI.
 *
 * Each function is compiled for its own ISA with __attribute__((target)), so the library as
 * a whole still runs on any x86-64; kernels.c only hands out a level after
 * __builtin_cpu_supports said yes.
 *
 * The integer core of every variant is "sum of u8 x s8 products in int32 lanes":
 *   AVX2 / AVX-512: vpmaddubsw (pairs into int16) then vpmaddwd with ones (into int32);
 *                   the u8 operand must be small enough not to saturate int16: |w| <= 128
 *                   via the sign trick for q8_0, q <= 15 for q4_g64.
 *   VNNI:           vpdpbusd does both steps without saturation; q8_0 weights are made
 *                   unsigned by adding 128 (xor 0x80), and the sum starts at -128 * sum(x)
 *                   (the activation row's precomputed bias lane) to cancel it.
 * Lanes are converted to float per block and scaled by (weight scale) x (activation scale).
 * q8_0 and q4_g64 run in panels of eight weight rows on AVX2 and on AVX-512 VNNI, the two
 * levels with the same float chain (so the same bits); the plain AVX-512 level and mxfp4 take
 * one row at a time (dot; on VNNI mxfp4 also dotn, two to four tokens per weight block).
 */
#include <math.h>

#include "col_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))
#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")))

/* Decode streams every weight row once from DRAM, and one core alone keeps too few misses in
 * flight to reach the memory's bandwidth (the hardware prefetcher also stops at each 4 KiB
 * page). The matrix-vector loops therefore ask for the lines STREAM_AHEAD bytes ahead of the
 * block they read, `lines` = ceil(bytes a loop step consumes / 64) per step: consecutive
 * steps then ask for every line at least once (steps of 136-144 bytes need 3, 68 need 2,
 * 36 need 1; fewer would fall behind).
 * Measured on a cold 2048 x 2048 product, one thread, AVX-512 VNNI: q4_g64 25 -> 35-38 GB/s
 * (2 KiB ahead, two lines, before), q8_0 30 -> 33-37 GB/s (none before); 4 and 16 KiB were
 * slower than 8. */
#define STREAM_AHEAD 8192
static inline void prefetch_stream(const uint8_t *p, int lines) {
    for (int i = 0; i < lines; i++) _mm_prefetch((const char *)(p + STREAM_AHEAD + 64 * i), _MM_HINT_T0);
}

/* ---- AVX2 ----------------------------------------------------------------------------- */

TARGET_AVX2 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TARGET_AVX2 static inline float f16_avx2(const uint8_t *p) { return _cvtsh_ss(col_load_u16(p)); }

static inline uint32_t load_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* ---- AVX2: panels of eight weight rows (q8_0, q4_g64) ------------------------------------
 * Without VNNI every 32 products cost two multiplies (vpmaddubsw into int16 pairs, vpmaddwd
 * into int32 quads) whatever the layout; what a kernel can save is the rest. These kernels
 * take a panel of eight weight rows and reduce, per block and token, each row's products to
 * one exact int32 sum, the eight rows in the eight lanes of one register (a tree of
 * unpacks and adds).
 * The float work is then one conversion, one scale product and one fma per block for eight
 * rows at once, the eight rows' f16 scales are converted together, and up to four tokens
 * share each step's weight loads, signs and nibbles (llama.cpp's repacked AVX2 Q4_0 gemm has
 * the same lanes-are-rows accumulators, reached by interleaving the rows on disk instead).
 *
 * Every (row, token) result is one chain of float operations, the same whatever the panel,
 * the lane or the number of tokens in the call:  acc = 0, then for each block b in order
 *   q8_0:   acc = fma(float(isum_b), dw_b * dx_b, acc)
 *   q4_g64: acc = fma(float(isum_b), dw_b * dx_b, acc); acc = fma(mw_b, ds2_b, acc)
 * with isum_b the exact integer sum of block b's products (|isum_b| < 2^24: exact in float).
 * A token's output therefore does not depend on which rows or tokens share the call:
 * decode equals prefill bit for bit. */
#define PANEL_ROWS 8
#define PANEL_TOKENS 4

/* Two rows' eight int32 lanes a, b folded to four each: [a0+a2, b0+b2, a1+a3, b1+b3 | the same
 * of lanes 4..7]. Unpacks and an add (single-uop everywhere) do what vphaddd does, which is
 * as fast on Zen 5 and slower on older cores. */
TARGET_AVX2 static inline __m256i pair_fold(__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}
/* Two pair folds (rows a, b and c, d) to one: [a0-3, b0-3, c0-3, d0-3 | a4-7, b4-7, c4-7, d4-7]
 * (each entry the sum of those lanes). */
TARGET_AVX2 static inline __m256i quad_fold(__m256i ab, __m256i cd) {
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

/* Eight rows' int32 partial sums p[r] (eight lanes each) folded to one register, lane r =
 * row r's total. */
TARGET_AVX2 static inline __m256i fold_rows8(const __m256i *p) {
    const __m256i lo = quad_fold(pair_fold(p[0], p[1]), pair_fold(p[2], p[3])); /* [rows 0-3, lanes 0-3 | rows 0-3, lanes 4-7] */
    const __m256i hi = quad_fold(pair_fold(p[4], p[5]), pair_fold(p[6], p[7])); /* rows 4-7 likewise */
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

/* The f16 scales at byte `off` of the eight rows, as float32 lanes. */
TARGET_AVX2 static inline __m256 f16_scales8(const uint8_t *const *row, int64_t off) {
    return _mm256_cvtph_ps(_mm_setr_epi16((short)col_load_u16(row[0] + off), (short)col_load_u16(row[1] + off),
                                          (short)col_load_u16(row[2] + off), (short)col_load_u16(row[3] + off),
                                          (short)col_load_u16(row[4] + off), (short)col_load_u16(row[5] + off),
                                          (short)col_load_u16(row[6] + off), (short)col_load_u16(row[7] + off)));
}

/* Row r of a panel of n_rows (1..8) rows from w: the last real row stands in for missing
 * ones (their lanes are computed and dropped), so every panel is a full one. */
static inline void panel_rows(const uint8_t *w, int64_t row_bytes, int64_t n_rows, const uint8_t *row[PANEL_ROWS]) {
    for (int64_t r = 0; r < PANEL_ROWS; r++) row[r] = w + (r < n_rows ? r : n_rows - 1) * row_bytes;
}

/* y[t * y_stride + r] = lane r of acc[t] for the panel's n_rows real rows. */
TARGET_AVX2 static inline void panel_store(const __m256 *acc, int nt, int64_t n_rows, float *y, int64_t y_stride) {
    for (int t = 0; t < nt; t++) {
        if (n_rows == PANEL_ROWS) {
            _mm256_storeu_ps(y + t * y_stride, acc[t]);
        } else {
            float v[PANEL_ROWS];
            _mm256_storeu_ps(v, acc[t]);
            for (int64_t r = 0; r < n_rows; r++) y[t * y_stride + r] = v[r];
        }
    }
}

/* A panel streams from DRAM the first time it is read (decode, and an expert's first tokens
 * in a prompt): eight sequential streams at once, which the hardware prefetchers follow
 * poorly. So each block step asks for the next step_bytes (eight blocks' worth) of the panel
 * `ahead` bytes further on (rows are consecutive: a whole number of panels, at least
 * STREAM_AHEAD): over one panel's steps, all of that later panel is requested, in address
 * order. Measured on a cold 32768 x 2048 q8_0 product, one token, AVX2 on Zen 5: 36-38 GB/s
 * (as the one-row kernel before); a line 0.5 / 1 / 2 KiB ahead in each of the eight rows gave
 * 22 / 30 / 35. */
static inline int64_t stream_ahead_bytes(int64_t group_bytes) { /* a group: a panel's or a tile's rows */
    return group_bytes > 0 ? (STREAM_AHEAD + group_bytes - 1) / group_bytes * group_bytes : 0;
}

/* prefetcht0 (into L1) and prefetcht1 (into L2) of the line at p. asm statements: GCC 12
 * silently deleted every _mm_prefetch of the panel loops (whose address depends on the row
 * length), which left the kernels waiting on DRAM at a third of the bandwidth. */
static inline void prefetch_line(const uint8_t *p) { __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)p)); }
static inline void prefetch_line_l2(const uint8_t *p) { __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)p)); }

/* Block step `off` (bytes into each row) of the group of `rows` rows from first: `lines`
 * lines from first + ahead + rows * off into L1, and as many from a group further on
 * (first + 2 * ahead + rows * off) into L2; ahead 0: none (the later token groups of a
 * panel, whose first group asked for the lines).
 * Why two distances: one core keeps only as many lines in flight as L1 has fill buffers
 * (16 on these Intel cores), too few to cover DRAM's latency at its bandwidth; the L2
 * requests run a group further ahead, so the L1 requests mostly meet the lines in L2.
 * Measured on cold products, one token, one thread, alternating call by call (Xeon Emerald
 * Rapids, membw 12.7 GB/s): 2048-wide q8_0 rows 12.7 -> 15.2 GB/s, q4_g64 11.1 -> 13.1, the
 * fused expert call 12.0 -> 14.1 (q8_0) and 10.8 -> 12.7 (q4_g64) on AVX2, the same on
 * AVX-512 VNNI; 3 or 5 groups ahead instead of 2 measured the same, and the L1 requests alone
 * a group further ahead slower. */
static inline void prefetch_group_step(const uint8_t *first, int64_t rows, int64_t ahead, int64_t off, int lines) {
    if (!ahead) return;
    /* an address past the matrix is harmless for a prefetch; computed as an integer because
     * C does not allow such a pointer */
    const uint8_t *p = (const uint8_t *)((uintptr_t)first + (uintptr_t)(ahead + rows * off));
#pragma GCC unroll 8
    for (int i = 0; i < lines; i++) prefetch_line(p + 64 * i);
#pragma GCC unroll 8 /* GCC 12 left this loop rolled: an add, compare and branch a line */
    for (int i = 0; i < lines; i++) prefetch_line_l2(p + ahead + 64 * i);
}

/* A panel's step: 5 lines cover the 272 / 288 bytes of a q8_0 / q4_g64 step. */
static inline void prefetch_panel_step(const uint8_t *const *row, int64_t ahead, int64_t off) {
    prefetch_group_step(row[0], PANEL_ROWS, ahead, off, 5);
}

/* The float chain of a panel (see above), one block step of token t: the same code on every
 * panel level, which is what makes their bits the same. */
TARGET_AVX2 static inline __m256 q8_chain_step(__m256 acc, __m256i isum, __m256 dw, float dx) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc);
}
TARGET_AVX2 static inline __m256 q4_chain_step(__m256 acc, __m256i isum, __m256 dw, __m256 mw, float dx, float ds2) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc);
    return _mm256_fmadd_ps(mw, _mm256_set1_ps(ds2), acc);
}

/* q8_0 block `off` of the eight rows against 32 activations xq: the exact int32 sums. |w|
 * and x with w's sign keep vpmaddubsw's u8 operand <= 128 (w = -128 included). */
TARGET_AVX2 static inline __m256i q8_block_sums8(const uint8_t *const *row, int64_t off, __m256i xq) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p[PANEL_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < PANEL_ROWS; r++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(row[r] + off + 2));
        p[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w)), ones);
    }
    return fold_rows8(p);
}

/* acc[t] (lane r) = row r . token t over nb blocks, for nt (1..4) tokens. always_inline: one copy per nt with the accumulators in registers. */
TARGET_AVX2 static inline __attribute__((always_inline)) void q8_panel_avx2(const uint8_t *const *row, const col_xq_row *x,
                                                                            const int nt, int64_t nb, __m256 *acc,
                                                                            int64_t ahead) {
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t off = b * 34;
        prefetch_panel_step(row, ahead, off);
        const __m256 dw = f16_scales8(row, off);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            const __m256i isum = q8_block_sums8(row, off, _mm256_load_si256((const __m256i *)(x[t].qs + b * 32)));
            acc[t] = q8_chain_step(acc[t], isum, dw, x[t].d[b]);
        }
    }
}

/* rows_xq of a panel kernel: panels of PANEL_ROWS rows, each met by groups of up to
 * PANEL_TOKENS tokens; the switch hands the panel a constant token count, so each count is
 * compiled with its loops unrolled. */
#define PANEL_ROWS_XQ(target, name, panel)                                                                          \
    target static void name(const uint8_t *w, int64_t row_bytes, int64_t n_rows, const col_xq_row *x,          \
                                 int64_t n_tok, int64_t nb, float *y, int64_t y_stride) {                           \
        const int64_t ahead = stream_ahead_bytes(PANEL_ROWS * row_bytes);                                                         \
        for (int64_t r0 = 0; r0 < n_rows; r0 += PANEL_ROWS) {                                                       \
            const int64_t nr = n_rows - r0 < PANEL_ROWS ? n_rows - r0 : PANEL_ROWS;                                 \
            const uint8_t *row[PANEL_ROWS];                                                                         \
            panel_rows(w + r0 * row_bytes, row_bytes, nr, row);                                                     \
            for (int64_t t0 = 0; t0 < n_tok; t0 += PANEL_TOKENS) {                                                  \
                const int nt = n_tok - t0 < PANEL_TOKENS ? (int)(n_tok - t0) : PANEL_TOKENS;                        \
                __m256 acc[PANEL_TOKENS];                                                                           \
                const int64_t ask = t0 == 0 ? ahead : 0; /* only the first group asks for the lines */              \
                switch (nt) {                                                                                       \
                case 4: panel(row, x + t0, 4, nb, acc, ask); break;                                                 \
                case 3: panel(row, x + t0, 3, nb, acc, ask); break;                                                 \
                case 2: panel(row, x + t0, 2, nb, acc, ask); break;                                                 \
                default: panel(row, x + t0, 1, nb, acc, ask); break;                                                \
                }                                                                                                   \
                panel_store(acc, nt, nr, y + t0 * y_stride + r0, y_stride);                                         \
            }                                                                                                       \
        }                                                                                                           \
    }

PANEL_ROWS_XQ(TARGET_AVX2, rows_q8_0_avx2, q8_panel_avx2)

/* q4_g64 block `off` (64 values) of the eight rows against activations x0 (values 0..31)
 * and x1 (32..63): the exact int32 sums of the nibbles times x. Nibbles are <= 15, so the
 * two vpmaddubsw results add in int16 (|sum| <= 4 * 15 * 127) before one vpmaddwd. */
TARGET_AVX2 static inline __m256i q4_block_sums8(const uint8_t *const *row, int64_t off, __m256i x0, __m256i x1) {
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f);
    __m256i p[PANEL_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < PANEL_ROWS; r++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(row[r] + off + 4));
        const __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        p[r] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1)), ones);
    }
    return fold_rows8(p);
}

/* The (d, m) f16 pairs at byte `off` of the eight rows as float32 lanes: *d and *m. */
TARGET_AVX2 static inline void q4_scales8(const uint8_t *const *row, int64_t off, __m256 *d, __m256 *m) {
    const __m256i dm = _mm256_setr_epi32((int)load_u32(row[0] + off), (int)load_u32(row[1] + off),
                                         (int)load_u32(row[2] + off), (int)load_u32(row[3] + off),
                                         (int)load_u32(row[4] + off), (int)load_u32(row[5] + off),
                                         (int)load_u32(row[6] + off), (int)load_u32(row[7] + off));
    /* per 128-bit lane [d d d d m m m m], then the qwords reordered to [d0-3 d4-7 m0-3 m4-7] */
    const __m256i split = _mm256_shuffle_epi8(dm, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                                   0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m256i dd_mm = _mm256_permute4x64_epi64(split, 0xd8);
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(dd_mm));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(dd_mm, 1));
}

/* q4_g64 activations come in blocks of 64 (col_quantize_x): block k has scale x->d[k] and
 * offset sum x->ds2[k]; nb still counts 32-value blocks. */
TARGET_AVX2 static inline __attribute__((always_inline)) void q4_panel_avx2(const uint8_t *const *row, const col_xq_row *x,
                                                                            const int nt, int64_t nb, __m256 *acc,
                                                                            int64_t ahead) {
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < nb / 2; k++) {
        const int64_t off = k * 36;
        prefetch_panel_step(row, ahead, off);
        __m256 dw, mw;
        q4_scales8(row, off, &dw, &mw);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            const int8_t *xs = x[t].qs + k * 64;
            const __m256i isum = q4_block_sums8(row, off, _mm256_load_si256((const __m256i *)xs),
                                                _mm256_load_si256((const __m256i *)(xs + 32)));
            acc[t] = q4_chain_step(acc[t], isum, dw, mw, x[t].d[k], x[t].ds2[k]);
        }
    }
}

PANEL_ROWS_XQ(TARGET_AVX2, rows_q4_g64_avx2, q4_panel_avx2)

/* One row, one token through a panel kernel (a kernel table's dot_xq): the same arithmetic. */
#define PANEL_DOT_XQ(target, name, rows)                                        \
    target static float name(const uint8_t *w, const col_xq_row *x, int64_t nb) { \
        float y;                                                                \
        rows(w, 0, 1, x, 1, nb, &y, 1);                                         \
        return y;                                                               \
    }

PANEL_DOT_XQ(TARGET_AVX2, dot_q8_0_avx2, rows_q8_0_avx2)
PANEL_DOT_XQ(TARGET_AVX2, dot_q4_g64_avx2, rows_q4_g64_avx2)

/* ---- AVX-512 (with and without VNNI) -------------------------------------------------- */

/* [s0 x 8, s1 x 8] */
#define SCALE_PAIR(s0, s1) _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1)

TARGET_AVX512 static inline __m512i dot_u8s8_avx512(__m512i u, __m512i s) {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
}

/* ---- mxfp4 --------------------------------------------------------------------------------
 * A block's 16 code bytes become its 32 int8 weights (2 x e2m1, -12..12) in element order by
 * one byte shuffle: the low nibbles index elements 0..15, the high nibbles 16..31, into a
 * 16-entry table held in every 128-bit lane. The exponent byte gives the block's float factor
 * 2^(e - 128) (col_e8m0_half_to_f32), applied with the activation's scale. Activations come
 * in blocks of 32 (col_quantize_x), as for q8_0; so do the sums: a pair of blocks per step,
 * the odd block last. */

/* The 32 int8 weights of the block at blk. */
TARGET_AVX2 static inline __m256i mxfp4_weights_avx2(const uint8_t *blk, __m256i table, __m128i low4) {
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 1));
    const __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    return _mm256_shuffle_epi8(table, _mm256_set_m128i(hi, lo));
}

/* |w| and x with w's sign (|w| <= 12: vpmaddubsw cannot saturate), summed into 8 int32 lanes
 * and converted. */
TARGET_AVX2 static inline __m256 mxfp4_block_avx2(__m256i wq, const int8_t *xqs) {
    const __m256i xq = _mm256_load_si256((const __m256i *)xqs);
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

TARGET_AVX2 static float dot_mxfp4_avx2(const uint8_t *w, const col_xq_row *x, int64_t nb) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)col_e2m1_x2));
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *blk = w + b * 17;
        prefetch_stream(blk, 1);
        const __m256 p0 = mxfp4_block_avx2(mxfp4_weights_avx2(blk, table, low4), x->qs + b * 32);
        const __m256 p1 = mxfp4_block_avx2(mxfp4_weights_avx2(blk + 17, table, low4), x->qs + b * 32 + 32);
        acc0 = _mm256_fmadd_ps(p0, _mm256_set1_ps(col_e8m0_half_to_f32(blk[0]) * x->d[b]), acc0);
        acc1 = _mm256_fmadd_ps(p1, _mm256_set1_ps(col_e8m0_half_to_f32(blk[17]) * x->d[b + 1]), acc1);
    }
    if (b < nb) {
        const uint8_t *blk = w + b * 17;
        const __m256 p = mxfp4_block_avx2(mxfp4_weights_avx2(blk, table, low4), x->qs + b * 32);
        acc0 = _mm256_fmadd_ps(p, _mm256_set1_ps(col_e8m0_half_to_f32(blk[0]) * x->d[b]), acc0);
    }
    return hsum256(_mm256_add_ps(acc0, acc1));
}

/* Blocks b, b + 1 (at blk, blk + 17) side by side: the 64 code nibbles as table indexes in
 * element order, [lo0 hi0 | lo1 hi1]. */
TARGET_AVX512 static inline __m512i mxfp4_pair_indexes(const uint8_t *blk) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 1)), q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
    const __m256i i0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q0, 4), low4), _mm_and_si128(q0, low4));
    const __m256i i1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q1, 4), low4), _mm_and_si128(q1, low4));
    return _mm512_inserti64x4(_mm512_castsi256_si512(i0), i1, 1);
}

/* The last (odd) block, 256-bit, scaled: shared by both AVX-512 variants. */
TARGET_AVX512 static inline float mxfp4_tail_avx512(const uint8_t *blk, const int8_t *xqs, float dx) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)col_e2m1_x2));
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 1));
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m256i wq = _mm256_shuffle_epi8(table, _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low4),
                                                                   _mm_and_si128(q, low4)));
    const __m256i xq = _mm256_load_si256((const __m256i *)xqs);
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
    const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1))),
                                   _mm256_set1_ps(col_e8m0_half_to_f32(blk[0]) * dx));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TARGET_AVX512 static float dot_mxfp4_avx512(const uint8_t *w, const col_xq_row *x, int64_t nb) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)col_e2m1_x2));
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *blk = w + b * 17;
        prefetch_stream(blk, 1);
        const __m512i wq = _mm512_shuffle_epi8(table, mxfp4_pair_indexes(blk));
        const __m512i xq = _mm512_load_si512((const void *)(x->qs + b * 32));
        const __mmask64 neg = _mm512_movepi8_mask(wq);
        const __m512i sx = _mm512_mask_sub_epi8(xq, neg, zero, xq);
        const __m512 p = _mm512_cvtepi32_ps(dot_u8s8_avx512(_mm512_abs_epi8(wq), sx));
        const __m512 s = _mm512_mul_ps(_mm512_load_ps(x->dv + b * 8),
                                       SCALE_PAIR(col_e8m0_half_to_f32(blk[0]), col_e8m0_half_to_f32(blk[17])));
        acc = _mm512_fmadd_ps(p, s, acc);
    }
    float total = _mm512_reduce_add_ps(acc);
    if (b < nb) total += mxfp4_tail_avx512(w + b * 17, x->qs + b * 32, x->d[b]);
    return total;
}

/* VNNI: the table holds w + 128 (0x80 ^ w: 116..140, unsigned), so vpdpbusd multiplies it
 * with the signed activations directly; the sum starts at the activation row's bias lane,
 * -128 * sum(x), which cancels the 128s (as for q8_0). One token's pair step: */
#define MX_PAIR(t, acc)                                                                                       \
    acc = _mm512_fmadd_ps(                                                                                    \
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(                                                 \
                          _mm512_load_si512((const void *)(x[t].bias + b * 8)), u,                            \
                          _mm512_load_si512((const void *)(x[t].qs + b * 32)))),                              \
                      _mm512_load_ps(x[t].dv + b * 8)),                                                       \
        sw, acc)

TARGET_VNNI static inline __m512i mxfp4_table_u8_vnni(void) {
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)col_e2m1_x2)),
                            _mm512_set1_epi8((char)0x80));
}

/* dot and dotn below run the same arithmetic per token in the same order (pairs into one
 * accumulator, reduce, then the odd block), so a token's result is the same alone or in a
 * group of two to four: decode equals prefill bit for bit. */
TARGET_VNNI static float dot_mxfp4_vnni(const uint8_t *w, const col_xq_row *x, int64_t nb) {
    const __m512i table = mxfp4_table_u8_vnni();
    __m512 a0 = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *blk = w + b * 17;
        prefetch_stream(blk, 1);
        const __m512i u = _mm512_shuffle_epi8(table, mxfp4_pair_indexes(blk));
        const __m512 sw = SCALE_PAIR(col_e8m0_half_to_f32(blk[0]), col_e8m0_half_to_f32(blk[17]));
        MX_PAIR(0, a0);
    }
    float total = _mm512_reduce_add_ps(a0);
    if (b < nb) total += mxfp4_tail_avx512(w + b * 17, x[0].qs + b * 32, x[0].d[b]);
    return total;
}

TARGET_VNNI static inline __attribute__((always_inline)) void dotn_mxfp4_vnni_body(const uint8_t *w, const col_xq_row *x,
                                                                                  int64_t nb, const int n, float *out) {
    const __m512i table = mxfp4_table_u8_vnni();
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *blk = w + b * 17;
        const __m512i u = _mm512_shuffle_epi8(table, mxfp4_pair_indexes(blk));
        const __m512 sw = SCALE_PAIR(col_e8m0_half_to_f32(blk[0]), col_e8m0_half_to_f32(blk[17]));
        MX_PAIR(0, a0);
        if (n > 1) MX_PAIR(1, a1);
        if (n > 2) MX_PAIR(2, a2);
        if (n > 3) MX_PAIR(3, a3);
    }
    const __m512 acc[4] = {a0, a1, a2, a3};
    for (int t = 0; t < n; t++) {
        out[t] = _mm512_reduce_add_ps(acc[t]);
        if (b < nb) out[t] += mxfp4_tail_avx512(w + b * 17, x[t].qs + b * 32, x[t].d[b]);
    }
}

TARGET_VNNI static void dotn_mxfp4_vnni(const uint8_t *w, const col_xq_row *x, int64_t nb, int n, float *out) {
    switch (n) {
    case 2: dotn_mxfp4_vnni_body(w, x, nb, 2, out); break;
    case 3: dotn_mxfp4_vnni_body(w, x, nb, 3, out); break;
    default: dotn_mxfp4_vnni_body(w, x, nb, 4, out); break;
    }
}

/* ---- float helpers for attention -------------------------------------------------------- */

/* The dot and axpy of each level, always inlined: col_attend_block's level versions expand
 * them in place, the kernel set's entries call them, so both do the same operations. Each
 * comes in two versions that differ only in how they load the cache's row (b, x): float32,
 * or float16 converted exactly as it is loaded (F16C), so a float16 cache gives the bits of a
 * float32 one holding the same values. */
#define AI __attribute__((always_inline))
static inline float f32_as_f32(float v) { return v; }
TARGET_AVX2 static inline AI __m256 load8_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
TARGET_AVX512 static inline AI __m512 load16_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

#define DOT_AXPY_AVX2(suffix, elem_t, load8, scalar)                                                                 \
    TARGET_AVX2 static inline AI float dot_##suffix##_avx2_inline(const float *a, const elem_t *b, int64_t n) {       \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                               \
        int64_t i = 0;                                                                                               \
        for (; i + 16 <= n; i += 16) {                                                                               \
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);                                      \
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), acc1);                              \
        }                                                                                                            \
        float sum = hsum256(_mm256_add_ps(acc0, acc1));                                                              \
        for (; i < n; i++) sum += a[i] * scalar(b[i]);                                                               \
        return sum;                                                                                                  \
    }                                                                                                                \
    TARGET_AVX2 static inline AI void axpy_##suffix##_avx2_inline(float *y, float a, const elem_t *x, int64_t n) {    \
        const __m256 va = _mm256_set1_ps(a);                                                                         \
        int64_t i = 0;                                                                                               \
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load8(x + i), _mm256_loadu_ps(y + i))); \
        for (; i < n; i++) y[i] += a * scalar(x[i]);                                                                 \
    }
DOT_AXPY_AVX2(f32, float, _mm256_loadu_ps, f32_as_f32)
DOT_AXPY_AVX2(f16, uint16_t, load8_f16, col_f16_to_f32)

#define DOT_AXPY_AVX512(suffix, elem_t, load16, scalar)                                                              \
    TARGET_AVX512 static inline AI float dot_##suffix##_avx512_inline(const float *a, const elem_t *b, int64_t n) {   \
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();                                               \
        int64_t i = 0;                                                                                               \
        for (; i + 32 <= n; i += 32) {                                                                               \
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), acc0);                                     \
            acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), load16(b + i + 16), acc1);                           \
        }                                                                                                            \
        for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), acc0);            \
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));                                                 \
        for (; i < n; i++) sum += a[i] * scalar(b[i]);                                                               \
        return sum;                                                                                                  \
    }                                                                                                                \
    TARGET_AVX512 static inline AI void axpy_##suffix##_avx512_inline(float *y, float a, const elem_t *x, int64_t n) { \
        const __m512 va = _mm512_set1_ps(a);                                                                         \
        int64_t i = 0;                                                                                               \
        for (; i + 16 <= n; i += 16)                                                                                 \
            _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, load16(x + i), _mm512_loadu_ps(y + i)));                     \
        for (; i < n; i++) y[i] += a * scalar(x[i]);                                                                 \
    }
DOT_AXPY_AVX512(f32, float, _mm512_loadu_ps, f32_as_f32)
DOT_AXPY_AVX512(f16, uint16_t, load16_f16, col_f16_to_f32)

/* COL_ATTEND_VALUES with each query's output held in registers over a tile of keys: per
 * (query, key) one load and one fma a vector of the head, and the output stored once a tile
 * instead of once a key (axpy loads and stores it at every key). Each output element gets the
 * same fmas in the same key order as through axpy, the weight sc * inv rounded the same way,
 * so the bits are COL_ATTEND_VALUES'. Needs head_dim a multiple of the lanes (the callers
 * check); vals + c: the chunk's first value of a row, float32 or (loadv converting) float16. */
#define VALUE_TILE_KEYS 64 /* the tile's value rows of one kv head: 32 KiB at head_dim 128 */
#define VALUES_IN_REGISTERS(target, name, elem_t, vec, lanes, loadu, loadv, storeu, fmadd, set1)                    \
    target static inline AI void name##_chunk(float *ov, const elem_t *vals, int64_t K, int64_t kh, int64_t Hd,     \
                                              int64_t ring, const float *p, float inv, int64_t b, int64_t e,         \
                                              const int vecs) {                                                      \
        vec acc[4];                                                                                                 \
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) acc[v] = loadu(ov + v * (lanes));                    \
        for (int64_t s = b; s <= e; s++) {                                                                          \
            const elem_t *vs = vals + col_cache_offset(s, ring, K, kh, Hd);                                         \
            if (s + COL_ATTEND_AHEAD <= e)                                                                          \
                col_prefetch_bytes(vals + col_cache_offset(s + COL_ATTEND_AHEAD, ring, K, kh, Hd),                  \
                                   vecs * (lanes) * (int64_t)sizeof(elem_t));                                       \
            const vec a = set1(p[s] * inv);                                                                         \
            _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) acc[v] = fmadd(a, loadv(vs + v * (lanes)), acc[v]); \
        }                                                                                                           \
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) storeu(ov + v * (lanes), acc[v]);                    \
    }                                                                                                               \
    target static void name(const col_attend_query *q, int n, const elem_t *vals, int64_t K, int64_t Hd,            \
                            int64_t ring, const float *sc, int64_t stride, const float *inv, int64_t first,         \
                            int64_t last) {                                                                         \
        for (int64_t s0 = first; s0 <= last; s0 += VALUE_TILE_KEYS) {                                               \
            const int64_t s1 = s0 + VALUE_TILE_KEYS - 1 < last ? s0 + VALUE_TILE_KEYS - 1 : last;                   \
            for (int i = 0; i < n; i++) {                                                                           \
                const int64_t b = s0 > q[i].lo ? s0 : q[i].lo, e = s1 < q[i].hi ? s1 : q[i].hi;                     \
                if (b > e) continue;                                                                                \
                const float *p = sc + i * stride - q[i].lo; /* p[s]: key s's weight before 1 / sum */               \
                int64_t c = 0;                                                                                      \
                for (; c + 4 * (lanes) <= Hd; c += 4 * (lanes))                                                     \
                    name##_chunk(q[i].ov + c, vals + c, K, q[i].kh, Hd, ring, p, inv[i], b, e, 4);                  \
                for (; c < Hd; c += (lanes))                                                                        \
                    name##_chunk(q[i].ov + c, vals + c, K, q[i].kh, Hd, ring, p, inv[i], b, e, 1);                  \
            }                                                                                                       \
        }                                                                                                           \
    }

VALUES_IN_REGISTERS(TARGET_AVX2, values_f32_avx2, float, __m256, 8, _mm256_loadu_ps, _mm256_loadu_ps,
                    _mm256_storeu_ps, _mm256_fmadd_ps, _mm256_set1_ps)
VALUES_IN_REGISTERS(TARGET_AVX2, values_f16_avx2, uint16_t, __m256, 8, _mm256_loadu_ps, load8_f16, _mm256_storeu_ps,
                    _mm256_fmadd_ps, _mm256_set1_ps)
VALUES_IN_REGISTERS(TARGET_AVX512, values_f32_avx512, float, __m512, 16, _mm512_loadu_ps, _mm512_loadu_ps,
                    _mm512_storeu_ps, _mm512_fmadd_ps, _mm512_set1_ps)
VALUES_IN_REGISTERS(TARGET_AVX512, values_f16_avx512, uint16_t, __m512, 16, _mm512_loadu_ps, load16_f16,
                    _mm512_storeu_ps, _mm512_fmadd_ps, _mm512_set1_ps)

/* A level's attention over a cache of elem_t (float or uint16_t: float16): COL_ATTEND_BLOCK_STEPS
 * with its dot, axpy and exp_sum inlined, the values in registers when the head is whole
 * vectors of `lanes` floats. */
#define ATTEND_OVER(target, level, suffix, elem_t, lanes)                                                          \
    target static void attend_##suffix##_##level(const col_attend_query *q, int n, const void *keys,               \
                                                 const void *vals, int kv_f16, int64_t n_kv_heads,                 \
                                                 int64_t head_dim, int64_t ring, float scale, float *sc,           \
                                                 int64_t stride) {                                                 \
        COL_ATTEND_WEIGHTS(dot_##suffix##_##level##_inline, exp_sum_##level, elem_t, COL_KV_ROW_##suffix)          \
        if (Hd_ % (lanes) == 0) {                                                                                   \
            values_##suffix##_##level(q, n, (const elem_t *)vals, K_, Hd_, ring, sc, stride, inv_, first_, last_);     \
            return;                                                                                                 \
        }                                                                                                           \
        COL_ATTEND_VALUES(axpy_##suffix##_##level##_inline, elem_t, COL_KV_ROW_##suffix)                            \
    }

/* A level's float helpers for attention: the kernel set's dot_f32, axpy_f32 and attend_block,
 * which takes a float32 or a float16 cache. */
#define LEVEL_FLOAT_HELPERS(target, level, lanes)                                                                   \
    target static float dot_f32_##level(const float *a, const float *b, int64_t n) {                                \
        return dot_f32_##level##_inline(a, b, n);                                                                   \
    }                                                                                                               \
    target static void axpy_f32_##level(float *y, float a, const float *x, int64_t n) {                             \
        axpy_f32_##level##_inline(y, a, x, n);                                                                      \
    }                                                                                                               \
    ATTEND_OVER(target, level, f32, float, lanes)                                                                   \
    ATTEND_OVER(target, level, f16, uint16_t, lanes)                                                                \
    target static void attend_block_##level(const col_attend_query *q, int n, const void *keys, const void *vals,   \
                                            int kv_f16, int64_t n_kv_heads, int64_t head_dim, int64_t ring,         \
                                            float scale, float *sc, int64_t stride) {                               \
        (kv_f16 ? attend_f16_##level : attend_f32_##level)(q, n, keys, vals, kv_f16, n_kv_heads, head_dim, ring,   \
                                                           scale, sc, stride);                                      \
    }

/* expf one value at a time: an AVX2 exp with exp_avx512's bits measured no faster on a
 * prompt's attention at this level, where the q/k/v/o products take most of it */
#define exp_sum_avx2 col_exp_sum_portable
LEVEL_FLOAT_HELPERS(TARGET_AVX2, avx2, 8)

/* ---- SwiGLU ------------------------------------------------------------------------------ */

/* exp(x) to about 1 ulp: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), exp(r) by its
 * degree-6 Taylor polynomial, times 2^n by vscalefps (which gives inf and 0 at the ends).
 * x is first clamped to [-104, 89], past where float exp is 0 or inf; NaN stays NaN. */
TARGET_AVX512 static inline __m512 exp_avx512(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

TARGET_AVX512 static void silu_mul_avx512(const float *g, const float *u, float *h, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        _mm512_storeu_ps(h + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
    if (i < n) { /* the same arithmetic on a masked tail */
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        _mm512_mask_storeu_ps(h + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
}

/* col_exp_sum_portable sixteen values at a time with exp_avx512 (within about 1 ulp of expf),
 * summed in sixteen lanes; the tail through a mask, so every value gets the same exp. */
TARGET_AVX512 static float exp_sum_avx512(float *x, int64_t n, float mx) {
    const __m512 m = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), m));
        _mm512_storeu_ps(x + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (i < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), m));
        _mm512_mask_storeu_ps(x + i, tail, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    return _mm512_reduce_add_ps(sum);
}

LEVEL_FLOAT_HELPERS(TARGET_AVX512, avx512, 16)

/* col_clamped_swiglu_portable sixteen values at a time with exp_avx512; min/max take the
 * value as their second operand, so a NaN passes the clamps as the portable comparisons
 * let it. */
TARGET_AVX512 static inline __m512 clamped_swiglu16(__m512 gv, __m512 uv, __m512 alpha, __m512 limit) {
    const __m512 one = _mm512_set1_ps(1.0f);
    gv = _mm512_min_ps(limit, gv);
    uv = _mm512_min_ps(limit, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), limit), uv));
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(gv, alpha)));
    const __m512 glu = _mm512_mul_ps(gv, _mm512_div_ps(one, _mm512_add_ps(one, e)));
    return _mm512_mul_ps(_mm512_add_ps(uv, one), glu);
}

TARGET_AVX512 static void clamped_swiglu_avx512(const float *g, const float *u, float *h, int64_t n, float alpha,
                                                float limit) {
    const __m512 va = _mm512_set1_ps(alpha), vl = _mm512_set1_ps(limit);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(h + i, clamped_swiglu16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i), va, vl));
    if (i < n) { /* the same arithmetic on a masked tail */
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(h + i, m, clamped_swiglu16(_mm512_maskz_loadu_ps(m, g + i), _mm512_maskz_loadu_ps(m, u + i), va, vl));
    }
}

/* col_gelu_tanh_mul_portable sixteen values at a time with exp_avx512 (the same formula;
 * exp within about 1 ulp of expf). */
TARGET_AVX512 static inline __m512 gelu_tanh16(__m512 gv, __m512 uv) {
    const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                   _mm512_fmadd_ps(_mm512_set1_ps(0.044715f),
                                                   _mm512_mul_ps(_mm512_mul_ps(gv, gv), gv), gv));
    const __m512 e = exp_avx512(_mm512_mul_ps(_mm512_set1_ps(-2.0f), y));
    return _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), uv);
}

TARGET_AVX512 static void gelu_tanh_mul_avx512(const float *g, const float *u, float *h, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(h + i, gelu_tanh16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
    if (i < n) { /* the same arithmetic on a masked tail */
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(h + i, m, gelu_tanh16(_mm512_maskz_loadu_ps(m, g + i), _mm512_maskz_loadu_ps(m, u + i)));
    }
}

/* ---- activation quantization ------------------------------------------------------------ */

/* col_quantize_block_portable sixteen values at a time, the same operations on each value
 * (max ignores NaN as fmaxf does: the running value is the second operand; the clamp sends
 * NaN to -127 the same way), so the bytes are identical. n is 32 or 64. */
TARGET_AVX512 static int32_t quantize_block_avx512(const float *x, int n, int8_t *qs, float *d) {
    __m512 amax = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) amax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), amax);
    const float a = _mm512_reduce_max_ps(amax);
    const float id = a > 0.0f ? 127.0f / a : 0.0f;
    *d = a / 127.0f;
    const __m512 vid = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int j = 0; j < n; j += 16) {
        __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j), vid), lo), hi);
        v = _mm512_sub_ps(_mm512_add_ps(v, magic), magic); /* round half to even */
        const __m512i q = _mm512_cvttps_epi32(v);
        sum = _mm512_add_epi32(sum, q);
        _mm_storeu_si128((__m128i *)(qs + j), _mm512_cvtepi32_epi8(q));
    }
    return _mm512_reduce_add_epi32(sum);
}

/* The same, eight values at a time (AVX2): identical bytes, scale and sum. */
TARGET_AVX2 static int32_t quantize_block_avx2(const float *x, int n, int8_t *qs, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) amax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), amax);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float a = _mm_cvtss_f32(m);
    const float id = a > 0.0f ? 127.0f / a : 0.0f;
    *d = a / 127.0f;
    const __m256 vid = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < n; j += 32) { /* n is a multiple of 32 */
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * k), vid), lo), hi);
            v = _mm256_sub_ps(_mm256_add_ps(v, magic), magic); /* round half to even */
            q[k] = _mm256_cvttps_epi32(v);
            sum = _mm256_add_epi32(sum, q[k]);
        }
        /* 32 int32 -> 32 int8 in order: the packs work per 128-bit lane, one permute restores it */
        const __m256i q16 = _mm256_packs_epi32(q[0], q[1]), q16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qs + j), q8);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    return _mm_cvtsi128_si32(s4);
}

/* ---- RMSNorm ------------------------------------------------------------------------------ */

/* col_rms_norm_row_portable with the sum of squares in four double chains of eight (the
 * order of a double sum moves the float mean by far less than its last bit) and the scaling
 * sixteen values at a time (the same operations per value). */
TARGET_AVX512 static void rms_norm_row_avx512(const float *x, const float *weight, int64_t n, float eps, float *y) {
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd(), s2 = _mm512_setzero_pd(), s3 = _mm512_setzero_pd();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512d a = _mm512_cvtps_pd(_mm256_loadu_ps(x + i)), b = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
        const __m512d c = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 16)), d = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 24));
        s0 = _mm512_add_pd(s0, _mm512_mul_pd(a, a));
        s1 = _mm512_add_pd(s1, _mm512_mul_pd(b, b));
        s2 = _mm512_add_pd(s2, _mm512_mul_pd(c, c));
        s3 = _mm512_add_pd(s3, _mm512_mul_pd(d, d));
    }
    double sum_sq = _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(s0, s1), _mm512_add_pd(s2, s3)));
    for (; i < n; i++) sum_sq += (double)x[i] * (double)x[i];
    const float rms = sqrtf((float)(sum_sq / (double)n) + eps);
    const __m512 vrms = _mm512_set1_ps(rms);
    i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(weight + i), _mm512_div_ps(_mm512_loadu_ps(x + i), vrms)));
    for (; i < n; i++) y[i] = weight[i] * (x[i] / rms);
}

/* ---- small float products of the linear-attention layers (col_gemm_f32_fn) -------------- */

/* Y = s Y + X M (col_internal.h): a tile of NR rows of Y (4, 2 or 1) by one column block, the
 * block's partial vectors masked (masked lanes load zeros and are never stored), so every
 * element gets the same operations whatever the tile: s * y (or 0), then one fma per row of M
 * in order. always_inline: each NR becomes its own loop with the tile in registers. */
#define GEMM_TILE_ROWS 4

TARGET_AVX512 static inline __attribute__((always_inline)) void gemm_tile_avx512(
    float *y, int64_t y_stride, float s, const float *x, int64_t x_stride, const float *m, int64_t rows, int64_t cols,
    const __mmask16 mk[4], const int nr) {
    __m512 acc[GEMM_TILE_ROWS][4]; /* (NR, 64 columns) */
#pragma GCC unroll 4
    for (int q = 0; q < nr; q++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
            acc[q][v] = s == 0.0f ? _mm512_setzero_ps()
                                  : _mm512_mul_ps(_mm512_set1_ps(s), _mm512_maskz_loadu_ps(mk[v], y + q * y_stride + 16 * v));
    for (int64_t i = 0; i < rows; i++) {
        const float *mi = m + i * cols;
        __m512 mv[4];
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) mv[v] = _mm512_maskz_loadu_ps(mk[v], mi + 16 * v);
#pragma GCC unroll 4
        for (int q = 0; q < nr; q++) {
            const __m512 xq = _mm512_set1_ps(x[q * x_stride + i]);
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) acc[q][v] = _mm512_fmadd_ps(xq, mv[v], acc[q][v]);
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < nr; q++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) _mm512_mask_storeu_ps(y + q * y_stride + 16 * v, mk[v], acc[q][v]);
}

TARGET_AVX512 static void gemm_f32_avx512(float *y, int64_t y_stride, float s, const float *x, int64_t x_stride,
                                          const float *m, int64_t n, int64_t rows, int64_t cols) {
    for (int64_t j0 = 0; j0 < cols; j0 += 64) { /* column blocks of 4 vectors */
        __mmask16 mk[4];
        for (int v = 0; v < 4; v++) {
            const int64_t left = cols - j0 - 16 * v;
            mk[v] = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : (__mmask16)0;
        }
        int64_t r = 0;
        for (; r + GEMM_TILE_ROWS <= n; r += GEMM_TILE_ROWS)
            gemm_tile_avx512(y + r * y_stride + j0, y_stride, s, x + r * x_stride, x_stride, m + j0, rows, cols, mk,
                             GEMM_TILE_ROWS);
        if (r + 2 <= n) { /* k and q of the recurrent step share their reads of S */
            gemm_tile_avx512(y + r * y_stride + j0, y_stride, s, x + r * x_stride, x_stride, m + j0, rows, cols, mk, 2);
            r += 2;
        }
        for (; r < n; r++) gemm_tile_avx512(y + r * y_stride + j0, y_stride, s, x + r * x_stride, x_stride, m + j0, rows, cols, mk, 1);
    }
}

/* AVX2: tiles of NR rows by 16 columns (two vectors), partial vectors by maskload/maskstore. */
TARGET_AVX2 static inline __attribute__((always_inline)) void gemm_tile_avx2(
    float *y, int64_t y_stride, float s, const float *x, int64_t x_stride, const float *m, int64_t rows, int64_t cols,
    const __m256i mk[2], const int nr) {
    __m256 acc[GEMM_TILE_ROWS][2]; /* (NR, 16 columns) */
#pragma GCC unroll 4
    for (int q = 0; q < nr; q++)
#pragma GCC unroll 2
        for (int v = 0; v < 2; v++)
            acc[q][v] = s == 0.0f ? _mm256_setzero_ps()
                                  : _mm256_mul_ps(_mm256_set1_ps(s), _mm256_maskload_ps(y + q * y_stride + 8 * v, mk[v]));
    for (int64_t i = 0; i < rows; i++) {
        const float *mi = m + i * cols;
        const __m256 m0 = _mm256_maskload_ps(mi, mk[0]), m1 = _mm256_maskload_ps(mi + 8, mk[1]);
#pragma GCC unroll 4
        for (int q = 0; q < nr; q++) {
            const __m256 xq = _mm256_broadcast_ss(x + q * x_stride + i);
            acc[q][0] = _mm256_fmadd_ps(xq, m0, acc[q][0]);
            acc[q][1] = _mm256_fmadd_ps(xq, m1, acc[q][1]);
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < nr; q++)
#pragma GCC unroll 2
        for (int v = 0; v < 2; v++) _mm256_maskstore_ps(y + q * y_stride + 8 * v, mk[v], acc[q][v]);
}

TARGET_AVX2 static void gemm_f32_avx2(float *y, int64_t y_stride, float s, const float *x, int64_t x_stride,
                                      const float *m, int64_t n, int64_t rows, int64_t cols) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t j0 = 0; j0 < cols; j0 += 16) {
        const int64_t left = cols - j0;
        const __m256i mk[2] = {_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 16 ? left : 16)), lane),
                               _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 16 ? left : 16) - 8), lane)};
        int64_t r = 0;
        for (; r + GEMM_TILE_ROWS <= n; r += GEMM_TILE_ROWS)
            gemm_tile_avx2(y + r * y_stride + j0, y_stride, s, x + r * x_stride, x_stride, m + j0, rows, cols, mk,
                           GEMM_TILE_ROWS);
        if (r + 2 <= n) { /* k and q of the recurrent step share their reads of S */
            gemm_tile_avx2(y + r * y_stride + j0, y_stride, s, x + r * x_stride, x_stride, m + j0, rows, cols, mk, 2);
            r += 2;
        }
        for (; r < n; r++) gemm_tile_avx2(y + r * y_stride + j0, y_stride, s, x + r * x_stride, x_stride, m + j0, rows, cols, mk, 1);
    }
}

col_gemm_f32_fn col_gemm_f32_x86(int level) {
    switch (level) {
    case COL_KERNELS_AVX2: return gemm_f32_avx2;
    case COL_KERNELS_AVX512:
    case COL_KERNELS_AVX512_VNNI: return gemm_f32_avx512;
    default: return NULL;
    }
}

/* ---- row dequantizers ---------------------------------------------------------------------
 * The same bytes as the reference dequantizers of types.c, faster: each value is the same
 * one or two float operations (a product, then a sum for q4_g64's offset; never a fused
 * multiply-add), only eight or sixteen at a time. Block scales go through the portable f16 /
 * e8m0 decoders so that even NaN scales decode to the same bits. */

TARGET_AVX2 static void dequantize_q8_0_avx2(const uint8_t *src, float *y, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = src + b * 34;
        const __m256 d = _mm256_set1_ps(col_f16_to_f32(col_load_u16(blk)));
        for (int k = 0; k < 4; k++) { /* y = d * q, 8 values a step */
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * k)));
            _mm256_storeu_ps(y + b * 32 + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
        }
    }
}

TARGET_AVX2 static void dequantize_q4_g64_avx2(const uint8_t *src, float *y, int64_t n) {
    const __m256i low4 = _mm256_set1_epi32(0x0f);
    for (int64_t b = 0; b < n / 64; b++) {
        const uint8_t *blk = src + b * 36;
        const __m256 d = _mm256_set1_ps(col_f16_to_f32(col_load_u16(blk)));
        const __m256 m = _mm256_set1_ps(col_f16_to_f32(col_load_u16(blk + 2)));
        float *yb = y + b * 64; /* (64): low nibbles are values 0..31, high nibbles 32..63 */
        for (int k = 0; k < 4; k++) {
            const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 4 + 8 * k)));
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(q, low4));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
            _mm256_storeu_ps(yb + 8 * k, _mm256_add_ps(_mm256_mul_ps(d, lo), m));
            _mm256_storeu_ps(yb + 32 + 8 * k, _mm256_add_ps(_mm256_mul_ps(d, hi), m));
        }
    }
}

/* Eight e2m1 codes (int32 lanes, 0..15) to their doubled values, -0.0 for code 8: codes
 * 0..7 from the positive half of the table, 8..15 from the negative half (bit 3 moved to
 * the sign bit picks the half). */
TARGET_AVX2 static inline __m256 e2m1_x2_avx2(__m256i code) {
    const __m256 pos = _mm256_setr_ps(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 6.0f, 8.0f, 12.0f);
    const __m256 neg = _mm256_setr_ps(-0.0f, -1.0f, -2.0f, -3.0f, -4.0f, -6.0f, -8.0f, -12.0f);
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(pos, code), _mm256_permutevar8x32_ps(neg, code),
                            _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
}

TARGET_AVX2 static void dequantize_mxfp4_avx2(const uint8_t *src, float *y, int64_t n) {
    const __m256i low4 = _mm256_set1_epi32(0x0f);
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = src + b * 17;
        const __m256 half_scale = _mm256_set1_ps(col_e8m0_half_to_f32(blk[0]));
        float *yb = y + b * 32; /* (32): low nibbles are values 0..15, high nibbles 16..31 */
        for (int k = 0; k < 2; k++) {
            const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 1 + 8 * k)));
            _mm256_storeu_ps(yb + 8 * k, _mm256_mul_ps(e2m1_x2_avx2(_mm256_and_si256(q, low4)), half_scale));
            _mm256_storeu_ps(yb + 16 + 8 * k, _mm256_mul_ps(e2m1_x2_avx2(_mm256_srli_epi32(q, 4)), half_scale));
        }
    }
}

TARGET_AVX2 static void dequantize_bf16_avx2(const uint8_t *src, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) { /* bf16 is the top half of a float32 */
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * i)));
        _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
    }
    for (; i < n; i++) y[i] = col_bf16_to_f32(col_load_u16(src + 2 * i));
}

TARGET_AVX512 static void dequantize_q8_0_avx512(const uint8_t *src, float *y, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = src + b * 34;
        const __m512 d = _mm512_set1_ps(col_f16_to_f32(col_load_u16(blk)));
        for (int k = 0; k < 2; k++) {
            const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * k)));
            _mm512_storeu_ps(y + b * 32 + 16 * k, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q)));
        }
    }
}

TARGET_AVX512 static void dequantize_q4_g64_avx512(const uint8_t *src, float *y, int64_t n) {
    const __m512i low4 = _mm512_set1_epi32(0x0f);
    for (int64_t b = 0; b < n / 64; b++) {
        const uint8_t *blk = src + b * 36;
        const __m512 d = _mm512_set1_ps(col_f16_to_f32(col_load_u16(blk)));
        const __m512 m = _mm512_set1_ps(col_f16_to_f32(col_load_u16(blk + 2)));
        float *yb = y + b * 64; /* (64) */
        for (int k = 0; k < 2; k++) {
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 4 + 16 * k)));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, low4));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
            _mm512_storeu_ps(yb + 16 * k, _mm512_add_ps(_mm512_mul_ps(d, lo), m));
            _mm512_storeu_ps(yb + 32 + 16 * k, _mm512_add_ps(_mm512_mul_ps(d, hi), m));
        }
    }
}

TARGET_AVX512 static void dequantize_mxfp4_avx512(const uint8_t *src, float *y, int64_t n) {
    const __m512 table = _mm512_setr_ps(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 6.0f, 8.0f, 12.0f, -0.0f, -1.0f, -2.0f, -3.0f,
                                        -4.0f, -6.0f, -8.0f, -12.0f);
    const __m512i low4 = _mm512_set1_epi32(0x0f);
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = src + b * 17;
        const __m512 half_scale = _mm512_set1_ps(col_e8m0_half_to_f32(blk[0]));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 1)));
        float *yb = y + b * 32; /* (32) */
        _mm512_storeu_ps(yb, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(q, low4), table), half_scale));
        _mm512_storeu_ps(yb + 16, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table), half_scale));
    }
}

TARGET_AVX512 static void dequantize_bf16_avx512(const uint8_t *src, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 2 * i)));
        _mm512_storeu_ps(y + i, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
    }
    for (; i < n; i++) y[i] = col_bf16_to_f32(col_load_u16(src + 2 * i));
}

/* ---- kernel sets ------------------------------------------------------------------------ */

#define DEQUANTIZERS(level)                                                                             \
    {[COL_TYPE_BF16] = dequantize_bf16_##level, [COL_TYPE_Q8_0] = dequantize_q8_0_##level,                  \
     [COL_TYPE_Q4_G64] = dequantize_q4_g64_##level, [COL_TYPE_MXFP4] = dequantize_mxfp4_##level}

/* ---- AVX-512 VNNI: the same panels, one vpdpbusd per row, block and token ----------------
 * The AVX2 panel's arithmetic with VNNI's integer step: the weights, flipped to unsigned once
 * per block (w + 128) for every token of the call, meet each token's activations in
 * vpdpbusd started from -128 * sum(x), which leaves the exact integer sum sum(w * x); the
 * float chain is the AVX2 panel's, so this level's q8_0 and q4_g64 products are bit for bit
 * the avx2 level's.
 *
 * q8_0 has two layouts of the integer step, the same sums:
 *   - one token: each row's 32 products in its own register (eight lanes of four), folded to
 *     one lane per row by fold_rows8 (21 shuffles and adds per block and token);
 *   - two or more tokens: the block's eight rows transposed once (transpose8x8_epi32: register
 *     j holds bytes 4j..4j+3 of every row, row r in lane r), then each token's four
 *     activations j broadcast to every lane and one vpdpbusd per j adds them into row r's lane
 *     directly: no fold per token, the 24 shuffles of the transpose shared by the tokens.
 *     Measured on an Intel Xeon (Emerald Rapids), one thread, a 512 x 2048 matrix in L2: 17.6
 *     against 23.1 us a token at 64 tokens, 17.7 against 23.5 at 8. Calls with more tokens
 *     and whole sixteen-row tiles go further, to the 512-bit tiles below.
 * q4_g64 keeps the fold in its panel: its two vpdpbusd per row and block already bound it,
 * and the same transpose (of the packed nibbles, split after) measured 3-8 % slower. So does
 * the AVX2 level: its two multiplies per 32 products bound it in either layout (measured the
 * same). */

/* v[j] lane r = v[r] lane j (8 x 8 int32): the rows of a panel block into lanes. */
TARGET_AVX2 static inline void transpose8x8_epi32(__m256i v[PANEL_ROWS]) {
    __m256i t[8], s[8];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);     /* [a0 b0 a1 b1 | a4 b4 a5 b5] */
        t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]); /* [a2 b2 a3 b3 | a6 b6 a7 b7] */
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) { /* rows 0-3, then 4-7 */
        const __m256i *q = t + 4 * h;
        s[4 * h + 0] = _mm256_unpacklo_epi64(q[0], q[2]); /* lanes 0 | 4 of four rows */
        s[4 * h + 1] = _mm256_unpackhi_epi64(q[0], q[2]); /* 1 | 5 */
        s[4 * h + 2] = _mm256_unpacklo_epi64(q[1], q[3]); /* 2 | 6 */
        s[4 * h + 3] = _mm256_unpackhi_epi64(q[1], q[3]); /* 3 | 7 */
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_permute2x128_si256(s[j], s[4 + j], 0x20);
        v[j + 4] = _mm256_permute2x128_si256(s[j], s[4 + j], 0x31);
    }
}

/* Row r's lane of the result: start + sum over j of cols[j] (row r's four unsigned bytes j)
 * times the token's four activations at x + 4j, in two chains (even and odd j) so that
 * vpdpbusd's latency does not serialise a block. */
TARGET_VNNI static inline __m256i lanes_dot8(__m256i start, const __m256i cols[PANEL_ROWS], const int8_t *x) {
    __m256i even = start, odd = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < PANEL_ROWS; j += 2) {
        even = _mm256_dpbusd_epi32(even, cols[j], _mm256_set1_epi32((int)load_u32((const uint8_t *)x + 4 * j)));
        odd = _mm256_dpbusd_epi32(odd, cols[j + 1], _mm256_set1_epi32((int)load_u32((const uint8_t *)x + 4 * j + 4)));
    }
    return _mm256_add_epi32(even, odd);
}

TARGET_VNNI static inline __attribute__((always_inline)) void q8_panel_vnni(const uint8_t *const *row, const col_xq_row *x,
                                                                            const int nt, int64_t nb, __m256 *acc,
                                                                            int64_t ahead) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t off = b * 34;
        prefetch_panel_step(row, ahead, off);
        const __m256 dw = f16_scales8(row, off);
        __m256i u[PANEL_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < PANEL_ROWS; r++)
            u[r] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row[r] + off + 2)), flip);
        if (nt >= 2) { /* rows into lanes, once for the tokens */
            transpose8x8_epi32(u);
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) {
                const __m256i isum = lanes_dot8(_mm256_set1_epi32(x[t].bias[b * 8]), u, x[t].qs + b * 32);
                acc[t] = q8_chain_step(acc[t], isum, dw, x[t].d[b]);
            }
            continue;
        }
        const __m256i xq = _mm256_load_si256((const __m256i *)(x[0].qs + b * 32));
        const __m256i start = _mm256_load_si256((const __m256i *)(x[0].bias + b * 8));
        __m256i p[PANEL_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < PANEL_ROWS; r++) p[r] = _mm256_dpbusd_epi32(start, u[r], xq);
        acc[0] = q8_chain_step(acc[0], fold_rows8(p), dw, x[0].d[b]);
    }
}

PANEL_ROWS_XQ(TARGET_VNNI, rows_q8_0_vnni_panels, q8_panel_vnni)


/* q4_g64 likewise: the nibbles are unsigned already, so each row's low and high halves meet
 * the token's 64 activations in two vpdpbusd from zero; the nibble split is done once per
 * block for every token; the float chain is the AVX2 panel's. */
TARGET_VNNI static inline __attribute__((always_inline)) void q4_panel_vnni(const uint8_t *const *row, const col_xq_row *x,
                                                                            const int nt, int64_t nb, __m256 *acc,
                                                                            int64_t ahead) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < nb / 2; k++) {
        const int64_t off = k * 36;
        prefetch_panel_step(row, ahead, off);
        __m256 dw, mw;
        q4_scales8(row, off, &dw, &mw);
        __m256i lo[PANEL_ROWS], hi[PANEL_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < PANEL_ROWS; r++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(row[r] + off + 4));
            lo[r] = _mm256_and_si256(q, low4);
            hi[r] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            const int8_t *xs = x[t].qs + k * 64;
            const __m256i x0 = _mm256_load_si256((const __m256i *)xs), x1 = _mm256_load_si256((const __m256i *)(xs + 32));
            __m256i p[PANEL_ROWS];
#pragma GCC unroll 8
            for (int r = 0; r < PANEL_ROWS; r++)
                p[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo[r], x0), hi[r], x1);
            acc[t] = q4_chain_step(acc[t], fold_rows8(p), dw, mw, x[t].d[k], x[t].ds2[k]);
        }
    }
}

PANEL_ROWS_XQ(TARGET_VNNI, rows_q4_g64_vnni_panels, q4_panel_vnni)

/* ---- AVX-512 VNNI tiles: sixteen rows in the lanes of a 512-bit register ------------------
 * A call with several tokens (a prompt, a decode batch's dense products) spends its time in
 * arithmetic, and a 512-bit vpdpbusd does twice a 256-bit one's products at 1.25 times its
 * cost on the Intel Xeon measured (0.217 against 0.174 ns per instruction, one thread). So
 * the tile of sixteen rows a caller passes is repacked once per call, a chunk of blocks at a
 * time, into L1: per block and four-byte column j one 512-bit register with row r's bytes
 * 4j..4j+3 in lane r (tile_columns), and the sixteen rows' scales as float
 * lanes. Every token then runs over the chunk with one 512-bit vpdpbusd per column and no
 * shuffles: the exact integer sums of the panels, in sixteen lanes, and the panels' float
 * chain per lane (the partial accumulators wait in y between chunks, float32 both ways), so
 * the bits are the panels', which take the tiles of fewer than sixteen rows and calls with
 * fewer tokens than the repack pays for: measured (a 512 x 2048 matrix in L2, one thread, us a
 * token, panels against tiles), q8_0 18.8 / 22.4 at 4 tokens, 21.8 / 19.7 at 5, 17.8 / 14.4
 * at 8, 17.4 / 7.6 at 64; q4_g64 17.2 / 19.3 at 3, 15.8 / 14.3 at 4, 15.0 / 9.8 at 8, 14.5 /
 * 6.0 at 64. */
#define TILE_ROWS 16
#define TILE_MIN_TOKENS_Q8 5
#define TILE_MIN_TOKENS_Q4 4
/* Blocks repacked at a time: 16 x 576 bytes (q8_0) or 8 x 1152 (q4_g64) = 9 KiB. The repack is
 * what asks for the next tiles' lines, so the smaller the chunk, the more evenly those reads
 * spread over the tokens' arithmetic instead of coming in bursts between long stretches of it.
 * Against 18 KiB chunks, alternating builds (Xeon Emerald Rapids, 2 threads, matrices from
 * memory, bench/ab_builds.py products --rotate-mb 1000): a 50304 x 2048 q8_0 product over 8
 * tokens 778 -> 738 us a token, 2048 x 2048 37.6 -> 35.0; q4_g64 800 -> 776; a decode step
 * of 8 on the 4-layer q8_0 pack 82.3 -> 80.5 and 88.2 -> 85.9 ms; a 512-token prompt the
 * same (1216 / 1209 ms). Chunks of 8 q8_0 blocks were as fast at 8 tokens and slower at 64. */
#define TILE_Q8_BLOCKS 16
#define TILE_Q4_BLOCKS 8

typedef struct {
    __m512i col[8]; /* column j: lane r = row r's flipped bytes 4j..4j+3 */
    __m512 dw;      /* the sixteen rows' scales */
} q8_tile_block;

typedef struct {
    __m512i col[16]; /* columns 0-7: low nibbles (values 4j..4j+3), 8-15: high (32 + 4j..) */
    __m512 dw, mw;   /* the sixteen rows' d and m */
} q4_tile_block;

TARGET_VNNI static inline __m512 join_ps(__m256 lo, __m256 hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

/* The 32 bytes at byte `off` of each of the tile's sixteen rows, xor `flip`, transposed into
 * columns: col[j] lane r = row r's int32 j. Rows r and r + 8 share a register (r in the low
 * half), and the two halves go through transpose8x8_epi32's steps side by side: 512-bit
 * unpacks work within 128-bit lanes as the 256-bit ones do, and its last step (halves
 * across) becomes one two-source qword permute per column. 32 shuffles a block against 56
 * for two 256-bit transposes joined after; the bytes are the same. */
TARGET_VNNI static inline void tile_columns(const uint8_t *w, int64_t row_bytes, int64_t off, __m512i flip,
                                            __m512i col[PANEL_ROWS]) {
    __m512i v[PANEL_ROWS], t[PANEL_ROWS], s[PANEL_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < PANEL_ROWS; r++) {
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(w + r * row_bytes + off));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(w + (r + 8) * row_bytes + off));
        v[r] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), flip);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512i *q = t + 4 * h;
        s[4 * h + 0] = _mm512_unpacklo_epi64(q[0], q[2]);
        s[4 * h + 1] = _mm512_unpackhi_epi64(q[0], q[2]);
        s[4 * h + 2] = _mm512_unpacklo_epi64(q[1], q[3]);
        s[4 * h + 3] = _mm512_unpackhi_epi64(q[1], q[3]);
    }
    /* qwords of a (0-7) and b (8-15): [a's first 128 bits, b's | the same of the rows r + 8] */
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        col[j] = _mm512_permutex2var_epi64(s[j], first, s[4 + j]);
        col[j + 4] = _mm512_permutex2var_epi64(s[j], second, s[4 + j]);
    }
}

TARGET_VNNI static void q8_tile_repack(const uint8_t *w, int64_t row_bytes, int64_t b0, int64_t n_blocks,
                                       int64_t ahead, q8_tile_block *out) {
    const uint8_t *row[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) row[r] = w + r * row_bytes;
    for (int64_t i = 0; i < n_blocks; i++) {
        const int64_t off = (b0 + i) * 34;
        prefetch_group_step(w, TILE_ROWS, ahead, off, 9); /* 544 bytes a step */
        tile_columns(w, row_bytes, off + 2, _mm512_set1_epi8((char)0x80), out[i].col);
        out[i].dw = join_ps(f16_scales8(row, off), f16_scales8(row + 8, off));
    }
}

/* acc[t] (lane r) += row r . token t over the repacked blocks b0 .. b0 + n_blocks, for nt (1..4) tokens. */
TARGET_VNNI static inline __attribute__((always_inline)) void q8_tile_tokens(const q8_tile_block *blk, int64_t b0,
                                                                             int64_t n_blocks, const col_xq_row *x,
                                                                             const int nt, __m512 *acc) {
    for (int64_t i = 0; i < n_blocks; i++) {
        const int64_t b = b0 + i;
        __m512i even[PANEL_TOKENS], odd[PANEL_TOKENS];
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            even[t] = _mm512_set1_epi32(x[t].bias[b * 8]);
            odd[t] = _mm512_setzero_si512();
        }
#pragma GCC unroll 4
        for (int j = 0; j < PANEL_ROWS; j += 2) {
            const __m512i w0 = blk[i].col[j], w1 = blk[i].col[j + 1];
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++) {
                const uint8_t *xs = (const uint8_t *)(x[t].qs + b * 32) + 4 * j;
                even[t] = _mm512_dpbusd_epi32(even[t], w0, _mm512_set1_epi32((int)load_u32(xs)));
                odd[t] = _mm512_dpbusd_epi32(odd[t], w1, _mm512_set1_epi32((int)load_u32(xs + 4)));
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) /* q8_chain_step, sixteen lanes */
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even[t], odd[t])),
                                     _mm512_mul_ps(blk[i].dw, _mm512_set1_ps(x[t].d[b])), acc[t]);
    }
}

TARGET_VNNI static void q4_tile_repack(const uint8_t *w, int64_t row_bytes, int64_t k0, int64_t n_blocks,
                                       int64_t ahead, q4_tile_block *out) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const uint8_t *row[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) row[r] = w + r * row_bytes;
    for (int64_t i = 0; i < n_blocks; i++) {
        const int64_t off = (k0 + i) * 36;
        prefetch_group_step(w, TILE_ROWS, ahead, off, 10); /* 576 bytes a step */
        __m512i packed[PANEL_ROWS];
        tile_columns(w, row_bytes, off + 4, _mm512_setzero_si512(), packed);
#pragma GCC unroll 8
        for (int j = 0; j < PANEL_ROWS; j++) {
            out[i].col[j] = _mm512_and_si512(packed[j], low4);
            out[i].col[8 + j] = _mm512_and_si512(_mm512_srli_epi16(packed[j], 4), low4);
        }
        __m256 d0, m0, d1, m1;
        q4_scales8(row, off, &d0, &m0);
        q4_scales8(row + 8, off, &d1, &m1);
        out[i].dw = join_ps(d0, d1);
        out[i].mw = join_ps(m0, m1);
    }
}

TARGET_VNNI static inline __attribute__((always_inline)) void q4_tile_tokens(const q4_tile_block *blk, int64_t k0,
                                                                             int64_t n_blocks, const col_xq_row *x,
                                                                             const int nt, __m512 *acc) {
    for (int64_t i = 0; i < n_blocks; i++) {
        const int64_t k = k0 + i;
        __m512i c[PANEL_TOKENS][4]; /* per token: low even, low odd, high even, high odd columns */
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++)
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) c[t][q] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < PANEL_ROWS; j += 2) {
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) { /* low, then high nibbles */
                const __m512i w0 = blk[i].col[8 * h + j], w1 = blk[i].col[8 * h + j + 1];
#pragma GCC unroll 4
                for (int t = 0; t < nt; t++) {
                    const uint8_t *xs = (const uint8_t *)(x[t].qs + k * 64) + 32 * h + 4 * j;
                    c[t][2 * h] = _mm512_dpbusd_epi32(c[t][2 * h], w0, _mm512_set1_epi32((int)load_u32(xs)));
                    c[t][2 * h + 1] = _mm512_dpbusd_epi32(c[t][2 * h + 1], w1, _mm512_set1_epi32((int)load_u32(xs + 4)));
                }
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) { /* q4_chain_step, sixteen lanes */
            const __m512i isum = _mm512_add_epi32(_mm512_add_epi32(c[t][0], c[t][1]), _mm512_add_epi32(c[t][2], c[t][3]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(blk[i].dw, _mm512_set1_ps(x[t].d[k])), acc[t]);
            acc[t] = _mm512_fmadd_ps(blk[i].mw, _mm512_set1_ps(x[t].ds2[k]), acc[t]);
        }
    }
}

/* The tokens of a call in groups of up to four over one repacked chunk: each (row, token)
 * accumulator starts at 0 (first chunk) or at what the previous chunk left in y. */
#define TILE_TOKEN_GROUPS(tokens_fn, blk, b0, n_blocks, x, n_tok, y, y_stride)                                       \
    for (int64_t t0 = 0; t0 < (n_tok); t0 += PANEL_TOKENS) {                                                        \
        const int nt = (n_tok) - t0 < PANEL_TOKENS ? (int)((n_tok) - t0) : PANEL_TOKENS;                            \
        __m512 acc[PANEL_TOKENS];                                                                                   \
        for (int t = 0; t < nt; t++)                                                                                \
            acc[t] = (b0) == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps((y) + (t0 + t) * (y_stride));                \
        switch (nt) {                                                                                               \
        case 4: tokens_fn(blk, b0, n_blocks, (x) + t0, 4, acc); break;                                              \
        case 3: tokens_fn(blk, b0, n_blocks, (x) + t0, 3, acc); break;                                              \
        case 2: tokens_fn(blk, b0, n_blocks, (x) + t0, 2, acc); break;                                              \
        default: tokens_fn(blk, b0, n_blocks, (x) + t0, 1, acc); break;                                             \
        }                                                                                                           \
        for (int t = 0; t < nt; t++) _mm512_storeu_ps((y) + (t0 + t) * (y_stride), acc[t]);                        \
    }

/* rows_xq of a tiled kernel: whole sixteen-row tiles by chunks of `chunk` repacked blocks
 * (`n_blocks` of a row: an expression of nb) when the call has min_tokens tokens or more; the
 * remaining rows, and calls with fewer tokens, through the level's panels. */
#define TILE_ROWS_XQ(name, block_t, chunk, min_tokens, n_blocks_of_row, repack, tokens, panels)                     \
    TARGET_VNNI static void name(const uint8_t *w, int64_t row_bytes, int64_t n_rows, const col_xq_row *x,          \
                                 int64_t n_tok, int64_t nb, float *y, int64_t y_stride) {                           \
        int64_t r0 = 0;                                                                                             \
        if (n_tok >= (min_tokens)) {                                                                                \
            block_t blk[chunk];                                                                                     \
            const int64_t ahead = stream_ahead_bytes(TILE_ROWS * row_bytes), total = (n_blocks_of_row);                           \
            for (; r0 + TILE_ROWS <= n_rows; r0 += TILE_ROWS)                                                       \
                for (int64_t b0 = 0; b0 < total; b0 += (chunk)) {                                                   \
                    const int64_t n_blocks = total - b0 < (chunk) ? total - b0 : (chunk);                           \
                    repack(w + r0 * row_bytes, row_bytes, b0, n_blocks, ahead, blk);                                \
                    TILE_TOKEN_GROUPS(tokens, blk, b0, n_blocks, x, n_tok, y + r0, y_stride)                        \
                }                                                                                                   \
        }                                                                                                           \
        if (r0 < n_rows) panels(w + r0 * row_bytes, row_bytes, n_rows - r0, x, n_tok, nb, y + r0, y_stride);        \
    }

TILE_ROWS_XQ(rows_q8_0_vnni, q8_tile_block, TILE_Q8_BLOCKS, TILE_MIN_TOKENS_Q8, nb, q8_tile_repack, q8_tile_tokens,
             rows_q8_0_vnni_panels)
TILE_ROWS_XQ(rows_q4_g64_vnni, q4_tile_block, TILE_Q4_BLOCKS, TILE_MIN_TOKENS_Q4, nb / 2, q4_tile_repack,
             q4_tile_tokens, rows_q4_g64_vnni_panels)

PANEL_DOT_XQ(TARGET_VNNI, dot_q8_0_vnni, rows_q8_0_vnni_panels)
PANEL_DOT_XQ(TARGET_VNNI, dot_q4_g64_vnni, rows_q4_g64_vnni_panels)

static const col_kernel_set avx2_kernels = {
    COL_KERNELS_AVX2, {[COL_TYPE_Q8_0] = dot_q8_0_avx2, [COL_TYPE_Q4_G64] = dot_q4_g64_avx2, [COL_TYPE_MXFP4] = dot_mxfp4_avx2},
    dot_f32_avx2, axpy_f32_avx2, {NULL}, col_silu_mul_portable, quantize_block_avx2,
    col_rms_norm_row_portable, col_clamped_swiglu_portable, {[COL_TYPE_Q4_G64] = col_quantize_row_q4_g64_avx2},
    col_gelu_tanh_mul_portable, DEQUANTIZERS(avx2), {[COL_TYPE_Q8_0] = rows_q8_0_avx2, [COL_TYPE_Q4_G64] = rows_q4_g64_avx2},
    attend_block_avx2};
/* AVX-512 without VNNI (Skylake-SP and -X) computes q8_0 and q4_g64 in the AVX2 panels: its
 * own one-row kernels (512-bit vpmaddubsw over two blocks) measured slower at every token
 * count on the Intel Xeon (one token 7.3-9.1 against 6.2-6.3 ms over a 32768 x 2048 q8_0
 * matrix; a 512-token prompt 138 against 64 ms q8_0 and 142 against 42 ms q4_g64), and the
 * panels give the products of the other two x86 levels, bit for bit. */
static const col_kernel_set avx512_kernels = {
    COL_KERNELS_AVX512,
    {[COL_TYPE_Q8_0] = dot_q8_0_avx2, [COL_TYPE_Q4_G64] = dot_q4_g64_avx2, [COL_TYPE_MXFP4] = dot_mxfp4_avx512},
    dot_f32_avx512, axpy_f32_avx512, {NULL}, silu_mul_avx512, quantize_block_avx512, rms_norm_row_avx512,
    clamped_swiglu_avx512, {[COL_TYPE_Q4_G64] = col_quantize_row_q4_g64_avx512}, gelu_tanh_mul_avx512,
    DEQUANTIZERS(avx512), {[COL_TYPE_Q8_0] = rows_q8_0_avx2, [COL_TYPE_Q4_G64] = rows_q4_g64_avx2}, attend_block_avx512};
static const col_kernel_set vnni_kernels = {
    COL_KERNELS_AVX512_VNNI,
    {[COL_TYPE_Q8_0] = dot_q8_0_vnni, [COL_TYPE_Q4_G64] = dot_q4_g64_vnni, [COL_TYPE_MXFP4] = dot_mxfp4_vnni},
    dot_f32_avx512, axpy_f32_avx512,
    {[COL_TYPE_MXFP4] = dotn_mxfp4_vnni},
    silu_mul_avx512,
    quantize_block_avx512, rms_norm_row_avx512, clamped_swiglu_avx512, {[COL_TYPE_Q4_G64] = col_quantize_row_q4_g64_avx512},
    gelu_tanh_mul_avx512, DEQUANTIZERS(avx512), {[COL_TYPE_Q8_0] = rows_q8_0_vnni, [COL_TYPE_Q4_G64] = rows_q4_g64_vnni},
    attend_block_avx512};

static int has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

static int has_avx512(void) {
    return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

const col_kernel_set *col_kernels_avx2(void) { return has_avx2() ? &avx2_kernels : NULL; }
const col_kernel_set *col_kernels_avx512(void) { return has_avx512() ? &avx512_kernels : NULL; }
const col_kernel_set *col_kernels_avx512_vnni(void) {
    return has_avx512() && __builtin_cpu_supports("avx512vnni") ? &vnni_kernels : NULL;
}

#else /* not x86 */

const col_kernel_set *col_kernels_avx2(void) { return NULL; }
const col_kernel_set *col_kernels_avx512(void) { return NULL; }
const col_kernel_set *col_kernels_avx512_vnni(void) { return NULL; }
col_gemm_f32_fn col_gemm_f32_x86(int level) {
    (void)level;
    return NULL;
}

#endif
