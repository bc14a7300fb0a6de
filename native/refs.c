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
/* A ref's length and skip at most (manifest.MAX_REF_BYTES, a chunk's bytes): past it the general reader refuses. */
#define DC_MAX_REF_BYTES ((uint64_t)1 << 30)

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

/* read_uint for a piece of a stream: 1 with the integer, 0 when it is cut off, -1 when it is no unsigned one. */
static int next_uint(const uint8_t *buf, size_t len, size_t *pos, uint64_t *out)
{
    if (*pos >= len)
        return 0;
    if (read_uint(buf, len, pos, out))
        return 1;
    return buf[*pos] >= 0xcc && buf[*pos] <= 0xcf ? 0 : -1;
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

int64_t dc_chunk_refs(const uint8_t *buf, size_t len, uint8_t *ids, uint32_t *ends, size_t cap, uint64_t *total)
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
        if (fields == 2)
            skip = 0;
        if (length > DC_MAX_REF_BYTES || skip > DC_MAX_REF_BYTES || sum + length < sum)
            return -1;
        if (ends)
            ends[i] = (uint32_t)(skip + length);
        sum += length;
    }
    if (pos != len)
        return -1;
    *total = sum;
    return n;
}

/*
 * A resumable walk over a whole manifest body fed in pieces (see dc_walker in dc_kernels.h): the bytes of
 * the top-level map go to `top` with the items array left empty, each item's bytes to `items` with its
 * chunk refs replaced by nil, their ids to `ids` and per item (count, total length) to `recs`. Only what
 * it can prove canonical is walked; anything else (a form deltackpt never writes, damage) fails, and the
 * caller reads the manifest the general way, which then decides.
 */
enum { DC_ANY, DC_TOP, DC_ITEMS, DC_ITEM };
enum { DC_NEXT_PLAIN, DC_NEXT_ITEMS, DC_NEXT_CHUNKS };

#define DC_WALK_FAIL(w) ((w)->failed = 1, DC_WALK_FAILED)

/* The header of the msgpack value at buf (len bytes available): its size in *hsize, the payload bytes that
 * follow it (str, bin, ext) in *payload, the values it contains (array: n, map: 2n) in *nested; 0 when more
 * bytes are needed, -1 for a byte that starts no value. */
static int header(const uint8_t *buf, size_t len, size_t *hsize, uint64_t *payload, uint64_t *nested)
{
    static const uint8_t fixed[] = {1, 2, 4, 8, 16}; /* fixext 1..16 */
    uint8_t t;
    size_t n = 0;
    if (len < 1)
        return 0;
    t = buf[0];
    *payload = *nested = 0;
    *hsize = 1;
    if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3)
        return 1;
    if ((t & 0xf0) == 0x80) {
        *nested = 2 * (uint64_t)(t & 0x0f);
        return 1;
    }
    if ((t & 0xf0) == 0x90) {
        *nested = t & 0x0f;
        return 1;
    }
    if ((t & 0xe0) == 0xa0) {
        *payload = t & 0x1f;
        return 1;
    }
    switch (t) {
    case 0xcc: case 0xd0: n = 1; *hsize += n; break;
    case 0xcd: case 0xd1: n = 2; *hsize += n; break;
    case 0xca: case 0xce: case 0xd2: n = 4; *hsize += n; break;
    case 0xcb: case 0xcf: case 0xd3: n = 8; *hsize += n; break;
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8:
        *hsize = 2; /* and the type byte */
        *payload = fixed[t - 0xd4];
        return len >= 2 ? 1 : 0;
    case 0xc4: case 0xd9: n = 1; break;
    case 0xc5: case 0xda: case 0xdc: case 0xde: n = 2; break;
    case 0xc6: case 0xdb: case 0xdd: case 0xdf: n = 4; break;
    case 0xc7: n = 1; break;
    case 0xc8: n = 2; break;
    case 0xc9: n = 4; break;
    default: return -1; /* 0xc1 */
    }
    if (t <= 0xd3 && t >= 0xca) /* numbers: no payload */
        return len >= *hsize ? 1 : 0;
    if (len < 1 + n + (t >= 0xc7 && t <= 0xc9))
        return 0;
    uint64_t v = be(buf + 1, n);
    *hsize = 1 + n;
    if (t == 0xdc || t == 0xdd)
        *nested = v;
    else if (t == 0xde || t == 0xdf)
        *nested = 2 * v;
    else if (t >= 0xc7 && t <= 0xc9) {
        *payload = v;
        *hsize += 1; /* the type byte */
    } else
        *payload = v;
    return 1;
}

/* Whether the str value at buf (header hsize, payload plen, all in the buffer) is `want`. */
static int is_key(const uint8_t *buf, size_t hsize, uint64_t plen, const char *want)
{
    size_t n = strlen(want);
    return (buf[0] & 0xe0) == 0xa0 || buf[0] == 0xd9 || buf[0] == 0xda || buf[0] == 0xdb
               ? plen == n && memcmp(buf + hsize, want, n) == 0
               : 0;
}

/* A value of the frame on top ended: count it, closing every container it completes. */
static int value_done(dc_walker *w)
{
    while (w->depth > 0) {
        uint32_t d = w->depth - 1;
        if (--w->left[d] > 0)
            return 0;
        w->depth = d;
        if (w->kind[d] == DC_ITEM) {
            uint64_t rec[2] = {w->item_refs, w->item_total};
            if (w->recs_at >= w->recs_cap) { /* dc_walk leaves room for one: only a forged state ends two */
                w->failed = 1;
                return -1;
            }
            memcpy(w->recs + 2 * w->recs_at, rec, sizeof rec); /* recs: any alignment */
            w->recs_at++;
            w->items_end = w->items_at;
        } else if (w->kind[d] == DC_ITEMS) {
            w->in_items = 0;
        }
    }
    w->done = 1;
    return 0;
}

static void emit(dc_walker *w, const uint8_t *src, size_t n)
{
    /* dc_walk checked the room, but of the output in_items names: a forged state can name the other */
    if (n > (w->in_items ? w->items_cap - w->items_at : w->top_cap - w->top_at)) {
        w->failed = 1;
        return;
    }
    if (w->in_items) {
        memcpy(w->items + w->items_at, src, n);
        w->items_at += n;
    } else {
        memcpy(w->top + w->top_at, src, n);
        w->top_at += n;
    }
}

/* Open a container of `count` values (a map counts two per pair); one with none ends at once. */
static int push(dc_walker *w, uint8_t kind, uint64_t count)
{
    if (w->depth >= DC_WALK_DEPTH)
        return -1;
    if (kind == DC_ITEM) {
        w->item_refs = w->item_total = 0;
        w->item_chunks = 0;
    }
    if (kind == DC_ITEMS)
        w->in_items = 1;
    w->kind[w->depth] = kind;
    w->left[w->depth] = count + 1; /* value_done takes one off for nothing: the container's own header */
    w->depth++;
    return value_done(w);
}

int dc_walk(dc_walker *w, const uint8_t *buf, size_t len, size_t *consumed)
{
    size_t pos = 0;
    int rc = DC_WALK_NEED_INPUT;
    if (w->failed)
        return DC_WALK_FAILED;
    while (1) {
        size_t room_top = w->top_cap - w->top_at, room_items = w->items_cap - w->items_at;
        if (w->failed) /* emit or value_done refused a write past an output */
            return DC_WALK_FAILED;
        if (w->recs_at == w->recs_cap) { /* a step can end an item: room for its record first */
            rc = DC_WALK_OUTPUT_FULL;
            break;
        }
        if (w->copy_left) { /* the payload of a str, bin or ext, copied as it comes */
            size_t room = w->in_items ? room_items : room_top;
            size_t n = len - pos;
            if (n > w->copy_left)
                n = (size_t)w->copy_left;
            if (n > room)
                n = room;
            emit(w, buf + pos, n);
            pos += n;
            w->copy_left -= n;
            if (w->copy_left) {
                rc = n == room ? DC_WALK_OUTPUT_FULL : DC_WALK_NEED_INPUT;
                break;
            }
            value_done(w);
            continue;
        }
        if (w->refs_left) { /* the refs of an item's chunks: ids out, nil in their place */
            uint64_t length = 0, skip = 0;
            size_t p = pos + 19;
            int got = 1;
            if (w->ids_at == w->ids_cap || room_items < 1) {
                rc = DC_WALK_OUTPUT_FULL;
                break;
            }
            if (len - pos >= 3 && ((buf[pos] != 0x92 && buf[pos] != 0x93) || buf[pos + 1] != 0xc4
                                   || buf[pos + 2] != 16))
                return DC_WALK_FAIL(w);
            if (len - pos < 19)
                got = 0;
            if (got > 0)
                got = next_uint(buf, len, &p, &length);
            if (got > 0 && buf[pos] == 0x93)
                got = next_uint(buf, len, &p, &skip);
            if (got < 0)
                return DC_WALK_FAIL(w);
            if (got == 0) { /* cut off by the end of the piece */
                rc = DC_WALK_NEED_INPUT;
                break;
            }
            if (length > DC_MAX_REF_BYTES || skip > DC_MAX_REF_BYTES || w->item_total + length < w->item_total)
                return DC_WALK_FAIL(w);
            memcpy(w->ids + 16 * w->ids_at, buf + pos + 3, 16);
            if (w->ends)
                w->ends[w->ids_at] = (uint32_t)(skip + length);
            w->ids_at++;
            w->item_refs++;
            w->item_total += length;
            pos = p;
            if (--w->refs_left == 0) {
                uint8_t nil = 0xc0;
                emit(w, &nil, 1);
                value_done(w);
            }
            continue;
        }
        if (w->done) {
            if (pos < len)
                return DC_WALK_FAIL(w); /* bytes after the manifest */
            rc = DC_WALK_DONE;
            break;
        }
        size_t hsize;
        uint64_t plen, nested;
        int got = header(buf + pos, len - pos, &hsize, &plen, &nested);
        if (got < 0)
            return DC_WALK_FAIL(w);
        if (got == 0) {
            rc = DC_WALK_NEED_INPUT;
            break;
        }
        if ((w->in_items ? room_items : room_top) < hsize + 1) {
            rc = DC_WALK_OUTPUT_FULL;
            break;
        }
        const uint8_t *v = buf + pos;
        int is_map = (v[0] & 0xf0) == 0x80 || v[0] == 0xde || v[0] == 0xdf;
        int is_array = (v[0] & 0xf0) == 0x90 || v[0] == 0xdc || v[0] == 0xdd;
        int is_str = (v[0] & 0xe0) == 0xa0 || v[0] == 0xd9 || v[0] == 0xda || v[0] == 0xdb;
        uint8_t parent = w->depth ? w->kind[w->depth - 1] : DC_ANY;
        int at_key = w->depth && (parent == DC_TOP || parent == DC_ITEM) && (w->left[w->depth - 1] % 2 == 0);
        if (w->depth == 0 && !is_map)
            return DC_WALK_FAIL(w); /* a manifest is a map */
        if (at_key && is_str && plen <= 6) {
            if (len - pos < hsize + plen) { /* a short key: compared whole */
                rc = DC_WALK_NEED_INPUT;
                break;
            }
            const char *want = parent == DC_TOP ? "items" : "chunks";
            if (is_key(v, hsize, plen, want)) {
                if (parent == DC_TOP ? w->seen_items : w->item_chunks)
                    return DC_WALK_FAIL(w); /* the key twice */
                w->next = parent == DC_TOP ? DC_NEXT_ITEMS : DC_NEXT_CHUNKS;
            }
        }
        if (w->depth && !at_key && w->next != DC_NEXT_PLAIN) {
            int next = w->next;
            w->next = DC_NEXT_PLAIN;
            if (!is_array)
                return DC_WALK_FAIL(w);
            pos += hsize;
            if (next == DC_NEXT_ITEMS) {
                uint8_t empty = 0x90;
                emit(w, &empty, 1);
                w->seen_items = 1;
                if (push(w, DC_ITEMS, nested) < 0)
                    return DC_WALK_FAIL(w);
            } else {
                w->item_chunks = 1;
                w->refs_left = nested;
                if (nested == 0) {
                    uint8_t nil = 0xc0;
                    emit(w, &nil, 1);
                    value_done(w);
                }
            }
            continue;
        }
        if (parent == DC_ITEMS && !is_map)
            return DC_WALK_FAIL(w); /* an item is a map */
        emit(w, v, hsize);
        pos += hsize;
        if (is_map || is_array) {
            uint8_t kind = w->depth == 0 ? DC_TOP : parent == DC_ITEMS ? DC_ITEM : DC_ANY;
            if (push(w, kind, nested) < 0)
                return DC_WALK_FAIL(w);
        } else if (plen) {
            w->copy_left = plen;
        } else {
            value_done(w);
        }
    }
    *consumed = pos;
    return w->failed ? DC_WALK_FAILED : rc;
}
