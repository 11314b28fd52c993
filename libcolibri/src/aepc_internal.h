/*
 * aepc_internal.h — what slab.c, loader.c and expert_cache.c share and colibri.h does not
 * show: the loader's asynchronous submission with a completion callback (the cache's way in),
 * and a monotonic clock.
 */
#ifndef COL_AEPC_INTERNAL_H
#define COL_AEPC_INTERNAL_H

#include <stdint.h>
#include <time.h>

#include "colibri.h"

static inline int64_t col_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Called on an I/O thread when a read completes, with no loader lock held. */
typedef void (*col_read_done_fn)(void *ctx, int64_t tag, const col_read_result *result);

enum col_read_priority {
    COL_PRIORITY_DEMAND   = 0, /* someone waits for it: served first */
    COL_PRIORITY_PREFETCH = 1,
};

/* Queues one read; `done(ctx, tag, result)` is called exactly once when it completes
 * (col_loader_destroy first completes every queued read).
 * COL_OK, or COL_ENOMEM (nothing queued, done is not called). */
int col_loader_submit(col_loader *loader, const col_read *read, int priority, col_read_done_fn done,
                      void *ctx, int64_t tag);

/* A cache keeps its slab and loader alive: *_retain counts a user; *_destroy of an object
 * with users is deferred until the last *_release, so Python finalizers may run in any order. */
void col_slab_retain(col_slab *slab);
void col_slab_release(col_slab *slab);
void col_loader_retain(col_loader *loader);
void col_loader_release(col_loader *loader);

/* Histogram bucket of a latency in microseconds (see COL_LATENCY_BUCKETS). */
static inline int col_latency_bucket(int64_t us) {
    if (us < 1) return 0;
    int msb = 63 - __builtin_clzll((unsigned long long)us);             /* us in [2^msb, 2^(msb+1)) */
    int sub = msb >= 2 ? (int)((us >> (msb - 2)) & 3) : (int)((us << (2 - msb)) & 3);
    int b = 4 * (msb + 1) + sub; /* lo(b) = (4 + sub) << (msb + 1) >> 3 = (4 + sub) * 2^(msb - 2) */
    return b < COL_LATENCY_BUCKETS ? b : COL_LATENCY_BUCKETS - 1;
}

#endif /* COL_AEPC_INTERNAL_H */
