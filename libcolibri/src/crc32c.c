/*
 * crc32c.c — CRC-32C (Castagnoli), the checksum of every expert record in a pack.
 *
 * Two paths with identical results: the SSE4.2 crc32 instruction (chosen at run time, this
 * file is not compiled for a newer CPU than the baseline) and a slicing-by-8 table loop, the
 * reference. Both work on the non-inverted register; the ~crc at entry and exit gives the
 * standard semantics, so results chain: crc(crc(0, a), b) == crc(0, a || b).
 *
 * Why the hardware path runs three chains: the loader checks every record (1-7 MB) right
 * after its read, so the check is on the critical path of every cache miss. One chain of
 * crc32 instructions waits out each one's latency (3 cycles, 1 issued per cycle), so it
 * runs at a third of the instruction's throughput. Large buffers are therefore cut into
 * rounds of three adjacent blocks A, B, C of CRC32C_BLOCK_BYTES each, fed as three
 * independent chains in one loop (A continues the running register, B and C start at 0),
 * then joined. The register update is linear, so
 *     reg(r, A || B || C) = shift(reg(r, A), 2 * BLOCK) ^ shift(reg(0, B), BLOCK) ^ reg(0, C)
 * where shift(r, n) — feeding n zero bytes — is r * x^(8n) mod P. The two powers of x are
 * computed once at load; the two multiplications per round cost a few percent of it.
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

/* Bytes per chain and round: large enough that the two combines per round are ~2 % of the
 * round, small enough that the single-chain tail (under three blocks) stays short. */
#define CRC32C_BLOCK_BYTES 16384u

/* a * b mod P, both reflected (bit 31 is the coefficient of x^0). */
static uint32_t crc32c_mulmod(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (int i = 0; i < 32; i++) {           /* i: the power of x that bit (31 - i) of a holds */
        if (a & 0x80000000u) product ^= b;
        a <<= 1;
        b = (b >> 1) ^ ((b & 1u) ? CRC32C_POLY_REFLECTED : 0u);   /* b *= x */
    }
    return product;
}

/* x^n mod P, reflected, by square-and-multiply. */
static uint32_t crc32c_xpow(uint64_t n) {
    uint32_t result = 0x80000000u, x_pow2k = 0x40000000u;   /* x^0, x^1 */
    for (; n > 0; n >>= 1) {
        if (n & 1u) result = crc32c_mulmod(result, x_pow2k);
        x_pow2k = crc32c_mulmod(x_pow2k, x_pow2k);
    }
    return result;
}

/* shift by one block and by two: x^(8 * BLOCK) and x^(16 * BLOCK) mod P. */
static uint32_t crc32c_shift_1block, crc32c_shift_2blocks;

__attribute__((constructor)) static void crc32c_init_shifts(void) {
    crc32c_shift_1block = crc32c_xpow(8ull * CRC32C_BLOCK_BYTES);
    crc32c_shift_2blocks = crc32c_xpow(16ull * CRC32C_BLOCK_BYTES);
}

static inline uint64_t crc32c_load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const void *buf,
                                                                size_t len) {
    const size_t block = CRC32C_BLOCK_BYTES;
    const uint8_t *p = buf;
    uint64_t c = (uint32_t)~crc;
    while (len > 0 && ((uintptr_t)p & 7u) != 0) { /* align the 8-byte loads */
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    while (len >= 3 * block) { /* one round: three chains over blocks A, B, C, then combine */
        uint64_t crc_a = c, crc_b = 0, crc_c = 0;
        for (size_t i = 0; i < block; i += 8) {
            crc_a = _mm_crc32_u64(crc_a, crc32c_load64(p + i));
            crc_b = _mm_crc32_u64(crc_b, crc32c_load64(p + block + i));
            crc_c = _mm_crc32_u64(crc_c, crc32c_load64(p + 2 * block + i));
        }
        c = crc32c_mulmod((uint32_t)crc_a, crc32c_shift_2blocks) ^
            crc32c_mulmod((uint32_t)crc_b, crc32c_shift_1block) ^ (uint32_t)crc_c;
        p += 3 * block;
        len -= 3 * block;
    }
    while (len >= 8) {
        c = _mm_crc32_u64(c, crc32c_load64(p));
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
