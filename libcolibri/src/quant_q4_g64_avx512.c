/*
 * quant_q4_g64_avx512.c — the q4_g64 quantizer's search on the AVX-512 levels: 16 blocks at
 * once, one per 32-bit lane (quant_q4_g64_lanes.h says how, and why the bytes are the
 * reference's).
 */
#include "col_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define Q4L_LANES 16
#define Q4L_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define q4l_min(a, b) ((vf)_mm512_min_ps((__m512)(a), (__m512)(b)))
#define q4l_max(a, b) ((vf)_mm512_max_ps((__m512)(a), (__m512)(b)))
#define q4l_wide_lo(v) ((vdh)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)(v))))
#define q4l_wide_hi(v) ((vdh)_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)(v)), 1))))
#define q4l_narrow(lo, hi) \
    ((vf)_mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps((__m512d)(lo))), _mm512_cvtpd_ps((__m512d)(hi)), 1))

#include "quant_q4_g64_lanes.h"

int col_quantize_row_q4_g64_avx512(const float *x, uint8_t *dst, int64_t n) { return q4l_quantize_row(x, dst, n); }

#endif
