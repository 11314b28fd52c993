/*
 * crc32c.c — CRC-32C (Castagnoli), the checksum of every expert record in a pack.
 *
 * Two paths with identical results: the SSE4.2 crc32 instruction (chosen at run time, this
 * file is not compiled for a newer CPU than the baseline) and a slicing-by-8 table loop.
 * Both work on the non-inverted register; the ~crc at entry and exit gives the standard
 * semantics, so results chain: crc(crc(0, a), b) == crc(0, a || b).
 */
#include "col_internal.h"

#define CRC32C_POLY_REFLECTED 0x82F63B78u

/* crc_table[k][b]: the register after feeding byte b followed by k zero bytes. */
static uint32_t crc_table[8][256];

__attribute__((constructor)) static void crc32c_init_tables(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int bit = 0; bit < 8; bit++) c = (c >> 1) ^ ((c & 1u) ? CRC32C_POLY_REFLECTED : 0u);
        crc_table[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; b++)
        for (int k = 1; k < 8; k++)
            crc_table[k][b] = (crc_table[k - 1][b] >> 8) ^ crc_table[0][crc_table[k - 1][b] & 0xffu];
}

uint32_t col_crc32c_sw(uint32_t crc, const void *buf, size_t len) {
    const uint8_t *p = buf;
    uint32_t c = ~crc;
    while (len >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = crc_table[7][lo & 0xffu] ^ crc_table[6][(lo >> 8) & 0xffu] ^
            crc_table[5][(lo >> 16) & 0xffu] ^ crc_table[4][lo >> 24] ^
            crc_table[3][hi & 0xffu] ^ crc_table[2][(hi >> 8) & 0xffu] ^
            crc_table[1][(hi >> 16) & 0xffu] ^ crc_table[0][hi >> 24];
        p += 8;
        len -= 8;
    }
    while (len--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xffu];
    return ~c;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>

__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const void *buf,
                                                                size_t len) {
    const uint8_t *p = buf;
    uint64_t c = (uint32_t)~crc;
    while (len > 0 && ((uintptr_t)p & 7u) != 0) { /* align the 8-byte loads */
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        len -= 8;
    }
    while (len > 0) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    return ~(uint32_t)c;
}

/* -1 unknown, 0 software, 1 SSE4.2. Written once; racing writers store the same value. */
static int crc32c_hw_state = -1;

int col_crc32c_hw(void) {
    int state = __atomic_load_n(&crc32c_hw_state, __ATOMIC_RELAXED);
    if (state < 0) {
        __builtin_cpu_init();
        state = __builtin_cpu_supports("sse4.2") ? 1 : 0;
        __atomic_store_n(&crc32c_hw_state, state, __ATOMIC_RELAXED);
    }
    return state;
}

uint32_t col_crc32c(uint32_t crc, const void *buf, size_t len) {
    return col_crc32c_hw() ? crc32c_sse42(crc, buf, len) : col_crc32c_sw(crc, buf, len);
}
#else
int col_crc32c_hw(void) { return 0; }

uint32_t col_crc32c(uint32_t crc, const void *buf, size_t len) {
    return col_crc32c_sw(crc, buf, len);
}
#endif
