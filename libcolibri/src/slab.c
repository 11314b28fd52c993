/*
 * slab.c — the slab pool: one region of n_slots fixed slots and a free map.
 *
 * Backing, best first: MAP_HUGETLB (2 MiB pages reserved in vm.nr_hugepages; the Python side
 * raises that sysctl when asked to), an ordinary mapping advised MADV_HUGEPAGE (transparent
 * hugepages), ordinary pages. Each step that fails leaves its errno in col_slab_info, so the
 * caller can say exactly what the machine refused. The region is then mlock'ed (whole) when
 * the lock mode asks for it. Pages are touched once at creation (MAP_POPULATE) so that the
 * pool's memory is committed up front, not on the first expert read.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "aepc_internal.h"

#define COL_HUGE_PAGE_BYTES (2 * 1024 * 1024)
#define COL_PAGE_BYTES 4096

struct col_slab {
    pthread_mutex_t lock;
    uint8_t *base;         /* (n_slots * slot_bytes) bytes, region_bytes mapped */
    int64_t region_bytes;
    int64_t slot_bytes;
    int64_t n_slots;
    int64_t n_free;
    uint8_t *slot_free;    /* (n_slots) 1 = in the free map */
    int32_t next_hint;     /* lowest slot that may be free */
    col_slab_info info;    /* backing, lock and errnos as obtained at creation */
    int32_t users;         /* caches built on this slab */
    int32_t destroy_pending; /* col_slab_destroy was called while users > 0 */
};

col_slab_params col_slab_default_params(void) {
    col_slab_params p;
    memset(&p, 0, sizeof p);
    p.hugetlb = COL_MODE_TRY;
    p.thp = COL_MODE_TRY;
    p.lock = COL_MODE_TRY;
    return p;
}

size_t col_slab_info_size(void) { return sizeof(col_slab_info); }
size_t col_slab_params_size(void) { return sizeof(col_slab_params); }

static int valid_mode(int32_t m) { return m == COL_MODE_OFF || m == COL_MODE_TRY || m == COL_MODE_REQUIRED; }

static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

int col_slab_create(const col_slab_params *params, col_slab **out, col_slab_info *info) {
    col_slab_info local;
    memset(&local, 0, sizeof local);
    if (out) *out = NULL;
    if (!params || !out || params->slot_bytes <= 0 || params->slot_bytes % COL_PAGE_BYTES || params->n_slots <= 0 ||
        params->n_slots > INT32_MAX || !valid_mode(params->hugetlb) || !valid_mode(params->thp) ||
        !valid_mode(params->lock) || params->slot_bytes > INT64_MAX / params->n_slots) {
        if (info) *info = local;
        return COL_EINVAL;
    }
    local.slot_bytes = params->slot_bytes;
    local.n_slots = params->n_slots;
    const int64_t data_bytes = params->slot_bytes * params->n_slots;

    col_slab *pool = calloc(1, sizeof *pool);
    uint8_t *slot_free = malloc((size_t)params->n_slots);
    if (!pool || !slot_free) {
        free(pool);
        free(slot_free);
        if (info) *info = local;
        return COL_ENOMEM;
    }

    void *base = MAP_FAILED;
    int64_t region_bytes = 0;
    if (params->hugetlb != COL_MODE_OFF) {
        region_bytes = round_up(data_bytes, COL_HUGE_PAGE_BYTES);
        base = mmap(NULL, (size_t)region_bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | MAP_POPULATE, -1, 0);
        if (base == MAP_FAILED) {
            local.hugetlb_errno = errno;
            if (params->hugetlb == COL_MODE_REQUIRED) goto fail_system;
        } else {
            local.backing = COL_BACKING_HUGETLB;
        }
    }
    if (base == MAP_FAILED) {
        /* Without MAP_POPULATE first: THP must be advised before the pages are touched. */
        region_bytes = round_up(data_bytes, COL_PAGE_BYTES);
        int64_t map_bytes = region_bytes;
        if (params->thp != COL_MODE_OFF) map_bytes = round_up(data_bytes, COL_HUGE_PAGE_BYTES) + COL_HUGE_PAGE_BYTES;
        void *raw = mmap(NULL, (size_t)map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw == MAP_FAILED) {
            local.mmap_errno = errno;
            free(pool);
            free(slot_free);
            if (info) *info = local;
            return COL_ENOMEM;
        }
        if (params->thp != COL_MODE_OFF) {
            /* Align the region to 2 MiB so that every huge page of it can be a THP. */
            uintptr_t start = ((uintptr_t)raw + COL_HUGE_PAGE_BYTES - 1) & ~(uintptr_t)(COL_HUGE_PAGE_BYTES - 1);
            region_bytes = round_up(data_bytes, COL_HUGE_PAGE_BYTES);
            size_t head = start - (uintptr_t)raw;
            size_t tail = (size_t)map_bytes - head - (size_t)region_bytes;
            if (head) munmap(raw, head);
            if (tail) munmap((uint8_t *)start + region_bytes, tail);
            base = (void *)start;
            if (madvise(base, (size_t)region_bytes, MADV_HUGEPAGE) != 0) {
                local.thp_errno = errno;
                if (params->thp == COL_MODE_REQUIRED) {
                    munmap(base, (size_t)region_bytes);
                    base = MAP_FAILED;
                    goto fail_system;
                }
            } else {
                local.backing = COL_BACKING_THP;
            }
        } else {
            base = raw;
        }
        /* Commit the memory now (the kernel zero-fills each page on its first touch). */
        (void)madvise(base, (size_t)region_bytes, MADV_WILLNEED);
        for (int64_t off = 0; off < region_bytes; off += COL_PAGE_BYTES) ((volatile uint8_t *)base)[off] = 0;
    }
    local.region_bytes = region_bytes;

    if (params->lock != COL_MODE_OFF) {
        if (mlock(base, (size_t)region_bytes) != 0) {
            local.lock_errno = errno;
            if (params->lock == COL_MODE_REQUIRED) {
                munmap(base, (size_t)region_bytes);
                base = MAP_FAILED;
                goto fail_system;
            }
        } else {
            local.locked = 1;
        }
    }

    pthread_mutex_init(&pool->lock, NULL);
    pool->base = base;
    pool->region_bytes = region_bytes;
    pool->slot_bytes = params->slot_bytes;
    pool->n_slots = params->n_slots;
    pool->n_free = params->n_slots;
    pool->slot_free = slot_free;
    memset(slot_free, 1, (size_t)params->n_slots);
    local.n_free = pool->n_free;
    pool->info = local;
    *out = pool;
    if (info) *info = local;
    return COL_OK;

fail_system:
    free(pool);
    free(slot_free);
    if (info) *info = local;
    return COL_ESYSTEM;
}

static void slab_free(col_slab *pool) {
    if (pool->info.locked) munlock(pool->base, (size_t)pool->region_bytes);
    munmap(pool->base, (size_t)pool->region_bytes);
    pthread_mutex_destroy(&pool->lock);
    free(pool->slot_free);
    free(pool);
}

void col_slab_destroy(col_slab *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->lock);
    const int deferred = pool->users > 0;
    pool->destroy_pending = deferred;
    pthread_mutex_unlock(&pool->lock);
    if (!deferred) slab_free(pool);
}

void col_slab_retain(col_slab *pool) {
    pthread_mutex_lock(&pool->lock);
    pool->users++;
    pthread_mutex_unlock(&pool->lock);
}

void col_slab_release(col_slab *pool) {
    pthread_mutex_lock(&pool->lock);
    const int last = --pool->users == 0 && pool->destroy_pending;
    pthread_mutex_unlock(&pool->lock);
    if (last) slab_free(pool);
}

int col_slab_get_info(col_slab *pool, col_slab_info *out) {
    if (!pool || !out) return COL_EINVAL;
    pthread_mutex_lock(&pool->lock);
    *out = pool->info;
    out->n_free = pool->n_free;
    pthread_mutex_unlock(&pool->lock);
    return COL_OK;
}

void *col_slab_data(col_slab *pool) { return pool ? pool->base : NULL; }

int col_slab_slot_alloc(col_slab *pool, int32_t *slot) {
    if (!pool || !slot) return COL_EINVAL;
    pthread_mutex_lock(&pool->lock);
    int status = COL_EBUSY;
    *slot = -1;
    if (pool->n_free > 0) {
        for (int64_t s = pool->next_hint; s < pool->n_slots; s++) {
            if (pool->slot_free[s]) {
                pool->slot_free[s] = 0;
                pool->n_free--;
                pool->next_hint = (int32_t)s + 1;
                *slot = (int32_t)s;
                status = COL_OK;
                break;
            }
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return status;
}

int col_slab_slot_free(col_slab *pool, int32_t slot) {
    if (!pool || slot < 0 || slot >= pool->n_slots) return COL_EINVAL;
    pthread_mutex_lock(&pool->lock);
    int status = COL_EINVAL;
    if (!pool->slot_free[slot]) {
        pool->slot_free[slot] = 1;
        pool->n_free++;
        if (slot < pool->next_hint) pool->next_hint = slot;
        status = COL_OK;
    }
    pthread_mutex_unlock(&pool->lock);
    return status;
}
