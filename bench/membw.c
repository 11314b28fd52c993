/*
 * membw.c — memory read bandwidth, for the roofline of bench_kernels.py.
 * Each thread streams its share of one large buffer (AVX2 loads, summed so the reads are
 * not optimised away); best of several passes. Built by bench_kernels.py:
 *   cc -O2 -mavx2 -pthread bench/membw.c -o membw && ./membw THREADS [MiB]
 * Prints one line: GB/s (1e9 bytes per second).
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    const uint8_t *p;
    size_t n;
    pthread_barrier_t *bar;
    double sink;
} share;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *reader(void *arg) {
    share *s = arg;
    pthread_barrier_wait(s->bar);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 256 <= s->n; i += 256) {
        _mm_prefetch((const char *)(s->p + i + 2048), _MM_HINT_T0);
        _mm_prefetch((const char *)(s->p + i + 2048 + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(s->p + i + 2048 + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(s->p + i + 2048 + 192), _MM_HINT_T0);
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(s->p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(s->p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(s->p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(s->p + i + 96)));
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(s->p + i + 128)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(s->p + i + 160)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(s->p + i + 192)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(s->p + i + 224)));
    }
    a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    s->sink = (double)_mm256_extract_epi64(a0, 0);
    pthread_barrier_wait(s->bar);
    return NULL;
}

int main(int argc, char **argv) {
    const int nth = argc > 1 ? atoi(argv[1]) : 1;
    const size_t bytes = (size_t)(argc > 2 ? atoi(argv[2]) : 2048) << 20;
    uint8_t *buf = aligned_alloc(64, bytes);
    if (!buf || nth < 1) return 1;
    memset(buf, 1, bytes);
    double best = 0;
    for (int pass = 0; pass < 5; pass++) {
        pthread_barrier_t bar;
        pthread_barrier_init(&bar, NULL, (unsigned)nth + 1);
        pthread_t t[64];
        share s[64];
        for (int i = 0; i < nth; i++) {
            s[i] = (share){buf + bytes / nth * i, bytes / nth, &bar, 0};
            pthread_create(&t[i], NULL, reader, &s[i]);
        }
        pthread_barrier_wait(&bar);
        const double t0 = now();
        pthread_barrier_wait(&bar);
        const double dt = now() - t0;
        for (int i = 0; i < nth; i++) pthread_join(t[i], NULL);
        pthread_barrier_destroy(&bar);
        if (bytes / dt > best) best = bytes / dt;
    }
    printf("%.2f\n", best / 1e9);
    return 0;
}
