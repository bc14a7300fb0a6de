/*
 * Chunk refs of a manifest item, read straight from its msgpack into an id buffer (no object per ref).
 *
 * Only the canonical form deltackpt writes is read here: an array (fixarray, array16 or array32) of refs,
 * each a 2- or 3-element fixarray [bin8 of 16 bytes, length, skip] with non-negative integers in any
 * unsigned msgpack encoding. Anything else (other encodings, damage, trailing bytes, a length sum past
 * 64 bits) returns -1 and the caller decodes the refs the general, strictly validated way, which then
 * accepts or rejects them: so this path never accepts what the schema would refuse.
 */
#include "dc_kernels.h"

#include <string.h>

#define DC_MIN_REF_BYTES 20 /* fixarray + bin8 header (2) + 16 id bytes + a 1-byte length */

/* Big-endian unsigned integer of n bytes. */
static uint64_t be(const uint8_t *p, size_t n)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* A non-negative msgpack integer at *pos (advanced past it) into *out; 0 if there is none. */
static int read_uint(const uint8_t *buf, size_t len, size_t *pos, uint64_t *out)
{
    size_t p = *pos, n;
    if (p >= len)
        return 0;
    uint8_t tag = buf[p];
    if (tag <= 0x7f) {
        *out = tag;
        *pos = p + 1;
        return 1;
    }
    switch (tag) {
    case 0xcc: n = 1; break;
    case 0xcd: n = 2; break;
    case 0xce: n = 4; break;
    case 0xcf: n = 8; break;
    default: return 0;
    }
    if (len - p - 1 < n)
        return 0;
    *out = be(buf + p + 1, n);
    *pos = p + 1 + n;
    return 1;
}

/* The number of refs in a msgpack array of them (and its header's size), -1 if it is not one. */
static int64_t refs_count(const uint8_t *buf, size_t len, size_t *header)
{
    uint64_t n;
    if (len < 1)
        return -1;
    if ((buf[0] & 0xf0) == 0x90) {
        n = buf[0] & 0x0f;
        *header = 1;
    } else if (buf[0] == 0xdc && len >= 3) {
        n = be(buf + 1, 2);
        *header = 3;
    } else if (buf[0] == 0xdd && len >= 5) {
        n = be(buf + 1, 4);
        *header = 5;
    } else {
        return -1;
    }
    if (n > (len - *header) / DC_MIN_REF_BYTES) /* a forged count must not size an allocation */
        return -1;
    return (int64_t)n;
}

int64_t dc_chunk_refs(const uint8_t *buf, size_t len, uint8_t *ids, size_t cap, uint64_t *total)
{
    size_t pos;
    int64_t n = refs_count(buf, len, &pos);
    uint64_t sum = 0, length, skip;
    if (n < 0 || (uint64_t)n > cap)
        return -1;
    for (int64_t i = 0; i < n; i++) {
        if (len - pos < 19 || (buf[pos] != 0x92 && buf[pos] != 0x93) || buf[pos + 1] != 0xc4
            || buf[pos + 2] != 16)
            return -1;
        int fields = buf[pos] & 0x0f;
        memcpy(ids + 16 * (size_t)i, buf + pos + 3, 16);
        pos += 19;
        if (!read_uint(buf, len, &pos, &length) || (fields == 3 && !read_uint(buf, len, &pos, &skip)))
            return -1;
        if (sum + length < sum)
            return -1;
        sum += length;
    }
    if (pos != len)
        return -1;
    *total = sum;
    return n;
}
