/*
 * io_engines.c — issue #4: which engine should the expert loader use to keep io_queue_depth
 * whole-record O_DIRECT reads in flight? Measures, on the same file, buffers and offsets:
 *
 *   uring      io_uring through raw syscalls (io_uring_setup/enter + mmap of the rings, no
 *              liburing), IORING_OP_READ, one thread submits and reaps; SQPOLL off.
 *   uring-reg  the same with registered buffers (IORING_OP_READ_FIXED) and a registered file.
 *   threads    QD threads, each loops pread() on its own buffer: the least a thread pool can cost.
 *   pool       what libcolibri/src/loader.c does: one submitter queues reads under a mutex,
 *              QD worker threads take them (condvar wake-up), pread, hand the completion back
 *              (condvar wake-up). Two thread hand-offs per read on top of pread.
 *
 * Every engine keeps exactly QD reads in flight; each read is one whole record at a random
 * record-aligned offset (record size a multiple of 4 KiB) into a 4 KiB-aligned buffer. Per
 * cell (engine x QD) it prints GB/s and IOPS of the reads completed within the cell's time,
 * read latency p50/p99 from submit to completion (as the submitter sees it), and CPU seconds
 * per GB read (getrusage of this process: all its threads, io_uring's io-wq workers included;
 * the two cores also compute, so this cost matters), plus the host's busy CPU per GB from
 * /proc/stat (includes interrupt time the process is not charged for — and other processes).
 *
 * O_DIRECT is required: if the file system refuses it, the program stops and says so (a
 * buffered number would measure the page cache, not the disk). If io_uring is unavailable
 * (ENOSYS, EPERM, kernel.io_uring_disabled), it says so and measures the thread engines only.
 *
 * --verify N reads N random records with every engine at every QD and compares each record
 * byte for byte with a buffered pread() of the same offset; exit status 1 on any difference.
 *
 * Build and run (bench/io_engines.sh does both):
 *   cc -O2 -std=c11 -Wall -Wextra -pthread bench/io_engines.c -o /tmp/io_engines
 *   /tmp/io_engines [--record-bytes SIZE] [--qd 1,4,16,32,64] [--seconds 3]
 *                   [--engines uring,uring-reg,threads,pool] [--pages thp|4k]
 *                   [--repeat 1] [--seed 1] [--verify N] FILE
 * SIZE: bytes, or with a K/M/G suffix (binary: 1.6M = 1.6 MiB), rounded up to 4 KiB. The
 * default is the pack's record_bytes from manifest.json next to FILE, else 1 MiB.
 * --pages: the buffers sit in one region advised MADV_HUGEPAGE (thp, default: the expert cache's
 * region is hugepage-backed) or on 4 KiB pages (4k); pinning a buffer for a direct read costs
 * per page, so this moves the CPU columns of the pread engines (registered buffers pin once).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#define ALIGN_BYTES 4096
#define MAX_QD 1024
#define MAX_QDS 16

/* ---------------------------------------------------------------- small helpers */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static double cpu_seconds(void) { /* this process, all threads, user + system */
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

static double host_busy_seconds(void) { /* all CPUs, all processes, from /proc/stat; -1 if unreadable */
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return -1;
    unsigned long long user = 0, nice = 0, sys = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    int n = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &user, &nice, &sys, &idle, &iowait, &irq,
                   &softirq, &steal);
    fclose(f);
    if (n < 7) return -1;
    return (double)(user + nice + sys + irq + softirq + steal) / (double)sysconf(_SC_CLK_TCK);
}

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Reads all of [offset, offset + length) unless an error or end of file; returns bytes read or -errno. */
static int64_t pread_all(int fd, uint8_t *dst, int64_t length, int64_t offset) {
    int64_t done = 0;
    while (done < length) {
        ssize_t r = pread(fd, dst + done, (size_t)(length - done), (off_t)(offset + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) break;
        done += r;
    }
    return done;
}

static int read_small_file(const char *path, char *out, size_t cap) { /* first line, trimmed; 0 or -1 */
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    if (!fgets(out, (int)cap, f)) out[0] = 0;
    fclose(f);
    out[strcspn(out, "\n")] = 0;
    return 0;
}

/* ---------------------------------------------------------------- one cell's run state */

typedef struct { /* latencies of completed reads, ns */
    int64_t *v;
    size_t n, cap;
} lat_vec;

static void lat_push(lat_vec *l, int64_t ns) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 4096;
        int64_t *v = realloc(l->v, cap * sizeof *v);
        if (!v) return; /* a lost sample under memory pressure; the counts stay right */
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = ns;
}

typedef struct { /* what one completing context saw; merged after the cell */
    lat_vec lat;
    int64_t reads_window, bytes_window; /* completed by the deadline */
    int64_t reads_total, bytes_total;   /* including the drain after it */
    int64_t errors, short_reads, mismatches;
    int first_errno;
    uint8_t *scratch; /* (record_bytes) reference copy, verify mode only */
} cell_stats;

typedef struct { /* immutable while a cell runs, except the shared counters noted */
    int fd_direct, fd_buffered;
    int64_t record_bytes, n_records;
    int qd;
    int verify;               /* list mode: read offsets[0..n_offsets) and compare */
    const int64_t *offsets;
    int64_t n_offsets;
    int64_t next_offset;      /* shared: next index into offsets (atomic) */
    int stop;                 /* shared: set on a failed read (atomic) */
    double seconds;           /* timed mode: issue new reads for this long */
    uint64_t seed;            /* of this cell's random offsets */
    int64_t start_ns, deadline_ns; /* set when the clock starts */
    int64_t end_ns;           /* the last read of the cell drained */
    uint8_t **bufs;           /* (qd) record buffers, 4 KiB aligned */
} cell;

/* The next offset to read, or -1 when this context should stop issuing reads. */
static int64_t cell_next_offset(cell *c, uint64_t *rng) {
    if (__atomic_load_n(&c->stop, __ATOMIC_RELAXED)) return -1;
    if (c->verify) {
        int64_t i = __atomic_fetch_add(&c->next_offset, 1, __ATOMIC_RELAXED);
        return i < c->n_offsets ? c->offsets[i] : -1;
    }
    if (now_ns() >= c->deadline_ns) return -1;
    return (int64_t)(rng_next(rng) % (uint64_t)c->n_records) * c->record_bytes;
}

static void cell_start_clock(cell *c) {
    c->start_ns = now_ns();
    c->deadline_ns = c->verify ? INT64_MAX : c->start_ns + (int64_t)(c->seconds * 1e9);
}

static void cell_prepare_buffer(const cell *c, uint8_t *buf) {
    if (c->verify) memset(buf, 0xa5, (size_t)c->record_bytes); /* stale bytes must not pass */
}

/* One completed read: res = bytes read or -errno. */
static void cell_complete(cell *c, cell_stats *st, int64_t offset, const uint8_t *buf, int64_t res,
                          int64_t submit_ns, int64_t done_ns) {
    if (res < 0) {
        if (!st->errors++) st->first_errno = (int)-res;
        __atomic_store_n(&c->stop, 1, __ATOMIC_RELAXED);
        return;
    }
    if (res != c->record_bytes) {
        st->short_reads++;
        __atomic_store_n(&c->stop, 1, __ATOMIC_RELAXED);
        return;
    }
    lat_push(&st->lat, done_ns - submit_ns);
    st->reads_total++;
    st->bytes_total += res;
    if (done_ns <= c->deadline_ns) {
        st->reads_window++;
        st->bytes_window += res;
    }
    if (c->verify) {
        int64_t got = pread_all(c->fd_buffered, st->scratch, c->record_bytes, offset);
        if (got != c->record_bytes || memcmp(st->scratch, buf, (size_t)c->record_bytes) != 0) st->mismatches++;
    }
}

/* ---------------------------------------------------------------- engine: io_uring, raw syscalls */

typedef struct {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;  /* (sq_entries) */
    struct io_uring_cqe *cqes;  /* (cq_entries) */
    void *sq_map, *cq_map;
    size_t sq_map_bytes, cq_map_bytes, sqes_bytes;
} uring;

static int sys_io_uring_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}
static int sys_io_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}
static int sys_io_uring_register(int fd, unsigned opcode, const void *arg, unsigned nr_args) {
    return (int)syscall(__NR_io_uring_register, fd, opcode, arg, nr_args);
}

static void uring_close(uring *r) {
    if (r->sqes) munmap(r->sqes, r->sqes_bytes);
    if (r->cq_map && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_map_bytes);
    if (r->sq_map) munmap(r->sq_map, r->sq_map_bytes);
    if (r->fd >= 0) close(r->fd);
    memset(r, 0, sizeof *r);
    r->fd = -1;
}

/* Sets up a ring with at least `entries` SQ entries. Returns 0 or an errno (ring closed). */
static int uring_open(uring *r, unsigned entries) {
    memset(r, 0, sizeof *r);
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    r->fd = sys_io_uring_setup(entries, &p);
    if (r->fd < 0) {
        int e = errno;
        r->fd = -1;
        return e;
    }
    r->sq_map_bytes = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_bytes = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) {
        if (r->cq_map_bytes > r->sq_map_bytes) r->sq_map_bytes = r->cq_map_bytes;
        r->cq_map_bytes = r->sq_map_bytes;
    }
    r->sq_map = mmap(NULL, r->sq_map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                     IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED) goto fail;
    if (single) r->cq_map = r->sq_map;
    else {
        r->cq_map = mmap(NULL, r->cq_map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                         IORING_OFF_CQ_RING);
        if (r->cq_map == MAP_FAILED) {
            r->cq_map = NULL;
            goto fail;
        }
    }
    r->sqes_bytes = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) {
        r->sqes = NULL;
        goto fail;
    }
    uint8_t *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
fail: {
    int e = errno;
    if (r->sq_map == MAP_FAILED) r->sq_map = NULL;
    uring_close(r);
    return e;
}
}

/* Queues one read SQE (the caller keeps in flight <= SQ entries, so there is always room). */
static void uring_queue_read(uring *r, int fixed, int fd, uint8_t *buf, int64_t len, int64_t off, unsigned slot) {
    unsigned tail = *r->sq_tail; /* only this thread writes the tail */
    unsigned i = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[i];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = fixed ? IORING_OP_READ_FIXED : IORING_OP_READ;
    sqe->fd = fixed ? 0 : fd; /* index 0 of the registered files */
    if (fixed) sqe->flags = IOSQE_FIXED_FILE;
    sqe->addr = (uint64_t)(uintptr_t)buf;
    sqe->len = (uint32_t)len;
    sqe->off = (uint64_t)off;
    if (fixed) sqe->buf_index = (uint16_t)slot;
    sqe->user_data = slot;
    r->sq_array[i] = i;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

typedef struct {
    int64_t offset, submit_ns;
} slot_state;

/* Runs one cell on io_uring; fills *st. Returns 0 or an errno from ring setup/registration. */
static int run_uring(cell *c, int fixed, cell_stats *st, double *cpu_s, double *host_s) {
    uring r;
    int e = uring_open(&r, (unsigned)c->qd);
    if (e) return e;
    if (fixed) {
        struct iovec iov[MAX_QD];
        for (int i = 0; i < c->qd; i++) iov[i] = (struct iovec){c->bufs[i], (size_t)c->record_bytes};
        if (sys_io_uring_register(r.fd, IORING_REGISTER_BUFFERS, iov, (unsigned)c->qd) < 0 ||
            sys_io_uring_register(r.fd, IORING_REGISTER_FILES, &c->fd_direct, 1) < 0) {
            e = errno;
            uring_close(&r);
            return e;
        }
    }
    slot_state slots[MAX_QD];
    uint64_t rng = c->seed;

    double cpu0 = cpu_seconds(), host0 = host_busy_seconds();
    cell_start_clock(c);

    unsigned to_submit = 0, in_flight = 0;
    for (int s = 0; s < c->qd; s++) {
        int64_t off = cell_next_offset(c, &rng);
        if (off < 0) break;
        cell_prepare_buffer(c, c->bufs[s]);
        slots[s] = (slot_state){off, now_ns()};
        uring_queue_read(&r, fixed, c->fd_direct, c->bufs[s], c->record_bytes, off, (unsigned)s);
        to_submit++;
        in_flight++;
    }
    int fatal = 0;
    while (in_flight > 0) {
        int n = sys_io_uring_enter(r.fd, to_submit, 1, IORING_ENTER_GETEVENTS);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EBUSY) continue;
            fatal = errno;
            break;
        }
        to_submit -= (unsigned)n;
        unsigned head = *r.cq_head, tail = __atomic_load_n(r.cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            const struct io_uring_cqe *cqe = &r.cqes[head & *r.cq_mask];
            unsigned s = (unsigned)cqe->user_data;
            int64_t done_ns = now_ns();
            cell_complete(c, st, slots[s].offset, c->bufs[s], cqe->res, slots[s].submit_ns, done_ns);
            in_flight--;
            int64_t off = cell_next_offset(c, &rng);
            if (off < 0) continue;
            cell_prepare_buffer(c, c->bufs[s]);
            slots[s] = (slot_state){off, now_ns()};
            uring_queue_read(&r, fixed, c->fd_direct, c->bufs[s], c->record_bytes, off, s);
            to_submit++;
            in_flight++;
        }
        __atomic_store_n(r.cq_head, head, __ATOMIC_RELEASE);
    }
    c->end_ns = now_ns();
    *cpu_s = cpu_seconds() - cpu0;
    *host_s = host_busy_seconds() - host0;
    uring_close(&r);
    if (fatal) {
        if (!st->errors++) st->first_errno = fatal;
    }
    return 0;
}

/* ---------------------------------------------------------------- engine: pread threads */

typedef struct { /* workers wait here until the clock starts (or the cell is called off) */
    pthread_mutex_t lock;
    pthread_cond_t opened;
    int open;
} start_gate;

static void gate_wait(start_gate *g) {
    pthread_mutex_lock(&g->lock);
    while (!g->open) pthread_cond_wait(&g->opened, &g->lock);
    pthread_mutex_unlock(&g->lock);
}

static void gate_open(start_gate *g) {
    pthread_mutex_lock(&g->lock);
    g->open = 1;
    pthread_cond_broadcast(&g->opened);
    pthread_mutex_unlock(&g->lock);
}

/* pool: the loader's shape — a queue under one mutex, workers woken by a condvar, completions
 * handed back to the submitter by another condvar. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t work, done;
    int todo[MAX_QD], n_todo;   /* slots queued for a worker (order does not matter: all random) */
    int fin[MAX_QD], n_fin;     /* slots completed, for the submitter */
    int64_t res[MAX_QD];        /* (qd) bytes read or -errno */
    int quit;
} pool_queue;

typedef struct {
    cell *c;
    int index;        /* threads: this worker's buffer */
    uint64_t rng;     /* threads: this worker's offsets */
    cell_stats *st;   /* threads: this worker's stats */
    pool_queue *q;    /* pool */
    slot_state *slots; /* pool: (qd) */
    start_gate *gate;
} worker_arg;

/* threads: each worker issues its own reads back to back on its own buffer. */
static void *pread_worker(void *arg) {
    worker_arg *w = arg;
    cell *c = w->c;
    gate_wait(w->gate);
    uint8_t *buf = c->bufs[w->index];
    for (;;) {
        int64_t off = cell_next_offset(c, &w->rng);
        if (off < 0) break;
        cell_prepare_buffer(c, buf);
        int64_t t0 = now_ns();
        int64_t res = pread_all(c->fd_direct, buf, c->record_bytes, off);
        cell_complete(c, w->st, off, buf, res, t0, now_ns());
    }
    return NULL;
}

static void *pool_worker(void *arg) {
    worker_arg *w = arg;
    cell *c = w->c;
    pool_queue *q = w->q;
    gate_wait(w->gate);
    pthread_mutex_lock(&q->lock);
    for (;;) {
        while (!q->quit && q->n_todo == 0) pthread_cond_wait(&q->work, &q->lock);
        if (q->n_todo == 0) break;
        int s = q->todo[--q->n_todo];
        int64_t off = w->slots[s].offset;
        pthread_mutex_unlock(&q->lock);
        int64_t res = pread_all(c->fd_direct, c->bufs[s], c->record_bytes, off);
        pthread_mutex_lock(&q->lock);
        q->res[s] = res;
        q->fin[q->n_fin++] = s;
        pthread_cond_signal(&q->done);
    }
    pthread_mutex_unlock(&q->lock);
    return NULL;
}

/* pool: the submitter (this thread) keeps qd reads queued or in flight until the cell ends. */
static void pool_submit_loop(cell *c, pool_queue *q, slot_state *slots, cell_stats *st) {
    uint64_t rng = c->seed;
    int in_flight = 0;
    pthread_mutex_lock(&q->lock);
    for (int s = 0; s < c->qd; s++) {
        int64_t off = cell_next_offset(c, &rng);
        if (off < 0) break;
        cell_prepare_buffer(c, c->bufs[s]);
        slots[s] = (slot_state){off, now_ns()};
        q->todo[q->n_todo++] = s;
        pthread_cond_signal(&q->work);
        in_flight++;
    }
    while (in_flight > 0) {
        while (q->n_fin == 0) pthread_cond_wait(&q->done, &q->lock);
        int fin[MAX_QD], n_fin = q->n_fin;
        memcpy(fin, q->fin, (size_t)n_fin * sizeof fin[0]);
        q->n_fin = 0;
        pthread_mutex_unlock(&q->lock);
        for (int k = 0; k < n_fin; k++) {
            int s = fin[k];
            cell_complete(c, st, slots[s].offset, c->bufs[s], q->res[s], slots[s].submit_ns, now_ns());
            in_flight--;
            int64_t off = cell_next_offset(c, &rng);
            if (off < 0) continue;
            cell_prepare_buffer(c, c->bufs[s]);
            slots[s] = (slot_state){off, now_ns()};
            pthread_mutex_lock(&q->lock);
            q->todo[q->n_todo++] = s;
            pthread_cond_signal(&q->work);
            pthread_mutex_unlock(&q->lock);
            in_flight++;
        }
        pthread_mutex_lock(&q->lock);
    }
    q->quit = 1;
    pthread_cond_broadcast(&q->work);
    pthread_mutex_unlock(&q->lock);
}

/* Runs one cell on threads (pool = 0, st_all: (qd)) or on the loader-shaped pool (pool = 1,
 * st_all: (1)). Returns 0 or an errno from pthread_create. */
static int run_threads(cell *c, int pool, cell_stats *st_all, double *cpu_s, double *host_s) {
    pthread_t tid[MAX_QD];
    worker_arg wa[MAX_QD];
    pool_queue q;
    slot_state slots[MAX_QD];
    start_gate gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    memset(&q, 0, sizeof q);
    pthread_mutex_init(&q.lock, NULL);
    pthread_cond_init(&q.work, NULL);
    pthread_cond_init(&q.done, NULL);

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    int started = 0, err = 0;
    for (int i = 0; i < c->qd; i++) {
        wa[i] = (worker_arg){c, i, c->seed * 1000003u + (uint64_t)i, &st_all[pool ? 0 : i], &q, slots, &gate};
        err = pthread_create(&tid[i], &attr, pool ? pool_worker : pread_worker, &wa[i]);
        if (err) break;
        started++;
    }
    pthread_attr_destroy(&attr);

    double cpu0 = cpu_seconds(), host0 = host_busy_seconds();
    if (err) { /* call the cell off: the started workers find nothing to do */
        __atomic_store_n(&c->stop, 1, __ATOMIC_RELAXED);
        q.quit = 1;
    }
    cell_start_clock(c);
    gate_open(&gate);
    if (pool && !err) pool_submit_loop(c, &q, slots, &st_all[0]);
    for (int i = 0; i < started; i++) pthread_join(tid[i], NULL);
    c->end_ns = now_ns();
    *cpu_s = cpu_seconds() - cpu0;
    *host_s = host_busy_seconds() - host0;
    pthread_cond_destroy(&q.done);
    pthread_cond_destroy(&q.work);
    pthread_mutex_destroy(&q.lock);
    return err;
}

/* ---------------------------------------------------------------- cells, engines, results */

enum { ENGINE_URING, ENGINE_URING_REG, ENGINE_THREADS, ENGINE_POOL, N_ENGINES };
static const char *const engine_names[N_ENGINES] = {"uring", "uring-reg", "threads", "pool"};

typedef struct {
    double seconds, gbps, iops, p50_ms, p99_ms, cpu_s_per_gb, cpu_core_pct, host_s_per_gb;
    int64_t reads, errors, short_reads, mismatches;
    int first_errno;
} cell_result;

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static double percentile_ms(const int64_t *sorted, size_t n, double p) { /* nearest rank */
    if (n == 0) return 0;
    size_t rank = (size_t)(p * (double)n + 0.999999);
    if (rank < 1) rank = 1;
    if (rank > n) rank = n;
    return (double)sorted[rank - 1] / 1e6;
}

/* Runs one engine at one QD. seconds <= 0 with offsets: verify mode. Returns 0 or a setup errno. */
static int run_cell(int engine, const cell *proto, int qd, double seconds, uint64_t seed, cell_result *out) {
    cell c = *proto;
    c.qd = qd;
    c.seconds = seconds;
    c.seed = seed;
    c.next_offset = 0;
    c.stop = 0;
    int n_stats = engine == ENGINE_THREADS ? qd : 1;
    cell_stats *st = calloc((size_t)n_stats, sizeof *st);
    if (!st) return ENOMEM;
    int err = 0;
    if (c.verify)
        for (int i = 0; i < n_stats && !err; i++)
            if (posix_memalign((void **)&st[i].scratch, ALIGN_BYTES, (size_t)c.record_bytes)) err = ENOMEM;
    double cpu_s = 0, host_s = 0;
    if (!err) {
        if (engine == ENGINE_URING || engine == ENGINE_URING_REG) {
            err = run_uring(&c, engine == ENGINE_URING_REG, &st[0], &cpu_s, &host_s);
        } else {
            err = run_threads(&c, engine == ENGINE_POOL, st, &cpu_s, &host_s);
        }
    }
    memset(out, 0, sizeof *out);
    if (!err) {
        cell_stats all;
        memset(&all, 0, sizeof all);
        for (int i = 0; i < n_stats; i++) {
            for (size_t k = 0; k < st[i].lat.n; k++) lat_push(&all.lat, st[i].lat.v[k]);
            all.reads_window += st[i].reads_window;
            all.bytes_window += st[i].bytes_window;
            all.reads_total += st[i].reads_total;
            all.bytes_total += st[i].bytes_total;
            all.errors += st[i].errors;
            all.short_reads += st[i].short_reads;
            all.mismatches += st[i].mismatches;
            if (!all.first_errno) all.first_errno = st[i].first_errno;
        }
        qsort(all.lat.v, all.lat.n, sizeof all.lat.v[0], cmp_i64);
        double busy_s = (double)(c.end_ns - c.start_ns) / 1e9; /* the window and the drain after it */
        double window_s = c.verify ? busy_s : seconds;
        double gb_total = (double)all.bytes_total / 1e9;
        out->seconds = window_s;
        out->gbps = (double)all.bytes_window / 1e9 / window_s;
        out->iops = (double)all.reads_window / window_s;
        out->p50_ms = percentile_ms(all.lat.v, all.lat.n, 0.50);
        out->p99_ms = percentile_ms(all.lat.v, all.lat.n, 0.99);
        out->cpu_s_per_gb = gb_total > 0 ? cpu_s / gb_total : 0;
        out->cpu_core_pct = busy_s > 0 ? 100.0 * cpu_s / busy_s : 0;
        out->host_s_per_gb = gb_total > 0 && host_s >= 0 ? host_s / gb_total : -1;
        out->reads = all.reads_total;
        out->errors = all.errors;
        out->short_reads = all.short_reads;
        out->mismatches = all.mismatches;
        out->first_errno = all.first_errno;
        free(all.lat.v);
    }
    for (int i = 0; i < n_stats; i++) {
        free(st[i].lat.v);
        free(st[i].scratch);
    }
    free(st);
    return err;
}

/* ---------------------------------------------------------------- environment checks */

/* io_uring usable for reads? Returns 0, or an errno with a sentence in why. */
static int uring_available(char *why, size_t cap) {
    char disabled[32] = "";
    int have_knob = read_small_file("/proc/sys/kernel/io_uring_disabled", disabled, sizeof disabled) == 0;
    uring r;
    int e = uring_open(&r, 4);
    if (e) {
        if (e == ENOSYS)
            snprintf(why, cap, "io_uring_setup: ENOSYS — this kernel is built without io_uring (CONFIG_IO_URING)");
        else if (e == EPERM)
            snprintf(why, cap,
                     "io_uring_setup: EPERM — io_uring is disabled for this process (kernel.io_uring_disabled=%s; 1 = "
                     "only the io_uring_group, 2 = nobody; or a seccomp filter / container policy)",
                     have_knob ? disabled : "n/a");
        else snprintf(why, cap, "io_uring_setup: %s", strerror(e));
        return e;
    }
    /* IORING_OP_READ appeared in 5.6, as did IORING_REGISTER_PROBE: a failed probe means too old. */
    size_t probe_bytes = sizeof(struct io_uring_probe) + 256 * sizeof(struct io_uring_probe_op);
    struct io_uring_probe *probe = calloc(1, probe_bytes);
    int ok = probe && sys_io_uring_register(r.fd, IORING_REGISTER_PROBE, probe, 256) == 0 &&
             probe->last_op >= IORING_OP_READ && (probe->ops[IORING_OP_READ].flags & IO_URING_OP_SUPPORTED) &&
             (probe->ops[IORING_OP_READ_FIXED].flags & IO_URING_OP_SUPPORTED);
    free(probe);
    uring_close(&r);
    if (!ok) {
        snprintf(why, cap, "io_uring works but does not offer IORING_OP_READ (kernel older than 5.6)");
        return EOPNOTSUPP;
    }
    snprintf(why, cap, "io_uring available (kernel.io_uring_disabled=%s)", have_knob ? disabled : "n/a, no knob");
    return 0;
}

static void print_block_queue(dev_t dev) { /* the device's queue limits, which shape deep large reads */
    char base[128], path[256], v[128];
    snprintf(base, sizeof base, "/sys/dev/block/%u:%u/queue", major(dev), minor(dev));
    if (access(base, F_OK) != 0) /* a partition: the queue belongs to the parent disk */
        snprintf(base, sizeof base, "/sys/dev/block/%u:%u/../queue", major(dev), minor(dev));
    const char *keys[] = {"scheduler", "nr_requests", "max_sectors_kb", "rotational"};
    printf("# block device %u:%u:", major(dev), minor(dev));
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", base, keys[i]);
        if (read_small_file(path, v, sizeof v) == 0) printf(" %s=%s", keys[i], v);
    }
    printf("\n");
}

/* The record buffers: one anonymous region, as the expert cache's slab has (libcolibri/src/slab.c),
 * advised MADV_HUGEPAGE (thp = 1: what the cache gets without reserved hugetlb pages) or kept on
 * 4 KiB pages. The page size changes what a direct read costs to pin its buffer. Faulted in
 * here, before any cell's clock; *huge_bytes = the process's AnonHugePages after that. */
static uint8_t *alloc_buffers(int64_t bytes, int thp, int64_t *huge_bytes) {
    const int64_t huge = 2 << 20;
    size_t map_bytes = (size_t)(bytes + huge);
    uint8_t *raw = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    uint8_t *base = (uint8_t *)(((uintptr_t)raw + (uintptr_t)huge - 1) & ~(uintptr_t)(huge - 1));
    madvise(base, (size_t)bytes, thp ? MADV_HUGEPAGE : MADV_NOHUGEPAGE); /* advice: checked below */
    memset(base, 0, (size_t)bytes);
    *huge_bytes = 0;
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    long long kb;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "AnonHugePages: %lld kB", &kb) == 1) *huge_bytes = kb * 1024;
    if (f) fclose(f);
    return base;
}

/* record_bytes from manifest.json next to the file (a Colibri pack), or 0. */
static int64_t pack_record_bytes(const char *file) {
    char path[4096];
    const char *slash = strrchr(file, '/');
    int dir_len = slash ? (int)(slash - file) : 1;
    snprintf(path, sizeof path, "%.*s/manifest.json", dir_len, slash ? file : ".");
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t cap = 1 << 22;
    char *text = malloc(cap + 1);
    size_t n = text ? fread(text, 1, cap, f) : 0;
    fclose(f);
    int64_t v = 0;
    if (text) {
        text[n] = 0;
        char *k = strstr(text, "\"record_bytes\"");
        if (k && (k = strchr(k, ':'))) v = strtoll(k + 1, NULL, 10);
        free(text);
    }
    return v > 0 ? v : 0;
}

/* "6684672", "1M", "1.6MiB", "128K": bytes (binary suffixes), or -1. */
static int64_t parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || v <= 0) return -1;
    double mult = 1;
    switch (*end) {
    case 'k': case 'K': mult = 1024.0; end++; break;
    case 'm': case 'M': mult = 1024.0 * 1024; end++; break;
    case 'g': case 'G': mult = 1024.0 * 1024 * 1024; end++; break;
    default: break;
    }
    if (!strcmp(end, "iB") || !strcmp(end, "B")) end += strlen(end);
    if (*end) return -1;
    return (int64_t)(v * mult + 0.5);
}

static int parse_qds(const char *s, int *qds) {
    int n = 0;
    const char *p = s;
    while (*p && n < MAX_QDS) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > MAX_QD) return -1;
        qds[n++] = (int)v;
        p = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

static int parse_engines(const char *s, int *on) {
    memset(on, 0, N_ENGINES * sizeof *on);
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int found = 0;
        for (int e = 0; e < N_ENGINES; e++)
            if (!strcmp(t, engine_names[e])) on[e] = found = 1;
        if (!found) return -1;
    }
    return 0;
}

static void usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s [--record-bytes SIZE] [--qd 1,4,16,32,64] [--seconds 3] [--engines "
            "uring,uring-reg,threads,pool]\n"
            "          [--pages thp|4k] [--repeat 1] [--seed 1] [--verify N] FILE\n",
            argv0);
}

int main(int argc, char **argv) {
    const char *file = NULL;
    int64_t record_bytes = 0;
    int qds[MAX_QDS] = {1, 4, 16, 32, 64}, n_qds = 5;
    double seconds = 3;
    int engines_on[N_ENGINES] = {1, 1, 1, 1};
    int repeat = 1;
    int64_t verify_n = 0;
    int pages_thp = 1;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--record-bytes") && v) {
            record_bytes = parse_size(v);
            if (record_bytes <= 0) return fprintf(stderr, "bad --record-bytes %s\n", v), 2;
            i++;
        } else if (!strcmp(a, "--qd") && v) {
            n_qds = parse_qds(v, qds);
            if (n_qds <= 0) return fprintf(stderr, "bad --qd %s (comma list of 1..%d)\n", v, MAX_QD), 2;
            i++;
        } else if (!strcmp(a, "--seconds") && v) {
            seconds = strtod(v, NULL);
            if (seconds <= 0) return fprintf(stderr, "bad --seconds %s\n", v), 2;
            i++;
        } else if (!strcmp(a, "--engines") && v) {
            if (parse_engines(v, engines_on)) return fprintf(stderr, "bad --engines %s\n", v), 2;
            i++;
        } else if (!strcmp(a, "--repeat") && v) {
            repeat = atoi(v);
            if (repeat < 1) return fprintf(stderr, "bad --repeat %s\n", v), 2;
            i++;
        } else if (!strcmp(a, "--seed") && v) {
            seed = strtoull(v, NULL, 10);
            i++;
        } else if (!strcmp(a, "--pages") && v) {
            if (strcmp(v, "thp") && strcmp(v, "4k")) return fprintf(stderr, "bad --pages %s (thp or 4k)\n", v), 2;
            pages_thp = !strcmp(v, "thp");
            i++;
        } else if (!strcmp(a, "--verify") && v) {
            verify_n = atoll(v);
            if (verify_n < 1) return fprintf(stderr, "bad --verify %s\n", v), 2;
            i++;
        } else if (a[0] == '-' ) {
            usage(argv[0]);
            return 2;
        } else if (!file) file = a;
        else {
            usage(argv[0]);
            return 2;
        }
    }
    if (!file) {
        usage(argv[0]);
        return 2;
    }

    const char *record_source = "--record-bytes";
    if (!record_bytes) {
        record_bytes = pack_record_bytes(file);
        record_source = "record_bytes of the pack's manifest.json";
        if (!record_bytes) {
            record_bytes = 1 << 20;
            record_source = "default (no manifest.json next to the file)";
        }
    }
    if (record_bytes % ALIGN_BYTES) {
        int64_t up = (record_bytes + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES;
        fprintf(stderr, "note: record size %lld is not a multiple of 4 KiB; using %lld\n", (long long)record_bytes,
                (long long)up);
        record_bytes = up;
    }

    /* O_DIRECT or nothing: a buffered number would measure the page cache. */
    int fd_direct = open(file, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd_direct < 0) {
        int e = errno;
        if (e == EINVAL)
            fprintf(stderr, "error: %s: O_DIRECT refused (EINVAL): this file system does not do direct I/O; "
                            "put the file on one that does (ext4, xfs, btrfs)\n", file);
        else fprintf(stderr, "error: %s: %s\n", file, strerror(e));
        return 2;
    }
    int fd_buffered = open(file, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd_buffered < 0 || fstat(fd_direct, &st) != 0) return fprintf(stderr, "error: %s: %s\n", file, strerror(errno)), 2;
    int64_t n_records = (int64_t)st.st_size / record_bytes;
    if (n_records < 1)
        return fprintf(stderr, "error: %s has %lld bytes, less than one %lld-byte record\n", file,
                       (long long)st.st_size, (long long)record_bytes), 2;

    int max_qd = 1;
    for (int i = 0; i < n_qds; i++)
        if (qds[i] > max_qd) max_qd = qds[i];
    uint8_t **bufs = calloc((size_t)max_qd, sizeof *bufs);
    int64_t huge_bytes = 0;
    uint8_t *region = alloc_buffers((int64_t)max_qd * record_bytes, pages_thp, &huge_bytes);
    if (!bufs || !region)
        return fprintf(stderr, "error: cannot allocate %d x %lld bytes of buffers\n", max_qd, (long long)record_bytes), 2;
    for (int i = 0; i < max_qd; i++) bufs[i] = region + (int64_t)i * record_bytes; /* back to back, like slab slots */
    { /* some file systems accept the O_DIRECT open and refuse the read */
        int64_t got = pread_all(fd_direct, bufs[0], ALIGN_BYTES, 0);
        if (got < 0) {
            if (got == -EINVAL)
                fprintf(stderr, "error: %s: O_DIRECT read refused (EINVAL): this file system does not do direct "
                                "I/O with 4 KiB alignment\n", file);
            else fprintf(stderr, "error: %s: O_DIRECT read: %s\n", file, strerror((int)-got));
            return 2;
        }
    }

    char uring_why[512];
    int uring_err = uring_available(uring_why, sizeof uring_why);
    struct utsname un;
    uname(&un);
    printf("# io_engines: %s\n", file);
    printf("# kernel %s %s; %ld CPUs online\n", un.release, un.machine, sysconf(_SC_NPROCESSORS_ONLN));
    printf("# file %lld bytes; record %lld bytes (%.3f MiB, %s); %lld records; O_DIRECT ok\n", (long long)st.st_size,
           (long long)record_bytes, (double)record_bytes / (1 << 20), record_source, (long long)n_records);
    print_block_queue(st.st_dev);
    printf("# buffers: %d x %lld bytes in one region, %s; AnonHugePages of the process %lld MiB\n", max_qd,
           (long long)record_bytes, pages_thp ? "advised MADV_HUGEPAGE" : "4 KiB pages (MADV_NOHUGEPAGE)",
           (long long)(huge_bytes >> 20));
    printf("# %s%s\n", uring_why, uring_err ? "; measuring the thread engines only" : "");
    if (uring_err) engines_on[ENGINE_URING] = engines_on[ENGINE_URING_REG] = 0;

    cell proto;
    memset(&proto, 0, sizeof proto);
    proto.fd_direct = fd_direct;
    proto.fd_buffered = fd_buffered;
    proto.record_bytes = record_bytes;
    proto.n_records = n_records;
    proto.bufs = bufs;

    int status = 0;
    if (verify_n) { /* every engine, every QD, the same random records, compared with buffered reads */
        int64_t *offsets = malloc((size_t)verify_n * sizeof *offsets);
        if (!offsets) return fprintf(stderr, "error: out of memory\n"), 2;
        uint64_t rng = seed;
        for (int64_t i = 0; i < verify_n; i++) offsets[i] = (int64_t)(rng_next(&rng) % (uint64_t)n_records) * record_bytes;
        proto.verify = 1;
        proto.offsets = offsets;
        proto.n_offsets = verify_n;
        printf("# verify: %lld random records per engine and QD, each compared with a buffered pread\n",
               (long long)verify_n);
        for (int e = 0; e < N_ENGINES; e++) {
            if (!engines_on[e]) continue;
            for (int k = 0; k < n_qds; k++) {
                cell_result r;
                int err = run_cell(e, &proto, qds[k], 0, seed, &r);
                int bad = err || r.reads != verify_n || r.errors || r.short_reads || r.mismatches;
                printf("verify %-9s QD %3d: %lld/%lld records read, %lld mismatches, %lld errors%s%s, %lld short: %s\n",
                       engine_names[e], qds[k], (long long)r.reads, (long long)verify_n, (long long)r.mismatches,
                       (long long)r.errors, r.first_errno ? " first " : "",
                       r.first_errno ? strerror(r.first_errno) : "", (long long)r.short_reads,
                       err ? strerror(err) : bad ? "FAIL" : "ok");
                if (bad) status = 1;
            }
        }
        printf("%s\n", status ? "VERIFY FAILED" : "verify ok: every engine read the same bytes as buffered pread");
        free(offsets);
        free(bufs);
        return status;
    }

    printf("# %g s per cell; QD reads in flight; latency = submit to completion; CPU = getrusage(self) "
           "user+sys per GB read;\n# host = busy time of all CPUs (/proc/stat, includes other processes and "
           "interrupts) per GB; GB = 1e9 bytes\n", seconds);
    for (int rep = 0; rep < repeat; rep++) {
        printf("\nrun %d of %d\n", rep + 1, repeat);
        printf("| engine    |  QD |  GB/s |   IOPS | p50 ms | p99 ms | CPU s/GB | CPU %% of 1 core | host s/GB |\n");
        printf("|-----------|----:|------:|-------:|-------:|-------:|---------:|----------------:|----------:|\n");
        fflush(stdout);
        for (int k = 0; k < n_qds; k++) { /* QD outer, engines inner: drift of a shared disk hits all alike */
            for (int e = 0; e < N_ENGINES; e++) {
                if (!engines_on[e]) continue;
                cell_result r;
                int err = run_cell(e, &proto, qds[k], seconds, seed + (uint64_t)rep * 7919 + (uint64_t)k * 131, &r);
                if (err) {
                    printf("| %-9s | %3d | setup failed: %s%s |\n", engine_names[e], qds[k], strerror(err),
                           e == ENGINE_URING_REG && err == ENOMEM ? " (RLIMIT_MEMLOCK too low to register buffers?)" : "");
                    continue;
                }
                printf("| %-9s | %3d | %5.2f | %6.0f | %6.2f | %6.2f | %8.3f | %15.1f | %9.3f |", engine_names[e],
                       qds[k], r.gbps, r.iops, r.p50_ms, r.p99_ms, r.cpu_s_per_gb, r.cpu_core_pct, r.host_s_per_gb);
                if (r.errors || r.short_reads)
                    printf(" %lld errors (%s), %lld short reads", (long long)r.errors,
                           r.first_errno ? strerror(r.first_errno) : "-", (long long)r.short_reads);
                printf("\n");
                fflush(stdout);
                if (r.errors || r.short_reads) status = 1;
            }
        }
    }
    free(bufs); /* the buffer region and the fds go with the process */
    return status;
}
