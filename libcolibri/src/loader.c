/*
 * loader.c — reads whole expert records with O_DIRECT on a pool of I/O threads.
 *
 * Why threads and pread rather than io_uring: each read is one large (hundreds of KiB to
 * MiB) aligned record, so the per-read syscall cost is noise; a thread per read in flight
 * gives the same queue depth at the device, needs no kernel feature probing, and lets the
 * crc32c check run on the thread that did the read, right after it (the bytes are in cache).
 *
 * max_queue_depth threads start with the loader; at most queue_depth of them hold a read at
 * any time (the limit can change at run time: the thermal watch lowers it). Demand reads
 * (someone waits) are taken before prefetch reads.
 *
 * O_DIRECT: when open() or the first pread() is refused with EINVAL (a file system without
 * direct I/O, e.g. tmpfs on older kernels), mode TRY switches to buffered reads and says so
 * in col_loader_info (direct = 0, direct_errno = EINVAL); REQUIRED fails instead.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "aepc_internal.h"

#define COL_DIRECT_ALIGN 4096
#define COL_IO_THREAD_STACK_BYTES (256 * 1024)

typedef struct col_read_node {
    struct col_read_node *next;
    col_read read;
    int64_t submitted_ns;
    col_read_done_fn done;
    void *ctx;
    int64_t tag;
} col_read_node;

typedef struct {
    col_read_node *head, *tail;
} col_read_queue;

struct col_loader {
    pthread_mutex_t lock;
    pthread_cond_t work;        /* a read was queued, a slot in flight freed, or stop */
    int fd;                     /* O_DIRECT when direct, else buffered */
    int direct;
    int direct_mode;            /* col_aepc_mode */
    int direct_errno;
    int stop;
    int32_t queue_depth;
    int32_t max_queue_depth;
    int32_t n_threads;          /* threads started */
    int32_t in_flight;
    int64_t busy_since_ns;
    col_read_queue queues[2];   /* by col_read_priority */
    pthread_t *threads;         /* (max_queue_depth) */
    int64_t file_bytes;
    int64_t reads, bytes_read, failures, busy_ns;
    int32_t users;              /* caches built on this loader */
    int32_t destroy_pending;    /* col_loader_destroy was called while users > 0 */
};

col_loader_params col_loader_default_params(void) {
    col_loader_params p;
    memset(&p, 0, sizeof p);
    p.max_queue_depth = 32;
    p.queue_depth = 16;
    p.direct = COL_MODE_TRY;
    return p;
}

size_t col_loader_info_size(void) { return sizeof(col_loader_info); }
size_t col_loader_params_size(void) { return sizeof(col_loader_params); }
size_t col_read_size(void) { return sizeof(col_read); }
size_t col_read_result_size(void) { return sizeof(col_read_result); }

static int aligned(int64_t v) { return v % COL_DIRECT_ALIGN == 0; }

/* Falls back to buffered reads after O_DIRECT was refused with EINVAL. Called with the lock
 * held; returns 0 or an errno. */
static int loader_go_buffered(col_loader *l, const char *path_or_null, int fd_direct) {
    (void)path_or_null;
    if (!l->direct) return 0;
    /* Re-open the same file without O_DIRECT through /proc/self/fd (no path kept). */
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd_direct);
    int fd = open(proc, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        /* Clearing O_DIRECT with fcntl works on Linux as well. */
        int flags = fcntl(fd_direct, F_GETFL);
        if (flags < 0 || fcntl(fd_direct, F_SETFL, flags & ~O_DIRECT) != 0) return errno;
        l->direct = 0;
        l->direct_errno = EINVAL;
        return 0;
    }
    int old = l->fd;
    l->fd = fd;
    close(old); /* threads hold no copy of the fd: they read l->fd under the lock */
    l->direct = 0;
    l->direct_errno = EINVAL;
    return 0;
}

/* One whole read with retries on EINTR and short reads. Returns 0 or an errno; *got = bytes read. */
static int pread_all(int fd, uint8_t *dst, int64_t length, int64_t offset, int64_t *got) {
    int64_t done = 0;
    while (done < length) {
        ssize_t r = pread(fd, dst + done, (size_t)(length - done), (off_t)(offset + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            *got = done;
            return errno;
        }
        if (r == 0) break; /* end of file: a short read */
        done += r;
    }
    *got = done;
    return 0;
}

static void loader_do_read(col_loader *l, const col_read *rd, col_read_result *res) {
    memset(res, 0, sizeof *res);
    pthread_mutex_lock(&l->lock);
    int fd = l->fd, direct = l->direct;
    pthread_mutex_unlock(&l->lock);
    if (direct && !(aligned((int64_t)(uintptr_t)rd->dst) && aligned(rd->offset) && aligned(rd->length))) {
        res->status = COL_EIO; /* the caller's mistake, not the file system's: no fallback */
        res->sys_errno = EINVAL;
        return;
    }
    int64_t got = 0;
    int err = pread_all(fd, rd->dst, rd->length, rd->offset, &got);
    if (err == EINVAL && direct && l->direct_mode == COL_MODE_TRY) {
        pthread_mutex_lock(&l->lock);
        int fallback_err = loader_go_buffered(l, NULL, fd);
        fd = l->fd;
        pthread_mutex_unlock(&l->lock);
        if (fallback_err == 0) err = pread_all(fd, rd->dst, rd->length, rd->offset, &got);
    }
    if (err) {
        res->status = COL_EIO;
        res->sys_errno = err;
        return;
    }
    if (got != rd->length) {
        res->status = COL_EIO; /* short read: the file is shorter than the index says */
        res->sys_errno = 0;
        return;
    }
    res->crc32c = col_crc32c(0, rd->dst, (size_t)rd->length);
    res->status = res->crc32c == rd->crc32c ? COL_OK : COL_ECHECKSUM;
}

static col_read_node *queue_pop(col_read_queue *q) {
    col_read_node *n = q->head;
    if (n) {
        q->head = n->next;
        if (!q->head) q->tail = NULL;
    }
    return n;
}

static int queues_empty(const col_loader *l) { return !l->queues[0].head && !l->queues[1].head; }

static void *loader_thread(void *arg) {
    col_loader *l = arg;
    pthread_mutex_lock(&l->lock);
    for (;;) {
        while (!l->stop && (queues_empty(l) || l->in_flight >= l->queue_depth)) pthread_cond_wait(&l->work, &l->lock);
        if (queues_empty(l)) break; /* stop, and nothing left to do */
        col_read_node *node = queue_pop(&l->queues[COL_PRIORITY_DEMAND]);
        if (!node) node = queue_pop(&l->queues[COL_PRIORITY_PREFETCH]);
        if (l->in_flight++ == 0) l->busy_since_ns = col_now_ns();
        pthread_mutex_unlock(&l->lock);

        col_read_result res;
        loader_do_read(l, &node->read, &res);
        int64_t now = col_now_ns();
        res.latency_ns = now - node->submitted_ns;

        pthread_mutex_lock(&l->lock);
        if (--l->in_flight == 0) l->busy_ns += now - l->busy_since_ns;
        l->reads++;
        if (res.status == COL_OK) l->bytes_read += node->read.length;
        else l->failures++;
        pthread_cond_signal(&l->work);
        pthread_mutex_unlock(&l->lock);

        node->done(node->ctx, node->tag, &res);
        free(node);
        pthread_mutex_lock(&l->lock);
    }
    pthread_mutex_unlock(&l->lock);
    return NULL;
}

static int loader_params_ok(const col_loader_params *params) {
    return params && params->max_queue_depth >= 1 && params->max_queue_depth <= 1024 && params->queue_depth >= 1 &&
           params->queue_depth <= params->max_queue_depth &&
           (params->direct == COL_MODE_OFF || params->direct == COL_MODE_TRY || params->direct == COL_MODE_REQUIRED);
}

/* Opens `path` read-only, with O_DIRECT as `mode` says (TRY: buffered when refused with
 * EINVAL). Returns 0 or a col_status; *err is the errno of a failure. */
static int loader_open(const char *path, int mode, int *fd_out, int *direct_out, int *direct_errno_out, int32_t *err) {
    int direct = mode != COL_MODE_OFF;
    *direct_errno_out = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    if (fd < 0 && direct && errno == EINVAL) {
        *direct_errno_out = EINVAL;
        if (mode == COL_MODE_REQUIRED) {
            if (err) *err = EINVAL;
            return COL_ESYSTEM;
        }
        direct = 0;
        fd = open(path, O_RDONLY | O_CLOEXEC);
    }
    if (fd < 0) {
        if (err) *err = errno;
        return COL_EIO;
    }
    *fd_out = fd;
    *direct_out = direct;
    return COL_OK;
}

/* Bytes of what fd reads: a regular file's size, a block device's capacity. */
static int64_t loader_file_bytes(int fd, const struct stat *st) {
    uint64_t device_bytes = 0;
    if (S_ISBLK(st->st_mode) && ioctl(fd, BLKGETSIZE64, &device_bytes) == 0) return (int64_t)device_bytes;
    return (int64_t)st->st_size;
}

/* Builds the loader around an open fd (which it then owns) and starts its threads. */
static int loader_start(int fd, int direct, int direct_errno, const col_loader_params *params, int64_t file_bytes,
                        col_loader **out, int32_t *err) {
    col_loader *l = calloc(1, sizeof *l);
    pthread_t *threads = calloc((size_t)params->max_queue_depth, sizeof *threads);
    if (!l || !threads) {
        free(l);
        free(threads);
        close(fd);
        return COL_ENOMEM;
    }
    pthread_mutex_init(&l->lock, NULL);
    pthread_cond_init(&l->work, NULL);
    l->fd = fd;
    l->direct = direct;
    l->direct_mode = params->direct;
    l->direct_errno = direct_errno;
    l->queue_depth = params->queue_depth;
    l->max_queue_depth = params->max_queue_depth;
    l->threads = threads;
    l->file_bytes = file_bytes;

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, COL_IO_THREAD_STACK_BYTES);
    for (int32_t i = 0; i < params->max_queue_depth; i++) {
        int rc = pthread_create(&threads[i], &attr, loader_thread, l);
        if (rc != 0) {
            pthread_attr_destroy(&attr);
            col_loader_destroy(l); /* joins the n_threads started */
            if (err) *err = rc;
            return COL_ESYSTEM;
        }
        l->n_threads++;
    }
    pthread_attr_destroy(&attr);
    *out = l;
    return COL_OK;
}

int col_loader_create(const char *path, const col_loader_params *params, col_loader **out, int32_t *err) {
    if (err) *err = 0;
    if (out) *out = NULL;
    if (!path || !out || !loader_params_ok(params)) return COL_EINVAL;
    int fd = -1, direct = 0, direct_errno = 0;
    int status = loader_open(path, params->direct, &fd, &direct, &direct_errno, err);
    if (status != COL_OK) return status;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        if (err) *err = errno;
        close(fd);
        return COL_EIO;
    }
    return loader_start(fd, direct, direct_errno, params, loader_file_bytes(fd, &st), out, err);
}

int col_loader_create_fd(int fd, const col_loader_params *params, col_loader **out, int32_t *err) {
    if (err) *err = 0;
    if (out) *out = NULL;
    if (fd < 0 || !out || !loader_params_ok(params)) return COL_EINVAL;
    struct stat given, opened;
    if (fstat(fd, &given) != 0) {
        if (err) *err = errno;
        return COL_EIO;
    }
    /* A file description of its own (its own O_DIRECT flag), on exactly the caller's file:
     * /proc/self/fd/N names the open file, not a path anyone could change. */
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    int own = -1, direct = 0, direct_errno = 0;
    int status = loader_open(proc, params->direct, &own, &direct, &direct_errno, err);
    if (status != COL_OK) return status;
    int same = fstat(own, &opened) == 0 && opened.st_mode == given.st_mode &&
               (S_ISBLK(given.st_mode) ? opened.st_rdev == given.st_rdev
                                       : opened.st_dev == given.st_dev && opened.st_ino == given.st_ino);
    if (!same) {
        close(own);
        if (err) *err = ESTALE;
        return COL_EIO;
    }
    return loader_start(own, direct, direct_errno, params, loader_file_bytes(own, &opened), out, err);
}

static void loader_free(col_loader *l) {
    pthread_mutex_lock(&l->lock);
    l->stop = 1;
    pthread_cond_broadcast(&l->work);
    pthread_mutex_unlock(&l->lock);
    for (int32_t i = 0; i < l->n_threads; i++) pthread_join(l->threads[i], NULL);
    close(l->fd);
    pthread_cond_destroy(&l->work);
    pthread_mutex_destroy(&l->lock);
    free(l->threads);
    free(l);
}

void col_loader_destroy(col_loader *l) {
    if (!l) return;
    pthread_mutex_lock(&l->lock);
    const int deferred = l->users > 0;
    l->destroy_pending = deferred;
    pthread_mutex_unlock(&l->lock);
    if (!deferred) loader_free(l);
}

void col_loader_retain(col_loader *l) {
    pthread_mutex_lock(&l->lock);
    l->users++;
    pthread_mutex_unlock(&l->lock);
}

void col_loader_release(col_loader *l) {
    pthread_mutex_lock(&l->lock);
    const int last = --l->users == 0 && l->destroy_pending;
    pthread_mutex_unlock(&l->lock);
    if (last) loader_free(l);
}

int col_loader_get_info(col_loader *l, col_loader_info *out) {
    if (!l || !out) return COL_EINVAL;
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&l->lock);
    out->direct = l->direct;
    out->direct_errno = l->direct_errno;
    out->queue_depth = l->queue_depth;
    out->max_queue_depth = l->max_queue_depth;
    out->reads = l->reads;
    out->bytes_read = l->bytes_read;
    out->failures = l->failures;
    out->busy_ns = l->busy_ns + (l->in_flight ? col_now_ns() - l->busy_since_ns : 0);
    out->file_bytes = l->file_bytes;
    pthread_mutex_unlock(&l->lock);
    return COL_OK;
}

int col_loader_set_queue_depth(col_loader *l, int32_t depth) {
    if (!l || depth < 1 || depth > l->max_queue_depth) return COL_EINVAL;
    pthread_mutex_lock(&l->lock);
    l->queue_depth = depth;
    pthread_cond_broadcast(&l->work);
    pthread_mutex_unlock(&l->lock);
    return COL_OK;
}

int col_loader_submit(col_loader *l, const col_read *read, int priority, col_read_done_fn done, void *ctx,
                      int64_t tag) {
    col_read_node *node = malloc(sizeof *node);
    if (!node) return COL_ENOMEM;
    node->next = NULL;
    node->read = *read;
    node->submitted_ns = col_now_ns();
    node->done = done;
    node->ctx = ctx;
    node->tag = tag;
    col_read_queue *q = &l->queues[priority == COL_PRIORITY_DEMAND ? COL_PRIORITY_DEMAND : COL_PRIORITY_PREFETCH];
    pthread_mutex_lock(&l->lock);
    if (q->tail) q->tail->next = node;
    else q->head = node;
    q->tail = node;
    pthread_cond_signal(&l->work);
    pthread_mutex_unlock(&l->lock);
    return COL_OK;
}

/* The waiting side of col_loader_read. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t done;
    int32_t remaining;
    col_read_result *results;
} col_read_batch;

static void batch_read_done(void *ctx, int64_t tag, const col_read_result *result) {
    col_read_batch *b = ctx;
    pthread_mutex_lock(&b->lock);
    b->results[tag] = *result;
    if (--b->remaining == 0) pthread_cond_signal(&b->done);
    pthread_mutex_unlock(&b->lock);
}

int col_loader_read(col_loader *l, const col_read *reads, int32_t n, col_read_result *results) {
    if (!l || n < 0 || (n > 0 && (!reads || !results))) return COL_EINVAL;
    col_read_batch b;
    pthread_mutex_init(&b.lock, NULL);
    pthread_cond_init(&b.done, NULL);
    b.results = results;
    b.remaining = n;
    int submit_status = COL_OK;
    for (int32_t i = 0; i < n; i++) {
        if (col_loader_submit(l, &reads[i], COL_PRIORITY_DEMAND, batch_read_done, &b, i) != COL_OK) {
            /* Account for the reads never queued, then wait for the others. */
            pthread_mutex_lock(&b.lock);
            for (int32_t j = i; j < n; j++) {
                memset(&results[j], 0, sizeof results[j]);
                results[j].status = COL_ENOMEM;
            }
            b.remaining -= n - i;
            pthread_mutex_unlock(&b.lock);
            submit_status = COL_ENOMEM;
            break;
        }
    }
    pthread_mutex_lock(&b.lock);
    while (b.remaining > 0) pthread_cond_wait(&b.done, &b.lock);
    pthread_mutex_unlock(&b.lock);
    pthread_cond_destroy(&b.done);
    pthread_mutex_destroy(&b.lock);
    if (submit_status != COL_OK) return submit_status;
    for (int32_t i = 0; i < n; i++)
        if (results[i].status != COL_OK) return results[i].status;
    return COL_OK;
}
