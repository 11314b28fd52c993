/*
 * io_priority.c — the calling thread's I/O priority (ioprio_set / ioprio_get).
 *
 * Linux keeps an I/O priority per thread, inherited by the threads it creates (so a loader
 * built on a thread after its priority was lowered reads at that priority too). glibc has no
 * wrapper: the raw syscall is used, its number from <sys/syscall.h> for the machine built on.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "colibri.h"

#define COL_IOPRIO_WHO_PROCESS 1 /* a thread id (0: the calling thread) */
#define COL_IOPRIO_CLASS_SHIFT 13

int col_io_priority_set(int io_class, int level, int32_t *err) {
    if (err) *err = 0;
    if (io_class < COL_IO_CLASS_NONE || io_class > COL_IO_CLASS_IDLE || level < 0 || level > 7) return COL_EINVAL;
#ifdef SYS_ioprio_set
    long rc = syscall(SYS_ioprio_set, COL_IOPRIO_WHO_PROCESS, 0, (io_class << COL_IOPRIO_CLASS_SHIFT) | level);
    if (rc != 0) {
        if (err) *err = errno;
        return COL_ESYSTEM;
    }
    return COL_OK;
#else
    if (err) *err = ENOSYS;
    return COL_ENOTSUP;
#endif
}

int col_io_priority_get(int32_t thread_id, int *io_class, int *level, int32_t *err) {
    if (err) *err = 0;
    if (!io_class || !level || thread_id < 0) return COL_EINVAL;
#ifdef SYS_ioprio_get
    long rc = syscall(SYS_ioprio_get, COL_IOPRIO_WHO_PROCESS, thread_id);
    if (rc < 0) {
        if (err) *err = errno;
        return COL_ESYSTEM;
    }
    *io_class = (int)(rc >> COL_IOPRIO_CLASS_SHIFT);
    *level = (int)(rc & ((1 << COL_IOPRIO_CLASS_SHIFT) - 1));
    return COL_OK;
#else
    if (err) *err = ENOSYS;
    return COL_ENOTSUP;
#endif
}
