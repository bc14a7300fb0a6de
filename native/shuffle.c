/*
 * Byte-plane shuffle / unshuffle, optionally fused with a delta: XOR, or the
 * zigzag of the integer difference of the elements' little-endian bit
 * patterns (zz(d) = (d << 1) ^ (d >> (w - 1)), arithmetic shift, w = 8k):
 * a change of a few units in the last place stays a small number in the low
 * plane instead of XOR's carry chain, and leaves the high planes zero.
 *
 * Layout (k = element size, n = len / k full elements):
 *   planes[j*n + i] = bytes[i*k + j], trailing len % k bytes copied as is
 *   (XORed with the base in both delta modes).
 *
 * SSE2 path (baseline x86-64): 16 elements per iteration. Shuffling is a
 * log2(k)-round even/odd byte de-interleave (mask/shift + packus), which
 * turns k consecutive 16-byte vectors into k plane vectors in order;
 * unshuffling runs the inverse (unpacklo/hi_epi8) the same number of
 * rounds. Scalar code handles the remainder and non-SSE2 targets.
 */
#include "dc_kernels.h"

#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define DC_INLINE static inline __attribute__((always_inline))
#else
#define DC_INLINE static inline
#endif

/* What is fused into the (un)shuffle: nothing, XOR with b, or the zigzag difference against b. */
enum { M_COPY = 0, M_XOR = 1, M_SUB = 2 };

int dc_valid_elem_size(size_t elem_size)
{
    return elem_size == 1 || elem_size == 2 || elem_size == 4 || elem_size == 8;
}

/* ------------------------------------------------------------------ */
/* scalar                                                              */
/* ------------------------------------------------------------------ */

/* The k-byte little-endian element at p (any host byte order). */
DC_INLINE uint64_t load_le(const uint8_t *p, size_t k)
{
    uint64_t v = 0;
    size_t j;
    for (j = 0; j < k; j++)
        v |= (uint64_t)p[j] << (8 * j);
    return v;
}

DC_INLINE uint64_t elem_mask(size_t k)
{
    return k == 8 ? ~(uint64_t)0 : ((uint64_t)1 << (8 * k)) - 1;
}

/* zigzag(a - b) over k-byte integers */
DC_INLINE uint64_t zz_sub(uint64_t a, uint64_t b, size_t k)
{
    uint64_t m = elem_mask(k), d = (a - b) & m;
    return ((d << 1) ^ ((uint64_t)0 - (d >> (8 * k - 1)))) & m;
}

/* b + unzigzag(z) over k-byte integers (inverse of zz_sub given b) */
DC_INLINE uint64_t zz_add(uint64_t z, uint64_t b, size_t k)
{
    return (b + ((z >> 1) ^ ((uint64_t)0 - (z & 1)))) & elem_mask(k);
}

DC_INLINE void shuffle_scalar(const uint8_t *a, const uint8_t *b, uint8_t *dst,
                              size_t n, const size_t k, size_t i0, const int mode)
{
    size_t i, j;
    for (i = i0; i < n; i++) {
        const uint8_t *pa = a + i * k;
        const uint8_t *pb = mode != M_COPY ? b + i * k : NULL;
        if (mode == M_SUB) {
            uint64_t z = zz_sub(load_le(pa, k), load_le(pb, k), k);
            for (j = 0; j < k; j++)
                dst[j * n + i] = (uint8_t)(z >> (8 * j));
            continue;
        }
        for (j = 0; j < k; j++) {
            uint8_t v = pa[j];
            if (mode == M_XOR)
                v ^= pb[j];
            dst[j * n + i] = v;
        }
    }
}

DC_INLINE void unshuffle_scalar(const uint8_t *p, const uint8_t *b, uint8_t *dst,
                                size_t n, const size_t k, size_t i0, const int mode)
{
    size_t i, j;
    for (i = i0; i < n; i++) {
        uint8_t *pd = dst + i * k;
        const uint8_t *pb = mode != M_COPY ? b + i * k : NULL;
        if (mode == M_SUB) {
            uint64_t z = 0, v;
            for (j = 0; j < k; j++)
                z |= (uint64_t)p[j * n + i] << (8 * j);
            v = zz_add(z, load_le(pb, k), k);
            for (j = 0; j < k; j++)
                pd[j] = (uint8_t)(v >> (8 * j));
            continue;
        }
        for (j = 0; j < k; j++) {
            uint8_t v = p[j * n + i];
            if (mode == M_XOR)
                v ^= pb[j];
            pd[j] = v;
        }
    }
}

/* dst[0:len] = a[0:len] (^ b[0:len]) */
DC_INLINE void copy_xor(const uint8_t *a, const uint8_t *b, uint8_t *dst,
                        size_t len, const int use_b)
{
    size_t t = 0;
    if (!use_b) {
        if (len)
            memcpy(dst, a, len);
        return;
    }
#if defined(__SSE2__)
    for (; t + 64 <= len; t += 64) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)(a + t));
        __m128i x1 = _mm_loadu_si128((const __m128i *)(a + t + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(a + t + 32));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(a + t + 48));
        x0 = _mm_xor_si128(x0, _mm_loadu_si128((const __m128i *)(b + t)));
        x1 = _mm_xor_si128(x1, _mm_loadu_si128((const __m128i *)(b + t + 16)));
        x2 = _mm_xor_si128(x2, _mm_loadu_si128((const __m128i *)(b + t + 32)));
        x3 = _mm_xor_si128(x3, _mm_loadu_si128((const __m128i *)(b + t + 48)));
        _mm_storeu_si128((__m128i *)(dst + t), x0);
        _mm_storeu_si128((__m128i *)(dst + t + 16), x1);
        _mm_storeu_si128((__m128i *)(dst + t + 32), x2);
        _mm_storeu_si128((__m128i *)(dst + t + 48), x3);
    }
#endif
    for (; t < len; t++)
        dst[t] = (uint8_t)(a[t] ^ b[t]);
}

/* ------------------------------------------------------------------ */
/* SSE2                                                                */
/* ------------------------------------------------------------------ */

#if defined(__SSE2__)

/* zigzag(a - b) in each k-byte lane */
DC_INLINE __m128i zz_sub_sse2(__m128i a, __m128i b, const int k)
{
    __m128i d;
    switch (k) {
    case 1:
        d = _mm_sub_epi8(a, b);
        return _mm_xor_si128(_mm_add_epi8(d, d), _mm_cmpgt_epi8(_mm_setzero_si128(), d));
    case 2:
        d = _mm_sub_epi16(a, b);
        return _mm_xor_si128(_mm_slli_epi16(d, 1), _mm_srai_epi16(d, 15));
    case 4:
        d = _mm_sub_epi32(a, b);
        return _mm_xor_si128(_mm_slli_epi32(d, 1), _mm_srai_epi32(d, 31));
    default: /* no 64-bit arithmetic shift in SSE2: spread each high dword's sign */
        d = _mm_sub_epi64(a, b);
        return _mm_xor_si128(_mm_slli_epi64(d, 1),
                             _mm_shuffle_epi32(_mm_srai_epi32(d, 31), _MM_SHUFFLE(3, 3, 1, 1)));
    }
}

/* b + unzigzag(z) in each k-byte lane */
DC_INLINE __m128i zz_add_sse2(__m128i z, __m128i b, const int k)
{
    const __m128i zero = _mm_setzero_si128();
    switch (k) {
    case 1: {
        const __m128i one = _mm_set1_epi8(1);
        __m128i half = _mm_and_si128(_mm_srli_epi16(z, 1), _mm_set1_epi8(0x7F));
        return _mm_add_epi8(b, _mm_xor_si128(half, _mm_sub_epi8(zero, _mm_and_si128(z, one))));
    }
    case 2:
        return _mm_add_epi16(b, _mm_xor_si128(_mm_srli_epi16(z, 1),
                                              _mm_sub_epi16(zero, _mm_and_si128(z, _mm_set1_epi16(1)))));
    case 4:
        return _mm_add_epi32(b, _mm_xor_si128(_mm_srli_epi32(z, 1),
                                              _mm_sub_epi32(zero, _mm_and_si128(z, _mm_set1_epi32(1)))));
    default:
        return _mm_add_epi64(b, _mm_xor_si128(_mm_srli_epi64(z, 1),
                                              _mm_sub_epi64(zero, _mm_and_si128(z, _mm_set_epi32(0, 1, 0, 1)))));
    }
}

/* One de-interleave round over k vectors: pairs (v[2m], v[2m+1]) are split
 * into even bytes -> w[m] and odd bytes -> w[k/2 + m]. */
DC_INLINE void deinterleave_round(__m128i *v, const int k)
{
    const __m128i lo = _mm_set1_epi16(0x00FF);
    __m128i w[8];
    int m;
    for (m = 0; m < k / 2; m++) {
        __m128i x = v[2 * m], y = v[2 * m + 1];
        w[m] = _mm_packus_epi16(_mm_and_si128(x, lo), _mm_and_si128(y, lo));
        w[k / 2 + m] = _mm_packus_epi16(_mm_srli_epi16(x, 8), _mm_srli_epi16(y, 8));
    }
    for (m = 0; m < k; m++)
        v[m] = w[m];
}

/* Inverse of deinterleave_round. */
DC_INLINE void interleave_round(__m128i *v, const int k)
{
    __m128i w[8];
    int m;
    for (m = 0; m < k / 2; m++) {
        w[2 * m] = _mm_unpacklo_epi8(v[m], v[k / 2 + m]);
        w[2 * m + 1] = _mm_unpackhi_epi8(v[m], v[k / 2 + m]);
    }
    for (m = 0; m < k; m++)
        v[m] = w[m];
}

/* Shuffles whole 16-element blocks; returns the number of elements done. */
DC_INLINE size_t shuffle_sse2(const uint8_t *a, const uint8_t *b, uint8_t *dst,
                              size_t n, const int k, const int mode)
{
    size_t i;
    for (i = 0; i + 16 <= n; i += 16) {
        __m128i v[8];
        const uint8_t *pa = a + i * (size_t)k;
        int j, r;
        for (j = 0; j < k; j++) {
            v[j] = _mm_loadu_si128((const __m128i *)(pa + 16 * j));
            if (mode != M_COPY) {
                __m128i vb = _mm_loadu_si128((const __m128i *)(b + i * (size_t)k + 16 * j));
                v[j] = mode == M_XOR ? _mm_xor_si128(v[j], vb) : zz_sub_sse2(v[j], vb, k);
            }
        }
        for (r = 1; r < k; r <<= 1)
            deinterleave_round(v, k);
        for (j = 0; j < k; j++)
            _mm_storeu_si128((__m128i *)(dst + (size_t)j * n + i), v[j]);
    }
    return i;
}

DC_INLINE size_t unshuffle_sse2(const uint8_t *p, const uint8_t *b, uint8_t *dst,
                                size_t n, const int k, const int mode)
{
    size_t i;
    for (i = 0; i + 16 <= n; i += 16) {
        __m128i v[8];
        uint8_t *pd = dst + i * (size_t)k;
        int j, r;
        for (j = 0; j < k; j++)
            v[j] = _mm_loadu_si128((const __m128i *)(p + (size_t)j * n + i));
        for (r = 1; r < k; r <<= 1)
            interleave_round(v, k);
        for (j = 0; j < k; j++) {
            if (mode != M_COPY) {
                __m128i vb = _mm_loadu_si128((const __m128i *)(b + i * (size_t)k + 16 * j));
                v[j] = mode == M_XOR ? _mm_xor_si128(v[j], vb) : zz_add_sse2(v[j], vb, k);
            }
            _mm_storeu_si128((__m128i *)(pd + 16 * j), v[j]);
        }
    }
    return i;
}

#endif /* __SSE2__ */

/* ------------------------------------------------------------------ */
/* dispatch                                                            */
/* ------------------------------------------------------------------ */

DC_INLINE void shuffle_k(const uint8_t *a, const uint8_t *b, uint8_t *dst,
                         size_t len, const int k, const int mode)
{
    size_t n = len / (size_t)k, done = 0;
#if defined(__SSE2__)
    done = shuffle_sse2(a, b, dst, n, k, mode);
#endif
    shuffle_scalar(a, b, dst, n, (size_t)k, done, mode);
    copy_xor(a + n * k, mode != M_COPY ? b + n * k : NULL, dst + n * k, len - n * k, mode != M_COPY);
}

DC_INLINE void unshuffle_k(const uint8_t *p, const uint8_t *b, uint8_t *dst,
                           size_t len, const int k, const int mode)
{
    size_t n = len / (size_t)k, done = 0;
#if defined(__SSE2__)
    done = unshuffle_sse2(p, b, dst, n, k, mode);
#endif
    unshuffle_scalar(p, b, dst, n, (size_t)k, done, mode);
    copy_xor(p + n * k, mode != M_COPY ? b + n * k : NULL, dst + n * k, len - n * k, mode != M_COPY);
}

DC_INLINE void shuffle_dispatch(const uint8_t *a, const uint8_t *b, uint8_t *dst,
                                size_t len, size_t k, const int mode)
{
    switch (k) {
    case 1:
        if (mode == M_SUB)
            shuffle_k(a, b, dst, len, 1, M_SUB);
        else
            copy_xor(a, b, dst, len, mode == M_XOR);
        break;
    case 2: shuffle_k(a, b, dst, len, 2, mode); break;
    case 4: shuffle_k(a, b, dst, len, 4, mode); break;
    case 8: shuffle_k(a, b, dst, len, 8, mode); break;
    default: break;
    }
}

DC_INLINE void unshuffle_dispatch(const uint8_t *p, const uint8_t *b, uint8_t *dst,
                                  size_t len, size_t k, const int mode)
{
    switch (k) {
    case 1:
        if (mode == M_SUB)
            unshuffle_k(p, b, dst, len, 1, M_SUB);
        else
            copy_xor(p, b, dst, len, mode == M_XOR);
        break;
    case 2: unshuffle_k(p, b, dst, len, 2, mode); break;
    case 4: unshuffle_k(p, b, dst, len, 4, mode); break;
    case 8: unshuffle_k(p, b, dst, len, 8, mode); break;
    default: break;
    }
}

/* unshuffle_k without a delta, plane j read from planes[j] and the trailing len % k bytes from tail: the
 * planes of a stored chunk where they lie (its stored bytes, zstd's output), with no copy to join them. */
DC_INLINE void unshuffle_gather_k(const uint8_t *const *planes, const uint8_t *tail, uint8_t *dst,
                                  size_t len, const int k)
{
    size_t n = len / (size_t)k, i = 0, j;
#if defined(__SSE2__)
    for (; i + 16 <= n; i += 16) {
        __m128i v[8];
        uint8_t *pd = dst + i * (size_t)k;
        int r, m;
        for (m = 0; m < k; m++)
            v[m] = _mm_loadu_si128((const __m128i *)(planes[m] + i));
        for (r = 1; r < k; r <<= 1)
            interleave_round(v, k);
        for (m = 0; m < k; m++)
            _mm_storeu_si128((__m128i *)(pd + 16 * m), v[m]);
    }
#endif
    for (; i < n; i++)
        for (j = 0; j < (size_t)k; j++)
            dst[i * k + j] = planes[j][i];
    if (len > n * k)
        memcpy(dst + n * k, tail, len - n * k);
}

void dc_unshuffle_planes(const uint8_t *const *planes, uint8_t *dst, size_t len, size_t elem_size)
{
    switch (elem_size) {
    case 1:
        if (len)
            memcpy(dst, planes[0], len);
        break;
    case 2: unshuffle_gather_k(planes, planes[2], dst, len, 2); break;
    case 4: unshuffle_gather_k(planes, planes[4], dst, len, 4); break;
    case 8: unshuffle_gather_k(planes, planes[8], dst, len, 8); break;
    default: break;
    }
}

void dc_shuffle(const uint8_t *src, uint8_t *dst, size_t len, size_t elem_size)
{
    shuffle_dispatch(src, NULL, dst, len, elem_size, M_COPY);
}

void dc_unshuffle(const uint8_t *src, uint8_t *dst, size_t len, size_t elem_size)
{
    unshuffle_dispatch(src, NULL, dst, len, elem_size, M_COPY);
}

void dc_xor_shuffle(const uint8_t *a, const uint8_t *b, uint8_t *dst,
                    size_t len, size_t elem_size)
{
    shuffle_dispatch(a, b, dst, len, elem_size, M_XOR);
}

void dc_unshuffle_xor(const uint8_t *planes, const uint8_t *base, uint8_t *dst,
                      size_t len, size_t elem_size)
{
    unshuffle_dispatch(planes, base, dst, len, elem_size, M_XOR);
}

void dc_zigzag_shuffle(const uint8_t *a, const uint8_t *b, uint8_t *dst,
                       size_t len, size_t elem_size)
{
    shuffle_dispatch(a, b, dst, len, elem_size, M_SUB);
}

void dc_unshuffle_zigzag(const uint8_t *planes, const uint8_t *base, uint8_t *dst,
                         size_t len, size_t elem_size)
{
    unshuffle_dispatch(planes, base, dst, len, elem_size, M_SUB);
}
