/*
 * pool.c — the worker pool: n_threads - 1 pinned worker threads started once; the calling
 * thread runs share 0 of every job.
 *
 * Handing out a job: the caller publishes (fn, ctx), bumps `generation` and, only if some
 * worker went to sleep, broadcasts the condition variable. An idle worker spins on
 * `generation` for spin_us (a decode step issues its next call within microseconds, and a
 * sleeping worker costs a futex wake-up on every call), then sleeps. Completion is a counter
 * the caller spins on: shares are equal-sized, so the wait is short.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "col_internal.h"

#define POOL_MAX_THREADS 1024
#define POOL_DEFAULT_SPIN_US 1000

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

typedef struct {
    struct col_pool *pool;
    int ith;      /* 1..n_threads-1 */
    int cpu;      /* pinned to */
} pool_worker;

struct col_pool {
    int n_threads;
    int spin_us;
    pool_worker *workers;   /* (n_threads) entry 0 unused (the caller) */
    pthread_t *threads;     /* (n_threads) entry 0 unused */
    pthread_mutex_t run_lock; /* one job at a time */
    /* the current job */
    col_task_fn fn;
    void *ctx;
    _Atomic uint64_t generation; /* bumped once per job */
    _Atomic int n_done;          /* workers finished with the current job */
    _Atomic int stop;
    /* sleeping workers */
    pthread_mutex_t sleep_lock;
    pthread_cond_t wake;
    int n_sleeping;              /* guarded by sleep_lock */
};

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Waits until generation != seen (or stop); returns the new generation. */
static uint64_t worker_wait(struct col_pool *p, uint64_t seen) {
    uint64_t g;
    const uint64_t deadline = now_us() + (uint64_t)p->spin_us;
    for (unsigned i = 1;; i++) {
        g = atomic_load_explicit(&p->generation, memory_order_acquire);
        if (g != seen || atomic_load_explicit(&p->stop, memory_order_relaxed)) return g;
        cpu_relax();
        if ((i & 255u) == 0 && now_us() >= deadline) break;
    }
    pthread_mutex_lock(&p->sleep_lock);
    p->n_sleeping++;
    while ((g = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen &&
           !atomic_load_explicit(&p->stop, memory_order_relaxed))
        pthread_cond_wait(&p->wake, &p->sleep_lock);
    p->n_sleeping--;
    pthread_mutex_unlock(&p->sleep_lock);
    return g;
}

static void *worker_main(void *arg) {
    pool_worker *w = arg;
    struct col_pool *p = w->pool;
    if (w->cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(w->cpu, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set); /* best effort */
    }
    uint64_t seen = 0;
    for (;;) {
        seen = worker_wait(p, seen);
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        p->fn(p->ctx, w->ith, p->n_threads);
        atomic_fetch_add_explicit(&p->n_done, 1, memory_order_acq_rel);
    }
    return NULL;
}

size_t col_pool_params_size(void) { return sizeof(col_pool_params); }

col_pool_params col_pool_default_params(void) {
    col_pool_params params = {0, 0, NULL, -1};
    return params;
}

static void pool_stop(struct col_pool *p, int n_started) {
    atomic_store_explicit(&p->stop, 1, memory_order_release);
    pthread_mutex_lock(&p->sleep_lock);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->sleep_lock);
    for (int i = 1; i < n_started; i++) pthread_join(p->threads[i], NULL);
}

static void pool_free(struct col_pool *p) {
    pthread_mutex_destroy(&p->run_lock);
    pthread_mutex_destroy(&p->sleep_lock);
    pthread_cond_destroy(&p->wake);
    free(p->workers);
    free(p->threads);
    free(p);
}

int col_pool_create(const col_pool_params *params, col_pool **out) {
    if (!out) return COL_EINVAL;
    *out = NULL;
    const col_pool_params def = col_pool_default_params();
    if (!params) params = &def;
    if (params->n_threads < 0 || params->n_cpus < 0 || params->n_threads > POOL_MAX_THREADS ||
        params->n_cpus > CPU_SETSIZE || (params->n_cpus > 0 && !params->cpus))
        return COL_EINVAL;

    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return COL_EINVAL;
    int cpus[CPU_SETSIZE]; /* the CPUs to pin to, in order */
    int n_cpus = 0;
    if (params->n_cpus > 0) {
        for (int i = 0; i < params->n_cpus; i++) {
            const int c = params->cpus[i];
            if (c < 0 || c >= CPU_SETSIZE || !CPU_ISSET(c, &allowed)) return COL_EINVAL;
            cpus[n_cpus++] = c;
        }
    } else {
        for (int c = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &allowed)) cpus[n_cpus++] = c;
    }
    if (n_cpus == 0) return COL_EINVAL;
    const int n_threads = params->n_threads > 0 ? params->n_threads : n_cpus;
    if (n_threads > POOL_MAX_THREADS) return COL_EINVAL;

    struct col_pool *p = calloc(1, sizeof *p);
    if (!p) return COL_ENOMEM;
    p->n_threads = n_threads;
    p->spin_us = params->spin_us >= 0 ? params->spin_us : POOL_DEFAULT_SPIN_US;
    p->workers = calloc((size_t)n_threads, sizeof *p->workers);
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    pthread_mutex_init(&p->run_lock, NULL);
    pthread_mutex_init(&p->sleep_lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    if (!p->workers || !p->threads) {
        pool_free(p);
        return COL_ENOMEM;
    }
    for (int i = 1; i < n_threads; i++) {
        p->workers[i] = (pool_worker){p, i, cpus[i % n_cpus]};
        if (pthread_create(&p->threads[i], NULL, worker_main, &p->workers[i]) != 0) {
            pool_stop(p, i);
            pool_free(p);
            return COL_ENOMEM;
        }
    }
    *out = p;
    return COL_OK;
}

void col_pool_destroy(col_pool *pool) {
    if (!pool) return;
    pool_stop(pool, pool->n_threads);
    pool_free(pool);
}

int col_pool_n_threads(const col_pool *pool) { return pool ? pool->n_threads : 1; }

int col_pool_worker_cpu(const col_pool *pool, int i) {
    if (!pool || i < 1 || i >= pool->n_threads) return -1;
    return pool->workers[i].cpu;
}

void col_pool_run(col_pool *pool, col_task_fn fn, void *ctx) {
    if (!pool || pool->n_threads == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool->run_lock);
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store_explicit(&pool->n_done, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_acq_rel);
    pthread_mutex_lock(&pool->sleep_lock);
    if (pool->n_sleeping > 0) pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->sleep_lock);
    fn(ctx, 0, pool->n_threads);
    const int others = pool->n_threads - 1;
    for (unsigned i = 1; atomic_load_explicit(&pool->n_done, memory_order_acquire) < others; i++) {
        cpu_relax();
        if ((i & 4095u) == 0) sched_yield(); /* an oversubscribed machine: let the worker run */
    }
    pthread_mutex_unlock(&pool->run_lock);
}

void col_barrier_wait(col_barrier *b, int nth) {
    if (nth <= 1) return;
    const int phase = atomic_load_explicit(&b->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, phase + 1, memory_order_release);
        return;
    }
    for (unsigned i = 1; atomic_load_explicit(&b->phase, memory_order_acquire) == phase; i++) {
        cpu_relax();
        if ((i & 4095u) == 0) sched_yield();
    }
}
