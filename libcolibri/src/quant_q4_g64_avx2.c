/*
 * quant_q4_g64_avx2.c — the q4_g64 quantizer's search on the AVX2 level: 8 blocks at once,
 * one per 32-bit lane (quant_q4_g64_lanes.h says how, and why the bytes are the reference's).
 */
#include "col_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define Q4L_LANES 8
#define Q4L_TARGET __attribute__((target("avx2,f16c")))
#define q4l_min(a, b) ((vf)_mm256_min_ps((__m256)(a), (__m256)(b)))
#define q4l_max(a, b) ((vf)_mm256_max_ps((__m256)(a), (__m256)(b)))
#define q4l_wide_lo(v) ((vdh)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)(v))))
#define q4l_wide_hi(v) ((vdh)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)(v), 1)))
#define q4l_narrow(lo, hi) ((vf)_mm256_set_m128(_mm256_cvtpd_ps((__m256d)(hi)), _mm256_cvtpd_ps((__m256d)(lo))))

#include "quant_q4_g64_lanes.h"

int col_quantize_row_q4_g64_avx2(const float *x, uint8_t *dst, int64_t n) { return q4l_quantize_row(x, dst, n); }

#endif
