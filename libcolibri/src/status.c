/* status.c — status strings and the library version. */
#include "col_internal.h"

const char *col_status_string(int status) {
    switch (status) {
    case COL_OK: return "ok";
    case COL_EINVAL: return "invalid argument";
    case COL_ENOMEM: return "out of memory";
    case COL_ERANGE: return "value out of representable range";
    case COL_ENOTSUP: return "not supported";
    case COL_EIO: return "I/O error";
    case COL_ECHECKSUM: return "checksum mismatch";
    case COL_EBUSY: return "no free or evictable slot";
    case COL_ESYSTEM: return "a required system resource was refused";
    default: return "unknown status";
    }
}

const char *col_version(void) { return COL_VERSION_STRING; }
