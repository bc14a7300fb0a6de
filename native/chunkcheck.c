/*
 * Checking chunks read back: the planes of many chunks unshuffled into place and each chunk's bytes hashed
 * against its id (xxh3-128, as the xxhash package computes it), in one call: through Python each 8 KiB chunk
 * cost a few us of calls around ~1 us of work.
 *
 * xxhash.h is vendored from the sdist of the xxhash package (third_party/xxhash, BSD-2-Clause) and inlined.
 */
#include <string.h>

#include "dc_kernels.h"

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

void dc_xxh3_128(const void *data, size_t len, uint8_t digest[16])
{
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(data, len));
    memcpy(digest, c.digest, 16);
}

uint64_t dc_xxh3_64(const void *data, size_t len)
{
    return XXH3_64bits(data, len);
}

size_t dc_unshuffle_check(const uint8_t *const *segs, uint8_t *const *dsts, const size_t *lens, size_t n,
                          size_t elem_size, const uint8_t *ids, uint8_t *ok)
{
    size_t j, passed = 0;
    uint8_t digest[16];
    for (j = 0; j < n; j++) {
        dc_unshuffle_planes(segs + j * (elem_size + 1), dsts[j], lens[j], elem_size);
        dc_xxh3_128(dsts[j], lens[j], digest);
        ok[j] = memcmp(digest, ids + 16 * j, 16) == 0;
        passed += ok[j];
    }
    return passed;
}
