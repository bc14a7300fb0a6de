/*
 * Byte-plane shuffle / unshuffle, optionally fused with an XOR delta.
 *
 * Layout (k = element size, n = len / k full elements):
 *   planes[j*n + i] = bytes[i*k + j], trailing len % k bytes copied as is.
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

int dc_valid_elem_size(size_t elem_size)
{
    return elem_size == 1 || elem_size == 2 || elem_size == 4 || elem_size == 8;
}

/* ------------------------------------------------------------------ */
/* scalar                                                              */
/* ------------------------------------------------------------------ */

DC_INLINE void shuffle_scalar(const uint8_t *a, const uint8_t *b, uint8_t *dst,
                              size_t n, const size_t k, size_t i0, const int use_b)
{
    size_t i, j;
    for (i = i0; i < n; i++) {
        const uint8_t *pa = a + i * k;
        const uint8_t *pb = use_b ? b + i * k : NULL;
        for (j = 0; j < k; j++) {
            uint8_t v = pa[j];
            if (use_b)
                v ^= pb[j];
            dst[j * n + i] = v;
        }
    }
}

DC_INLINE void unshuffle_scalar(const uint8_t *p, const uint8_t *b, uint8_t *dst,
                                size_t n, const size_t k, size_t i0, const int use_b)
{
    size_t i, j;
    for (i = i0; i < n; i++) {
        uint8_t *pd = dst + i * k;
        const uint8_t *pb = use_b ? b + i * k : NULL;
        for (j = 0; j < k; j++) {
            uint8_t v = p[j * n + i];
            if (use_b)
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
                              size_t n, const int k, const int use_b)
{
    size_t i;
    for (i = 0; i + 16 <= n; i += 16) {
        __m128i v[8];
        const uint8_t *pa = a + i * (size_t)k;
        int j, r;
        for (j = 0; j < k; j++) {
            v[j] = _mm_loadu_si128((const __m128i *)(pa + 16 * j));
            if (use_b)
                v[j] = _mm_xor_si128(
                    v[j], _mm_loadu_si128((const __m128i *)(b + i * (size_t)k + 16 * j)));
        }
        for (r = 1; r < k; r <<= 1)
            deinterleave_round(v, k);
        for (j = 0; j < k; j++)
            _mm_storeu_si128((__m128i *)(dst + (size_t)j * n + i), v[j]);
    }
    return i;
}

DC_INLINE size_t unshuffle_sse2(const uint8_t *p, const uint8_t *b, uint8_t *dst,
                                size_t n, const int k, const int use_b)
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
            if (use_b)
                v[j] = _mm_xor_si128(
                    v[j], _mm_loadu_si128((const __m128i *)(b + i * (size_t)k + 16 * j)));
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
                         size_t len, const int k, const int use_b)
{
    size_t n = len / (size_t)k, done = 0;
#if defined(__SSE2__)
    done = shuffle_sse2(a, b, dst, n, k, use_b);
#endif
    shuffle_scalar(a, b, dst, n, (size_t)k, done, use_b);
    copy_xor(a + n * k, use_b ? b + n * k : NULL, dst + n * k, len - n * k, use_b);
}

DC_INLINE void unshuffle_k(const uint8_t *p, const uint8_t *b, uint8_t *dst,
                           size_t len, const int k, const int use_b)
{
    size_t n = len / (size_t)k, done = 0;
#if defined(__SSE2__)
    done = unshuffle_sse2(p, b, dst, n, k, use_b);
#endif
    unshuffle_scalar(p, b, dst, n, (size_t)k, done, use_b);
    copy_xor(p + n * k, use_b ? b + n * k : NULL, dst + n * k, len - n * k, use_b);
}

DC_INLINE void shuffle_dispatch(const uint8_t *a, const uint8_t *b, uint8_t *dst,
                                size_t len, size_t k, const int use_b)
{
    switch (k) {
    case 1: copy_xor(a, b, dst, len, use_b); break;
    case 2: shuffle_k(a, b, dst, len, 2, use_b); break;
    case 4: shuffle_k(a, b, dst, len, 4, use_b); break;
    case 8: shuffle_k(a, b, dst, len, 8, use_b); break;
    default: break;
    }
}

DC_INLINE void unshuffle_dispatch(const uint8_t *p, const uint8_t *b, uint8_t *dst,
                                  size_t len, size_t k, const int use_b)
{
    switch (k) {
    case 1: copy_xor(p, b, dst, len, use_b); break;
    case 2: unshuffle_k(p, b, dst, len, 2, use_b); break;
    case 4: unshuffle_k(p, b, dst, len, 4, use_b); break;
    case 8: unshuffle_k(p, b, dst, len, 8, use_b); break;
    default: break;
    }
}

void dc_shuffle(const uint8_t *src, uint8_t *dst, size_t len, size_t elem_size)
{
    shuffle_dispatch(src, NULL, dst, len, elem_size, 0);
}

void dc_unshuffle(const uint8_t *src, uint8_t *dst, size_t len, size_t elem_size)
{
    unshuffle_dispatch(src, NULL, dst, len, elem_size, 0);
}

void dc_xor_shuffle(const uint8_t *a, const uint8_t *b, uint8_t *dst,
                    size_t len, size_t elem_size)
{
    shuffle_dispatch(a, b, dst, len, elem_size, 1);
}

void dc_unshuffle_xor(const uint8_t *planes, const uint8_t *base, uint8_t *dst,
                      size_t len, size_t elem_size)
{
    unshuffle_dispatch(planes, base, dst, len, elem_size, 1);
}
