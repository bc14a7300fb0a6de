/*
 * Zero-sparse split / merge of a byte plane.
 *
 * split: bitmap bit i (LSB first within each byte) is 1 where src[i] != 0;
 * vals receives the nonzero bytes in order. A plane that is mostly zero
 * (the high planes of an XOR delta) then goes to zstd as n/8 + nnz bytes
 * instead of n: about three times less zstd work, and a better ratio.
 *
 * merge is the inverse and checks its input: it fails (returns -1, writes
 * nothing past dst + n) when the bitmap names more or fewer nonzero bytes
 * than vals holds, when a padding bit past n is set, or when a value stored
 * as nonzero is zero (split never produces one, so accepting it would let
 * two encodings decode alike).
 *
 * SSSE3 path (x86-64-v2): 8 bytes per step through a 256-entry byte-shuffle
 * table indexed by the step's bitmap byte (compact on split, expand on
 * merge). The scalar code is the reference and handles the ends.
 */
#include "dc_kernels.h"

#include <string.h>

#if defined(__SSSE3__)
#include <tmmintrin.h>
#define DC_SPARSE_SIMD 1
#else
#define DC_SPARSE_SIMD 0
#endif

#if DC_SPARSE_SIMD
static uint8_t compact_tab[256][16], expand_tab[256][16];
static int tabs_ready;

static void init_tabs(void)
{
    for (unsigned m = 0; m < 256; m++) {
        unsigned c = 0;
        memset(compact_tab[m], 0x80, 16);
        memset(expand_tab[m], 0x80, 16);
        for (unsigned j = 0; j < 8; j++) {
            if (m >> j & 1) {
                compact_tab[m][c] = (uint8_t)j;
                expand_tab[m][j] = (uint8_t)c;
                c++;
            }
        }
    }
    tabs_ready = 1;
}
#endif

void dc_sparse_init(void)
{
#if DC_SPARSE_SIMD
    if (!tabs_ready)
        init_tabs();
#endif
}

static size_t split_scalar(const uint8_t *src, size_t i, size_t n, uint8_t *bitmap, uint8_t *vals, size_t k)
{
    for (size_t b = i / 8; i < n; b++) {
        unsigned m = 0;
        for (unsigned j = 0; j < 8 && i < n; j++, i++) {
            uint8_t v = src[i];
            unsigned nz = v != 0;
            vals[k] = v; /* k <= i < n: always inside vals */
            k += nz;
            m |= nz << j;
        }
        bitmap[b] = (uint8_t)m;
    }
    return k;
}

size_t dc_sparse_split(const uint8_t *src, size_t n, uint8_t *bitmap, uint8_t *vals)
{
    size_t k = 0, i = 0;
#if DC_SPARSE_SIMD
    if (tabs_ready) {
        const __m128i zero = _mm_setzero_si128();
        for (; i + 16 <= n; i += 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)(src + i));
            unsigned m = (unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v, zero)) ^ 0xFFFFu;
            unsigned lo = m & 0xFF, hi = m >> 8;
            bitmap[i / 8] = (uint8_t)lo;
            bitmap[i / 8 + 1] = (uint8_t)hi;
            /* k <= i, so both 8-byte stores end at or before i + 16 <= n. */
            _mm_storel_epi64((__m128i *)(vals + k),
                             _mm_shuffle_epi8(v, _mm_loadu_si128((const __m128i *)compact_tab[lo])));
            k += (size_t)__builtin_popcount(lo);
            _mm_storel_epi64((__m128i *)(vals + k),
                             _mm_shuffle_epi8(_mm_srli_si128(v, 8),
                                              _mm_loadu_si128((const __m128i *)compact_tab[hi])));
            k += (size_t)__builtin_popcount(hi);
        }
    }
#endif
    return split_scalar(src, i, n, bitmap, vals, k);
}

/* One bitmap byte's len (<= 8) output bytes, scalar; 0 or -1 as dc_sparse_merge. */
static int merge_step(unsigned m, unsigned len, const uint8_t *vals, size_t nvals, size_t *k, uint8_t *dst)
{
    if (len < 8 && (m >> len))
        return -1; /* a padding bit past n */
    if (*k + (size_t)__builtin_popcount(m) > nvals)
        return -1;
    for (unsigned j = 0; j < len; j++) {
        if (m >> j & 1) {
            uint8_t v = vals[(*k)++];
            if (v == 0)
                return -1;
            dst[j] = v;
        } else {
            dst[j] = 0;
        }
    }
    return 0;
}

int dc_sparse_merge(const uint8_t *bitmap, const uint8_t *vals, size_t nvals, uint8_t *dst, size_t n)
{
    size_t k = 0, i = 0, b = 0;
    for (; i + 8 <= n; i += 8, b++) {
        unsigned m = bitmap[b];
#if DC_SPARSE_SIMD
        /* An 8-byte load at vals + k must stay inside vals: k + 8 <= nvals. No branch on m: table 0
         * gives 8 zeros. */
        if (tabs_ready && k + 8 <= nvals) {
            __m128i v = _mm_loadl_epi64((const __m128i *)(vals + k));
            __m128i out = _mm_shuffle_epi8(v, _mm_loadu_si128((const __m128i *)expand_tab[m]));
            /* a stored value must be nonzero where the bitmap says so */
            if ((unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(out, _mm_setzero_si128())) & m)
                return -1;
            _mm_storel_epi64((__m128i *)(dst + i), out);
            k += (size_t)__builtin_popcount(m);
            continue;
        }
#endif
        if (m == 0) {
            memset(dst + i, 0, 8);
            continue;
        }
        if (merge_step(m, 8, vals, nvals, &k, dst + i) != 0)
            return -1;
    }
    if (i < n && merge_step(bitmap[b], (unsigned)(n - i), vals, nvals, &k, dst + i) != 0)
        return -1;
    return k == nvals ? 0 : -1;
}
