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
 * merge). apply goes 8 elements per step the same way (each plane expanded,
 * the planes interleaved into elements) and skips 256 elements at a time
 * where every plane's bitmap is zero. The scalar code is the reference and
 * handles the ends.
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

/* Bitmap bytes [b, b + w) (w <= 8) as one little-endian word: bit t is element b * 8 + t. */
static uint64_t bitmap_word(const uint8_t *p, size_t w)
{
    uint64_t x = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (w == 8) {
        memcpy(&x, p, 8);
        return x;
    }
#endif
    for (size_t t = 0; t < w; t++)
        x |= (uint64_t)p[t] << (8 * t);
    return x;
}

#if DC_SPARSE_SIMD
/* Unzigzag the k-byte little-endian integers in v: (z >> 1) ^ -(z & 1). */
static __m128i unzig(__m128i v, size_t k)
{
    const __m128i zero = _mm_setzero_si128();
    switch (k) {
    case 1:
        return _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(v, 1), _mm_set1_epi8(0x7F)),
                             _mm_sub_epi8(zero, _mm_and_si128(v, _mm_set1_epi8(1))));
    case 2:
        return _mm_xor_si128(_mm_srli_epi16(v, 1), _mm_sub_epi16(zero, _mm_and_si128(v, _mm_set1_epi16(1))));
    case 4:
        return _mm_xor_si128(_mm_srli_epi32(v, 1), _mm_sub_epi32(zero, _mm_and_si128(v, _mm_set1_epi32(1))));
    default:
        return _mm_xor_si128(_mm_srli_epi64(v, 1),
                             _mm_sub_epi64(zero, _mm_and_si128(v, _mm_set_epi64x(1, 1))));
    }
}

/* dst's k-byte integers plus (zig) or XOR d: the k-byte lanes of one 16-byte vector. */
static __m128i combine(__m128i e, __m128i d, size_t k, int zig)
{
    if (!zig)
        return _mm_xor_si128(e, d);
    d = unzig(d, k);
    switch (k) {
    case 1:
        return _mm_add_epi8(e, d);
    case 2:
        return _mm_add_epi16(e, d);
    case 4:
        return _mm_add_epi32(e, d);
    default:
        return _mm_add_epi64(e, d);
    }
}

/* One 64-element window of dc_sparse_apply, 8 elements (one bitmap byte of each plane) per step: each plane's
 * values are expanded to 8 bytes by the merge table, the k planes interleaved into 8 k-byte elements and
 * combined with dst's. Returns nonzero when a value stored as nonzero is zero. The caller checked the counts
 * and that every 8-byte load at vals + j * n + pos[j] (and up to 56 bytes further) stays inside vals. */
static inline __attribute__((always_inline)) unsigned
apply_window_k(const uint64_t *words_in, const uint8_t *vals, size_t n, size_t *pos_io, uint8_t *dst, const size_t k,
               const int zig, uint64_t any)
{
    const __m128i zero = _mm_setzero_si128();
    unsigned bad = 0;
    uint64_t words[8];
    size_t pos[8]; /* locals, which the stores to dst cannot alias: kept in registers */
    for (size_t j = 0; j < k; j++) {
        words[j] = words_in[j];
        pos[j] = pos_io[j];
    }
    while (any) {
        unsigned byte = (unsigned)__builtin_ctzll(any) >> 3;
        __m128i p[8], x[8];
        uint8_t *e = dst + (size_t)byte * 8 * k;
        any &= ~((uint64_t)0xFF << (8 * byte));
        for (size_t j = 0; j < k; j++) {
            unsigned m = (unsigned)(words[j] >> (8 * byte)) & 0xFFu;
            __m128i v = _mm_loadl_epi64((const __m128i *)(vals + j * n + pos[j]));
            p[j] = _mm_shuffle_epi8(v, _mm_loadu_si128((const __m128i *)expand_tab[m]));
            bad |= (unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(p[j], zero)) & m;
            pos[j] += (size_t)__builtin_popcount(m);
        }
        /* interleave: plane bytes -> elements (low 8 bytes of each p[j] used) */
        switch (k) {
        case 1: {
            __m128i d = combine(_mm_loadl_epi64((const __m128i *)e), p[0], 1, zig);
            _mm_storel_epi64((__m128i *)e, d);
            continue;
        }
        case 2:
            x[0] = _mm_unpacklo_epi8(p[0], p[1]);
            break;
        case 4: {
            __m128i a = _mm_unpacklo_epi8(p[0], p[1]), b = _mm_unpacklo_epi8(p[2], p[3]);
            x[0] = _mm_unpacklo_epi16(a, b);
            x[1] = _mm_unpackhi_epi16(a, b);
            break;
        }
        default: {
            __m128i a = _mm_unpacklo_epi8(p[0], p[1]), b = _mm_unpacklo_epi8(p[2], p[3]);
            __m128i c = _mm_unpacklo_epi8(p[4], p[5]), d = _mm_unpacklo_epi8(p[6], p[7]);
            __m128i lo0 = _mm_unpacklo_epi16(a, b), hi0 = _mm_unpackhi_epi16(a, b);
            __m128i lo1 = _mm_unpacklo_epi16(c, d), hi1 = _mm_unpackhi_epi16(c, d);
            x[0] = _mm_unpacklo_epi32(lo0, lo1);
            x[1] = _mm_unpackhi_epi32(lo0, lo1);
            x[2] = _mm_unpacklo_epi32(hi0, hi1);
            x[3] = _mm_unpackhi_epi32(hi0, hi1);
            break;
        }
        }
        for (size_t q = 0; q < k / 2; q++) {
            __m128i *eq = (__m128i *)(e + 16 * q);
            _mm_storeu_si128(eq, combine(_mm_loadu_si128(eq), x[q], k, zig));
        }
    }
    for (size_t j = 0; j < k; j++)
        pos_io[j] = pos[j];
    return bad;
}

/* apply_window_k with k and zig as constants (unrolled over the planes). */
static unsigned apply_window(const uint64_t *words, const uint8_t *vals, size_t n, size_t *pos, uint8_t *dst,
                             size_t k, int zig, uint64_t any)
{
#define DC_APPLY_CASE(K)                                                                                       \
    case K:                                                                                                    \
        return zig ? apply_window_k(words, vals, n, pos, dst, K, 1, any)                                       \
                   : apply_window_k(words, vals, n, pos, dst, K, 0, any);
    switch (k) {
        DC_APPLY_CASE(1)
        DC_APPLY_CASE(2)
        DC_APPLY_CASE(4)
        DC_APPLY_CASE(8)
    }
#undef DC_APPLY_CASE
    return 1;
}
#endif

int dc_sparse_apply(const uint8_t *bitmaps, const uint8_t *vals, const uint64_t *counts, uint8_t *dst,
                    size_t n, size_t k, int zig)
{
    size_t bm_len = (n + 7) / 8, pos[8] = {0};
    unsigned bad = 0;
    for (size_t j = 0; j < k; j++)
        if (counts[j] > n)
            return -1;
    for (size_t b = 0; b < bm_len; b += 8) {
        size_t w = bm_len - b < 8 ? bm_len - b : 8, first = b * 8;
        uint64_t words[8], any = 0;
#if DC_SPARSE_SIMD
        /* most of a sparse plane set's bitmaps are zero: skipped 256 elements (4 windows) at a time */
        if (b % 32 == 0 && b + 32 <= bm_len) {
            __m128i acc = _mm_setzero_si128();
            for (size_t j = 0; j < k; j++) {
                const uint8_t *p = bitmaps + j * bm_len + b;
                acc = _mm_or_si128(acc, _mm_or_si128(_mm_loadu_si128((const __m128i *)p),
                                                     _mm_loadu_si128((const __m128i *)(p + 16))));
            }
            if (_mm_movemask_epi8(_mm_cmpeq_epi8(acc, _mm_setzero_si128())) == 0xFFFF) {
                b += 24;
                continue;
            }
        }
#endif
        for (size_t j = 0; j < k; j++) {
            words[j] = bitmap_word(bitmaps + j * bm_len + b, w);
            any |= words[j];
        }
        /* most words of a sparse plane set are zero: skipped at one load per plane */
        if (!any)
            continue;
        if (n - first < 64 && (any >> (n - first)))
            return -1; /* a padding bit past n */
        for (size_t j = 0; j < k; j++)
            if ((uint64_t)__builtin_popcountll(words[j]) > counts[j] - pos[j])
                return -1; /* more positions than values: every read below stays inside vals */
#if DC_SPARSE_SIMD
        /* A full window whose 8-byte value loads all stay inside vals (each plane reads at most 64 bytes
         * from its position on; plane j's slot ends at vals + (k - j) * n from its start) and whose 64
         * elements all lie inside dst (its 8-element steps load and store whole blocks: with n % 64 past 56
         * the last window's last step ran past dst's end) goes block by block: 8 elements per step, whatever
         * the density. */
        if (tabs_ready && w == 8 && n - first >= 64) {
            size_t j = 0;
            while (j < k && pos[j] + 64 <= (k - j) * n)
                j++;
            if (j == k) {
                bad |= apply_window(words, vals, n, pos, dst + first * k, k, zig, any);
                continue;
            }
        }
#endif
        if (!zig) {
            /* XOR is bytewise: each plane on its own, one step per nonzero byte */
            for (size_t j = 0; j < k; j++) {
                uint64_t m = words[j];
                const uint8_t *vj = vals + j * n + pos[j];
                uint8_t *dj = dst + first * k + j;
                pos[j] += (size_t)__builtin_popcountll(m);
                while (m) {
                    unsigned t = (unsigned)__builtin_ctzll(m);
                    uint8_t v = *vj++;
                    m &= m - 1;
                    bad |= v == 0;
                    dj[(size_t)t * k] ^= v;
                }
            }
            continue;
        }
        while (any) {
            unsigned t = (unsigned)__builtin_ctzll(any);
            uint64_t d = 0, x = 0;
            uint8_t *e = dst + (first + t) * k;
            any &= any - 1;
            for (size_t j = 0; j < k; j++) {
                unsigned bit = (unsigned)(words[j] >> t) & 1u;
                /* read without a branch; a clear bit reads a byte it then masks (pos < n there, as the
                 * plane has a zero byte) */
                uint8_t v = vals[j * n + (pos[j] < n ? pos[j] : n - 1)] & (uint8_t)(0u - bit);
                bad |= bit & (v == 0);
                pos[j] += bit;
                d |= (uint64_t)v << (8 * j);
            }
            for (size_t j = 0; j < k; j++)
                x |= (uint64_t)e[j] << (8 * j);
            x += (d >> 1) ^ (0 - (d & 1)); /* modulo 2^64: its low 8k bits are the k-byte sum */
            for (size_t j = 0; j < k; j++)
                e[j] = (uint8_t)(x >> (8 * j));
        }
    }
    if (bad)
        return -1;
    for (size_t j = 0; j < k; j++)
        if (pos[j] != counts[j])
            return -1;
    return 0;
}

uint64_t dc_plane_stats(const uint8_t *src, size_t n, size_t *nonzero)
{
    /* Four tables so that runs of one byte value do not serialize on one counter; uint32 counters, emptied
     * into the totals every 2^30 bytes. */
    uint32_t h[4][256];
    uint64_t total[256] = {0}, pairs = 0;
    size_t i = 0, b;

    while (i < n) {
        size_t end = n - i > ((size_t)1 << 30) ? i + ((size_t)1 << 30) : n;
        memset(h, 0, sizeof h);
        for (; i + 8 <= end; i += 8) {
            uint64_t w;
            memcpy(&w, src + i, 8);
            h[0][w & 255]++;
            h[1][(w >> 8) & 255]++;
            h[2][(w >> 16) & 255]++;
            h[3][(w >> 24) & 255]++;
            h[0][(w >> 32) & 255]++;
            h[1][(w >> 40) & 255]++;
            h[2][(w >> 48) & 255]++;
            h[3][w >> 56]++;
        }
        for (; i < end; i++)
            h[0][src[i]]++;
        for (b = 0; b < 256; b++)
            total[b] += (uint64_t)h[0][b] + h[1][b] + h[2][b] + h[3][b];
    }
    for (b = 0; b < 256; b++)
        pairs += total[b] * (total[b] - (total[b] > 0));
    *nonzero = n - (size_t)total[0];
    return pairs;
}
