/*
 * deltackpt native kernels: byte-plane shuffle (optionally fused with an XOR
 * or zigzag-difference delta) and FastCDC content-defined chunking.
 *
 * Pure C99, no Python dependency. All exported symbols are prefixed dc_.
 * Buffers passed to one call must not overlap (the Python layer guarantees
 * this by routing aliased outputs through a temporary).
 */
#ifndef DC_KERNELS_H
#define DC_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Returns 1 if elem_size is one of 1, 2, 4, 8; 0 otherwise. */
int dc_valid_elem_size(size_t elem_size);

/*
 * Byte-plane layout: with n = len / k full elements,
 *   dst[j*n + i] = src[i*k + j]   for j < k, i < n,
 * and the trailing len % k bytes are copied unchanged to the end.
 * elem_size must satisfy dc_valid_elem_size (otherwise nothing is written).
 */
void dc_shuffle(const uint8_t *src, uint8_t *dst, size_t len, size_t elem_size);
void dc_unshuffle(const uint8_t *src, uint8_t *dst, size_t len, size_t elem_size);

/* dc_unshuffle with plane j (len / k bytes) at planes[j] and the trailing len % k bytes at planes[k]. */
void dc_unshuffle_planes(const uint8_t *const *planes, uint8_t *dst, size_t len, size_t elem_size);

/* The xxh3-128 digest of data in its canonical (big-endian) form: a chunk's id. */
void dc_xxh3_128(const void *data, size_t len, uint8_t digest[16]);

/* The xxh3-64 hash of data (seed 0): an entry header's digest. */
uint64_t dc_xxh3_64(const void *data, size_t len);

/*
 * For each of n chunks: dc_unshuffle_planes of its k + 1 segments (segs + j * (k + 1)) into dsts[j] (lens[j]
 * bytes), then ok[j] = 1 when dc_xxh3_128 of those bytes equals ids + 16 * j, else 0. Returns how many passed.
 */
size_t dc_unshuffle_check(const uint8_t *const *segs, uint8_t *const *dsts, const size_t *lens, size_t n,
                          size_t elem_size, const uint8_t *ids, uint8_t *ok);

/* dst = shuffle(a XOR b); a, b and dst all hold len bytes. */
void dc_xor_shuffle(const uint8_t *a, const uint8_t *b, uint8_t *dst,
                    size_t len, size_t elem_size);

/* dst = unshuffle(planes) XOR base; all hold len bytes. */
void dc_unshuffle_xor(const uint8_t *planes, const uint8_t *base, uint8_t *dst,
                      size_t len, size_t elem_size);

/*
 * dst = shuffle(zigzag(a - b)): each full element of a and b read as a
 * little-endian elem_size-byte integer, d = a - b modulo 2^(8 * elem_size),
 * zigzag(d) = (d << 1) ^ (d >> (8 * elem_size - 1)) (arithmetic shift), so
 * d = 0, -1, 1, -2, ... become 0, 1, 2, 3, ...; the trailing len % elem_size
 * bytes are a XOR b. a, b and dst all hold len bytes.
 */
void dc_zigzag_shuffle(const uint8_t *a, const uint8_t *b, uint8_t *dst,
                       size_t len, size_t elem_size);

/* Inverse of dc_zigzag_shuffle given the base: dst = base + unzigzag(unshuffle(planes)). */
void dc_unshuffle_zigzag(const uint8_t *planes, const uint8_t *base, uint8_t *dst,
                         size_t len, size_t elem_size);

/* Builds the SIMD tables of the two functions below; call once before them
 * (without it they run their scalar code). */
void dc_sparse_init(void);

/*
 * Zero-sparse form of a byte plane: bitmap (ceil(n / 8) bytes, bit i LSB
 * first set where src[i] != 0) and the nonzero bytes in order. vals must
 * hold n bytes; returns the number of nonzero bytes written.
 */
size_t dc_sparse_split(const uint8_t *src, size_t n, uint8_t *bitmap, uint8_t *vals);

/*
 * Inverse of dc_sparse_split into dst (n bytes). Returns 0, or -1 when the
 * bitmap does not name exactly nvals positions, sets a bit past n, or a
 * stored value is zero (dst contents are then unspecified).
 */
int dc_sparse_merge(const uint8_t *bitmap, const uint8_t *vals, size_t nvals, uint8_t *dst, size_t n);

/*
 * Apply a delta whose k byte planes are all zero-sparse to the n full elements at dst, in place, touching only
 * the elements some plane names: d = the element's k plane bytes (little-endian), and the element becomes
 * dst XOR d (zig 0: the delta codec) or dst + unzigzag(d) modulo 2^(8k) (zig 1: the zdelta codec). Plane j's
 * bitmap is at bitmaps + j * ceil(n / 8), its counts[j] values at vals + j * n. Returns 0, or -1 as
 * dc_sparse_merge for any plane (dst then partly updated). k must satisfy dc_valid_elem_size.
 */
int dc_sparse_apply(const uint8_t *bitmaps, const uint8_t *vals, const uint64_t *counts, uint8_t *dst,
                    size_t n, size_t k, int zig);

/*
 * Statistics of a byte plane from its histogram, for the choice of how to store it: sets *nonzero to the
 * number of nonzero bytes and returns the number of ordered pairs of distinct positions holding equal bytes,
 * sum over byte values b of count(b) * (count(b) - 1) (divided by n * (n - 1): an unbiased estimate of the
 * collision probability sum p(b)^2, whose -log2 is the Renyi entropy, a lower bound of the Shannon entropy).
 * Planes are at most a chunk (< 2^32 bytes), so the sum fits.
 */
uint64_t dc_plane_stats(const uint8_t *src, size_t n, size_t *nonzero);

/* The 256-entry gear table (splitmix64 from state 0x64656C7461636B70). */
const uint64_t *dc_gear_table(void);

/*
 * Validate FastCDC parameters: 64 <= min <= avg <= max < 2^62 and avg a
 * power of two. Returns 0 if valid, -1 otherwise.
 */
int dc_fastcdc_check_params(uint64_t min_size, uint64_t avg_size, uint64_t max_size);

/* Capacity of the cuts array sufficient for any input: len / min + 2. */
size_t dc_fastcdc_max_cuts(size_t len, size_t min_size);

/*
 * FastCDC (gear hash, normalized chunking level 2). Writes the chunk END
 * offsets (ascending, last == len) into cuts and returns their count.
 * Returns (size_t)-1 if the parameters are invalid or cap is too small.
 * len == 0 yields 0 cuts.
 */
size_t dc_fastcdc_cuts(const uint8_t *data, size_t len, size_t min_size,
                       size_t avg_size, size_t max_size, int64_t *cuts,
                       size_t cap);

/* Chunk refs (refs.c): the ids of a msgpack array of refs into ids (room for cap), each ref's end (skip +
 * length, the chunk bytes it needs) into ends (room for cap; NULL: none) and the sum of their lengths; the
 * count, or -1 where the refs are not in the canonical form (the caller decodes those the general way). */
int64_t dc_chunk_refs(const uint8_t *buf, size_t len, uint8_t *ids, uint32_t *ends, size_t cap, uint64_t *total);

/*
 * A resumable walk over a manifest's msgpack body fed piece by piece (refs.c: dc_walk). The caller zeroes
 * the struct, points the four outputs (and ends, or NULL) at buffers (with their capacities) and calls
 * dc_walk with each piece; the walker consumes whole values only (the caller keeps the unconsumed tail and
 * puts it before the next piece) and returns when the piece is used up (DC_WALK_NEED_INPUT), an output is
 * full (empty or grow it, fix the *_at counts, call again with the rest), the manifest ended (DC_WALK_DONE),
 * or what it reads is not in the canonical form (DC_WALK_FAILED: read the manifest the general way).
 * Outputs: top, the top-level map
 * with the items array empty; items, the items one after another with their chunk refs replaced by nil
 * (items_end: where the last whole one ends); ids, the refs' 16-byte ids; ends (NULL: not wanted), beside
 * each id the ref's end (skip + length: the chunk bytes it needs; <= 2^31); recs, per whole item (number of
 * refs, sum of their lengths).
 */
#define DC_WALK_DEPTH 64
enum { DC_WALK_FAILED = -1, DC_WALK_NEED_INPUT = 0, DC_WALK_OUTPUT_FULL = 1, DC_WALK_DONE = 2 };
typedef struct {
    uint8_t *top, *items, *ids;
    uint32_t *ends;
    uint64_t *recs;
    size_t top_cap, top_at, items_cap, items_at, items_end, ids_cap, ids_at, recs_cap, recs_at;
    /* private */
    uint64_t left[DC_WALK_DEPTH];
    uint8_t kind[DC_WALK_DEPTH];
    uint32_t depth;
    uint64_t copy_left, refs_left, item_refs, item_total;
    uint8_t next, in_items, seen_items, item_chunks, done, failed;
} dc_walker;
int dc_walk(dc_walker *w, const uint8_t *buf, size_t len, size_t *consumed);

#ifdef __cplusplus
}
#endif

#endif /* DC_KERNELS_H */
