/*
 * CPython binding for the deltackpt native kernels (module deltackpt._native).
 *
 * Low-level entry points; deltackpt/kernels/ is the public API and does
 * the argument normalisation (dtype views, output allocation, aliasing).
 * Every function takes buffer-protocol objects; outputs are caller-provided
 * writable C-contiguous buffers. The GIL is released for inputs >= 64 KiB.
 * Outputs must not overlap inputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <sched.h>
#include <time.h>

#include "dc_kernels.h"

#define DC_GIL_THRESHOLD ((Py_ssize_t)64 * 1024)
#define SPARSE_DAMAGED "sparse plane is damaged: its bitmap does not match its values"

/* The GIL, released for work on at least DC_GIL_THRESHOLD bytes (NULL: kept), and taken back. */
static PyThreadState *release_if(Py_ssize_t nbytes)
{
    return nbytes >= DC_GIL_THRESHOLD ? PyEval_SaveThread() : NULL;
}

static void reacquire(PyThreadState *ts)
{
    if (ts != NULL)
        PyEval_RestoreThread(ts);
}

#if defined(__SSE2__)
#define DC_SIMD_NAME "sse2"
#else
#define DC_SIMD_NAME "scalar"
#endif

enum { OP_SHUFFLE, OP_UNSHUFFLE, OP_XOR_SHUFFLE, OP_UNSHUFFLE_XOR, OP_ZIGZAG_SHUFFLE, OP_UNSHUFFLE_ZIGZAG };

static int get_in(PyObject *obj, Py_buffer *view, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a C-contiguous buffer-protocol object", name);
        return -1;
    }
    return 0;
}

static int get_out(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "out must be a writable C-contiguous buffer");
        return -1;
    }
    return 0;
}

/* Acquire three buffers (input unless writable[i]); on failure release what was taken and return -1. */
static int get_three(PyObject *const objs[3], Py_buffer views[3], const int writable[3],
                     const char *const names[3])
{
    for (int i = 0; i < 3; i++) {
        int rc = writable[i] ? get_out(objs[i], &views[i]) : get_in(objs[i], &views[i], names[i]);
        if (rc < 0) {
            while (i-- > 0)
                PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    return 0;
}

static void release_three(Py_buffer views[3])
{
    for (int i = 2; i >= 0; i--)
        PyBuffer_Release(&views[i]);
}

static PyObject *run_plane_op(PyObject *args, int op, const char *fmt)
{
    PyObject *a_obj = NULL, *b_obj = NULL, *out_obj = NULL;
    Py_ssize_t k;
    Py_buffer a, b, out;
    int two = op != OP_SHUFFLE && op != OP_UNSHUFFLE;
    int encodes = op == OP_XOR_SHUFFLE || op == OP_ZIGZAG_SHUFFLE; /* inputs (a, b), else (planes, base) */
    int have_b = 0;

    if (two) {
        if (!PyArg_ParseTuple(args, fmt, &a_obj, &b_obj, &k, &out_obj))
            return NULL;
    } else {
        if (!PyArg_ParseTuple(args, fmt, &a_obj, &k, &out_obj))
            return NULL;
    }
    if (k < 0 || !dc_valid_elem_size((size_t)k)) {
        PyErr_Format(PyExc_ValueError,
                     "elem_size must be 1, 2, 4 or 8, got %zd", k);
        return NULL;
    }
    if (get_in(a_obj, &a, two ? (encodes ? "a" : "planes") : "src") < 0)
        return NULL;
    if (two) {
        if (get_in(b_obj, &b, encodes ? "b" : "base") < 0)
            goto fail_a;
        have_b = 1;
        if (b.len != a.len) {
            PyErr_Format(PyExc_ValueError,
                         "inputs must have equal byte length (%zd != %zd)",
                         a.len, b.len);
            goto fail_b;
        }
    }
    if (get_out(out_obj, &out) < 0)
        goto fail_b;
    if (out.len != a.len) {
        PyErr_Format(PyExc_ValueError,
                     "out has %zd bytes, expected %zd", out.len, a.len);
        PyBuffer_Release(&out);
        goto fail_b;
    }

    {
        const uint8_t *pa = (const uint8_t *)a.buf;
        const uint8_t *pb = have_b ? (const uint8_t *)b.buf : NULL;
        uint8_t *po = (uint8_t *)out.buf;
        size_t len = (size_t)a.len;
        PyThreadState *ts = release_if(a.len);
        switch (op) {
        case OP_SHUFFLE: dc_shuffle(pa, po, len, (size_t)k); break;
        case OP_UNSHUFFLE: dc_unshuffle(pa, po, len, (size_t)k); break;
        case OP_XOR_SHUFFLE: dc_xor_shuffle(pa, pb, po, len, (size_t)k); break;
        case OP_ZIGZAG_SHUFFLE: dc_zigzag_shuffle(pa, pb, po, len, (size_t)k); break;
        case OP_UNSHUFFLE_ZIGZAG: dc_unshuffle_zigzag(pa, pb, po, len, (size_t)k); break;
        default: dc_unshuffle_xor(pa, pb, po, len, (size_t)k); break;
        }
        reacquire(ts);
    }

    PyBuffer_Release(&out);
    if (have_b)
        PyBuffer_Release(&b);
    PyBuffer_Release(&a);
    Py_RETURN_NONE;

fail_b:
    if (have_b)
        PyBuffer_Release(&b);
fail_a:
    PyBuffer_Release(&a);
    return NULL;
}

PyDoc_STRVAR(shuffle_doc,
"shuffle(src, elem_size, out) -> None\n\n"
"Write the byte planes of src into out (same byte length, no overlap).");
static PyObject *py_shuffle(PyObject *self, PyObject *args)
{
    (void)self;
    return run_plane_op(args, OP_SHUFFLE, "OnO:shuffle");
}

PyDoc_STRVAR(unshuffle_doc,
"unshuffle(src, elem_size, out) -> None\n\n"
"Inverse of shuffle.");
static PyObject *py_unshuffle(PyObject *self, PyObject *args)
{
    (void)self;
    return run_plane_op(args, OP_UNSHUFFLE, "OnO:unshuffle");
}

PyDoc_STRVAR(xor_shuffle_doc,
"xor_shuffle(a, b, elem_size, out) -> None\n\n"
"out = shuffle(a XOR b).");
static PyObject *py_xor_shuffle(PyObject *self, PyObject *args)
{
    (void)self;
    return run_plane_op(args, OP_XOR_SHUFFLE, "OOnO:xor_shuffle");
}

PyDoc_STRVAR(unshuffle_xor_doc,
"unshuffle_xor(planes, base, elem_size, out) -> None\n\n"
"out = unshuffle(planes) XOR base.");
static PyObject *py_unshuffle_xor(PyObject *self, PyObject *args)
{
    (void)self;
    return run_plane_op(args, OP_UNSHUFFLE_XOR, "OOnO:unshuffle_xor");
}

PyDoc_STRVAR(zigzag_shuffle_doc,
"zigzag_shuffle(a, b, elem_size, out) -> None\n\n"
"out = shuffle(zigzag(a - b)) over little-endian elem_size-byte integers\n"
"(trailing partial element: a XOR b).");
static PyObject *py_zigzag_shuffle(PyObject *self, PyObject *args)
{
    (void)self;
    return run_plane_op(args, OP_ZIGZAG_SHUFFLE, "OOnO:zigzag_shuffle");
}

PyDoc_STRVAR(unshuffle_zigzag_doc,
"unshuffle_zigzag(planes, base, elem_size, out) -> None\n\n"
"out = base + unzigzag(unshuffle(planes)): the inverse of zigzag_shuffle.");
static PyObject *py_unshuffle_zigzag(PyObject *self, PyObject *args)
{
    (void)self;
    return run_plane_op(args, OP_UNSHUFFLE_ZIGZAG, "OOnO:unshuffle_zigzag");
}

PyDoc_STRVAR(fastcdc_cuts_doc,
"fastcdc_cuts(data, min_size, avg_size, max_size, cuts) -> int\n\n"
"Write FastCDC chunk end offsets into the writable int64 buffer cuts\n"
"(at least len(data) // min_size + 2 entries) and return their count.");
static PyObject *py_fastcdc_cuts(PyObject *self, PyObject *args)
{
    PyObject *data_obj, *cuts_obj;
    Py_ssize_t mn, avg, mx; /* "n": an int out of range is an OverflowError ("K" wrapped it silently) */
    Py_buffer data, cuts;
    size_t need, count;

    (void)self;
    if (!PyArg_ParseTuple(args, "OnnnO:fastcdc_cuts", &data_obj, &mn, &avg, &mx,
                          &cuts_obj))
        return NULL;
    if (mn < 0 || avg < 0 || mx < 0 || dc_fastcdc_check_params((uint64_t)mn, (uint64_t)avg, (uint64_t)mx) != 0) {
        PyErr_SetString(PyExc_ValueError,
                        "invalid FastCDC parameters: need 64 <= min_size <= "
                        "avg_size <= max_size < 2**62 and avg_size a power of two");
        return NULL;
    }
    if (get_in(data_obj, &data, "data") < 0)
        return NULL;
    if (PyObject_GetBuffer(cuts_obj, &cuts, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError,
                        "cuts must be a writable C-contiguous int64 buffer");
        return NULL;
    }
    need = dc_fastcdc_max_cuts((size_t)data.len, (size_t)mn);
    if ((size_t)cuts.len / sizeof(int64_t) < need) {
        PyErr_Format(PyExc_ValueError,
                     "cuts buffer too small: need %zu int64 entries", need);
        PyBuffer_Release(&cuts);
        PyBuffer_Release(&data);
        return NULL;
    }
    {
        PyThreadState *ts = release_if(data.len);
        /* cuts.buf: any alignment (dc_fastcdc_cuts stores through memcpy) */
        count = dc_fastcdc_cuts((const uint8_t *)data.buf, (size_t)data.len,
                                (size_t)mn, (size_t)avg, (size_t)mx,
                                (int64_t *)cuts.buf,
                                (size_t)cuts.len / sizeof(int64_t));
        reacquire(ts);
    }
    PyBuffer_Release(&cuts);
    PyBuffer_Release(&data);
    if (count == (size_t)-1) {
        PyErr_SetString(PyExc_ValueError, "fastcdc_cuts failed (invalid arguments)");
        return NULL;
    }
    return PyLong_FromSize_t(count);
}

PyDoc_STRVAR(sparse_split_doc,
"sparse_split(src, bitmap, vals) -> int\n\n"
"Write the zero-sparse form of src: bitmap ((len + 7) // 8 bytes, bit i set\n"
"where src[i] != 0, LSB first) and the nonzero bytes into vals (len bytes of\n"
"room). Returns the number of nonzero bytes.");
static PyObject *py_sparse_split(PyObject *self, PyObject *args)
{
    static const int writable[3] = {0, 1, 1};
    static const char *const names[3] = {"src", "bitmap", "vals"};
    PyObject *objs[3];
    Py_buffer v[3]; /* src, bitmap, vals */
    size_t nnz = 0;

    (void)self;
    if (!PyArg_ParseTuple(args, "OOO:sparse_split", &objs[0], &objs[1], &objs[2]))
        return NULL;
    if (get_three(objs, v, writable, names) < 0)
        return NULL;
    if (v[1].len != (v[0].len + 7) / 8 || v[2].len < v[0].len) {
        PyErr_Format(PyExc_ValueError,
                     "bitmap must have %zd bytes and vals at least %zd (got %zd and %zd)",
                     (v[0].len + 7) / 8, v[0].len, v[1].len, v[2].len);
    } else {
        PyThreadState *ts = release_if(v[0].len);
        nnz = dc_sparse_split((const uint8_t *)v[0].buf, (size_t)v[0].len, (uint8_t *)v[1].buf,
                              (uint8_t *)v[2].buf);
        reacquire(ts);
    }
    release_three(v);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSize_t(nnz);
}

PyDoc_STRVAR(plane_stats_doc,
"plane_stats(src) -> (nonzero, pairs)\n\n"
"The number of nonzero bytes of src, and the number of ordered pairs of distinct positions of\n"
"src holding equal bytes: the sum over byte values b of count(b) * (count(b) - 1).");
static PyObject *py_plane_stats(PyObject *self, PyObject *arg)
{
    Py_buffer v;
    size_t nonzero;
    uint64_t pairs;
    PyThreadState *ts;

    (void)self;
    if (get_in(arg, &v, "src") < 0)
        return NULL;
    ts = release_if(v.len);
    pairs = dc_plane_stats((const uint8_t *)v.buf, (size_t)v.len, &nonzero);
    reacquire(ts);
    PyBuffer_Release(&v);
    return Py_BuildValue("(nK)", (Py_ssize_t)nonzero, (unsigned long long)pairs);
}

PyDoc_STRVAR(sparse_merge_doc,
"sparse_merge(bitmap, vals, out) -> None\n\n"
"Inverse of sparse_split into out; ValueError when bitmap and vals disagree.");
static PyObject *py_sparse_merge(PyObject *self, PyObject *args)
{
    static const int writable[3] = {0, 0, 1};
    static const char *const names[3] = {"bitmap", "vals", "out"};
    PyObject *objs[3];
    Py_buffer v[3]; /* bitmap, vals, out */

    (void)self;
    if (!PyArg_ParseTuple(args, "OOO:sparse_merge", &objs[0], &objs[1], &objs[2]))
        return NULL;
    if (get_three(objs, v, writable, names) < 0)
        return NULL;
    if (v[0].len != (v[2].len + 7) / 8 || v[1].len > v[2].len) {
        PyErr_Format(PyExc_ValueError,
                     "bitmap has %zd bytes and vals %zd for %zd output bytes",
                     v[0].len, v[1].len, v[2].len);
    } else {
        int rc;
        PyThreadState *ts = release_if(v[2].len);
        rc = dc_sparse_merge((const uint8_t *)v[0].buf, (const uint8_t *)v[1].buf, (size_t)v[1].len,
                             (uint8_t *)v[2].buf, (size_t)v[2].len);
        reacquire(ts);
        if (rc != 0)
            PyErr_SetString(PyExc_ValueError, SPARSE_DAMAGED);
    }
    release_three(v);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sparse_apply_doc,
"sparse_apply(bitmaps, vals, counts, out, elem_size, zigzag) -> None\n\n"
"Apply an all-zero-sparse delta of elem_size planes to out's full elements in place (XOR, or the\n"
"zigzag difference when zigzag); ValueError when a plane's bitmap and values disagree.");
static PyObject *py_sparse_apply(PyObject *self, PyObject *args)
{
    static const int writable[3] = {0, 0, 1};
    static const char *const names[3] = {"bitmaps", "vals", "out"};
    PyObject *objs[3], *counts_obj;
    Py_buffer v[3], c; /* bitmaps, vals, out; counts */
    Py_ssize_t k;
    int zig;

    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOnp:sparse_apply", &objs[0], &objs[1], &counts_obj, &objs[2], &k, &zig))
        return NULL;
    if (k < 0 || !dc_valid_elem_size((size_t)k)) {
        PyErr_Format(PyExc_ValueError, "elem_size must be 1, 2, 4 or 8, got %zd", k);
        return NULL;
    }
    if (get_in(counts_obj, &c, "counts") < 0)
        return NULL;
    if (get_three(objs, v, writable, names) < 0) {
        PyBuffer_Release(&c);
        return NULL;
    }
    {
        size_t n = (size_t)v[2].len / (size_t)k;
        if ((size_t)v[2].len != n * (size_t)k || (size_t)v[0].len != (size_t)k * ((n + 7) / 8)
            || (size_t)v[1].len != (size_t)k * n || (size_t)c.len != (size_t)k * sizeof(uint64_t)) {
            PyErr_Format(PyExc_ValueError,
                         "bitmaps %zd, vals %zd, counts %zd bytes do not fit %zd bytes of %zd-byte elements",
                         v[0].len, v[1].len, c.len, v[2].len, k);
        } else {
            uint64_t counts[8];
            PyThreadState *ts;
            int rc;
            memcpy(counts, c.buf, (size_t)k * sizeof(uint64_t)); /* any alignment */
            ts = release_if(v[2].len);
            rc = dc_sparse_apply((const uint8_t *)v[0].buf, (const uint8_t *)v[1].buf, counts,
                                 (uint8_t *)v[2].buf, n, (size_t)k, zig);
            reacquire(ts);
            if (rc != 0)
                PyErr_SetString(PyExc_ValueError, SPARSE_DAMAGED);
        }
    }
    release_three(v);
    PyBuffer_Release(&c);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(gear_table_doc,
"gear_table() -> bytes\n\n"
"The 256 uint64 gear values as 2048 native-endian bytes.");
static PyObject *py_gear_table(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBytes_FromStringAndSize((const char *)dc_gear_table(),
                                     256 * (Py_ssize_t)sizeof(uint64_t));
}

PyDoc_STRVAR(chunk_refs_doc,
"chunk_refs(refs, out, offset, ends=None) -> (count, total length) or None\n\n"
"The ids of a msgpack array of chunk refs in deltackpt's canonical form, written to the writable buffer\n"
"out from byte offset on (16 bytes each), and the sum of their lengths; None where the refs are in\n"
"another form or do not fit in out (decode those the general way). ends: a writable uint32 buffer with an\n"
"entry per 16 bytes of out, receiving beside each id its ref's end (skip + length).");
static PyObject *py_chunk_refs(PyObject *self, PyObject *args)
{
    PyObject *refs_obj, *out_obj, *ends_obj = Py_None;
    Py_ssize_t offset;
    Py_buffer refs, out, ends;
    int64_t n = -1;
    uint64_t total = 0;
    int has_ends = 0;

    (void)self;
    if (!PyArg_ParseTuple(args, "OOn|O:chunk_refs", &refs_obj, &out_obj, &offset, &ends_obj))
        return NULL;
    if (get_in(refs_obj, &refs, "refs") < 0)
        return NULL;
    if (get_out(out_obj, &out) < 0) {
        PyBuffer_Release(&refs);
        return NULL;
    }
    if (ends_obj != Py_None) {
        if (get_out(ends_obj, &ends) < 0) {
            PyBuffer_Release(&refs);
            PyBuffer_Release(&out);
            return NULL;
        }
        has_ends = 1;
        if ((size_t)ends.len / sizeof(uint32_t) < (size_t)out.len / 16 || (uintptr_t)ends.buf % 4) {
            PyBuffer_Release(&refs);
            PyBuffer_Release(&out);
            PyBuffer_Release(&ends);
            PyErr_SetString(PyExc_ValueError, "chunk_refs: ends must hold a 4-byte aligned uint32 per id of out");
            return NULL;
        }
    }
    if (offset >= 0 && (!has_ends || offset % 16 == 0) && offset <= out.len)
        n = dc_chunk_refs((const uint8_t *)refs.buf, (size_t)refs.len, (uint8_t *)out.buf + offset,
                          has_ends ? (uint32_t *)ends.buf + offset / 16 : NULL, (size_t)(out.len - offset) / 16,
                          &total);
    PyBuffer_Release(&refs);
    PyBuffer_Release(&out);
    if (has_ends)
        PyBuffer_Release(&ends);
    if (n < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("LK", (long long)n, (unsigned long long)total);
}

PyDoc_STRVAR(walk_refs_doc,
"walk_refs(state, piece, top, items, ids, recs, at, ends=None) -> (status, consumed)\n\n"
"One step of a resumable walk over a manifest's msgpack body (dc_walk in dc_kernels.h). state: a\n"
"zeroed writable buffer of WALKER_BYTES kept between calls; top, items: writable byte buffers; ids:\n"
"writable, 16 bytes an id; recs: writable uint64, two a record; at: writable int64 [top, items,\n"
"items_end, ids, recs], the fill of each output, read and updated. status: -1 not canonical (read the\n"
"manifest the general way), 0 piece used up, 1 an output full, 2 the manifest ended. ends: writable\n"
"uint32, an entry per id of ids: each ref's end (skip + length) beside its id.");
static PyObject *py_walk_refs(PyObject *self, PyObject *args)
{
    PyObject *objs[8] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, Py_None};
    Py_buffer v[8];
    int taken = 0, rc, num = 7;
    size_t consumed = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOO|O:walk_refs", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5], &objs[6], &objs[7]))
        return NULL;
    if (objs[7] != Py_None)
        num = 8;
    for (; taken < num; taken++) {
        if ((taken == 1 ? get_in(objs[taken], &v[taken], "piece") : get_out(objs[taken], &v[taken])) < 0)
            goto fail;
    }
    if (v[0].len != (Py_ssize_t)sizeof(dc_walker) || v[6].len != 5 * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "walk_refs: state must hold WALKER_BYTES and at 5 int64");
        goto fail;
    }
    if ((uintptr_t)v[0].buf % 8 || (uintptr_t)v[6].buf % 8) {
        PyErr_SetString(PyExc_ValueError, "walk_refs: state and fill counts must be 8-byte aligned");
        goto fail;
    }
    /* The walk runs on a copy: its output pointers never live in the caller's buffer, which may overlap an
     * output (or be changed by another thread while the GIL is released). */
    dc_walker local, *w = &local;
    memcpy(&local, v[0].buf, sizeof local);
    int64_t *at = (int64_t *)v[6].buf;
    if (w->depth > DC_WALK_DEPTH) { /* the caller's buffer: never index the walker's stacks past their end */
        PyErr_SetString(PyExc_ValueError, "walk_refs: state is not a walker's (depth out of range)");
        goto fail;
    }
    w->top = (uint8_t *)v[2].buf;
    w->top_cap = (size_t)v[2].len;
    w->items = (uint8_t *)v[3].buf;
    w->items_cap = (size_t)v[3].len;
    w->ids = (uint8_t *)v[4].buf;
    w->ids_cap = (size_t)v[4].len / 16;
    w->recs = (uint64_t *)v[5].buf;
    w->recs_cap = (size_t)v[5].len / (2 * sizeof(uint64_t));
    w->ends = NULL;
    if (num == 8) {
        if ((size_t)v[7].len / sizeof(uint32_t) < w->ids_cap || (uintptr_t)v[7].buf % 4) {
            PyErr_SetString(PyExc_ValueError, "walk_refs: ends must hold a 4-byte aligned uint32 per id of ids");
            goto fail;
        }
        w->ends = (uint32_t *)v[7].buf;
    }
    size_t *fill[5] = {&w->top_at, &w->items_at, &w->items_end, &w->ids_at, &w->recs_at};
    size_t caps[5] = {w->top_cap, w->items_cap, w->items_cap, w->ids_cap, w->recs_cap};
    for (int i = 0; i < 5; i++) {
        if (at[i] < 0 || (size_t)at[i] > caps[i]) {
            PyErr_SetString(PyExc_ValueError, "walk_refs: a fill count past its output");
            goto fail;
        }
        *fill[i] = (size_t)at[i];
    }
    if (v[1].len >= DC_GIL_THRESHOLD) {
        Py_BEGIN_ALLOW_THREADS
        rc = dc_walk(w, (const uint8_t *)v[1].buf, (size_t)v[1].len, &consumed);
        Py_END_ALLOW_THREADS
    } else {
        rc = dc_walk(w, (const uint8_t *)v[1].buf, (size_t)v[1].len, &consumed);
    }
    for (int i = 0; i < 5; i++)
        at[i] = (int64_t)*fill[i];
    w->top = w->items = w->ids = NULL;
    w->recs = NULL;
    w->ends = NULL;
    memcpy(v[0].buf, &local, sizeof local);
    while (taken-- > 0)
        PyBuffer_Release(&v[taken]);
    return Py_BuildValue("in", rc, (Py_ssize_t)consumed);
fail:
    while (taken-- > 0)
        PyBuffer_Release(&v[taken]);
    return NULL;
}

/* A contiguous int64 array of exactly count entries, or -1 with ValueError. */
static int get_i64(PyObject *obj, Py_buffer *view, Py_ssize_t count, const char *name)
{
    if (get_in(obj, view, name) < 0)
        return -1;
    if (view->len != count * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "%s must hold %zd int64 values (%zd bytes), got %zd bytes", name, count,
                     count * (Py_ssize_t)sizeof(int64_t), view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Acquire each buffer of sequence seq (writable or not) into *views (allocated, *count entries). */
static int get_all(PyObject *seq, int writable, Py_buffer **views, Py_ssize_t *count, const char *name)
{
    Py_ssize_t i, n = seq == Py_None ? 0 : PySequence_Size(seq);
    *views = NULL;
    *count = 0;
    if (n < 0)
        return -1;
    *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (*views == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        int rc = item == NULL ? -1 : writable ? get_out(item, &(*views)[i]) : get_in(item, &(*views)[i], name);
        Py_XDECREF(item);
        if (rc < 0)
            break;
        (*count)++;
    }
    if (i < n) {
        while ((*count)-- > 0)
            PyBuffer_Release(&(*views)[*count]);
        PyMem_Free(*views);
        *views = NULL;
        *count = 0;
        return -1;
    }
    return 0;
}

static void release_all(Py_buffer *views, Py_ssize_t count)
{
    while (count-- > 0)
        PyBuffer_Release(&views[count]);
    PyMem_Free(views);
}

PyDoc_STRVAR(unshuffle_check_doc,
"unshuffle_check(buf, frames, elem_size, src, outs, ids, ok) -> int\n\n"
"For each chunk j of len(outs): its elem_size planes of len(outs[j]) // elem_size bytes and its tail of the\n"
"rest are segments s = src[j * (elem_size + 1) + s]: buf[src:] where src >= 0, else all of frames[-1 - src];\n"
"they are unshuffled into outs[j] (writable buffers), and ok[j] = 1 where the xxh3-128 digest of outs[j] is\n"
"ids[16 * j:16 * j + 16], else 0. src: an int64 array; frames: a sequence of buffers, or None; ok: len(outs)\n"
"writable bytes. Returns how many passed; ValueError (nothing written) when a segment is out of bounds.");
static PyObject *py_unshuffle_check(PyObject *self, PyObject *args)
{
    PyObject *buf_obj, *frames_obj, *src_obj, *outs_obj, *ids_obj, *ok_obj;
    Py_ssize_t k, n = 0, j, s, nframes = 0;
    Py_buffer buf, src, ids, ok, *frames = NULL, *outs = NULL;
    const uint8_t **segs = NULL;
    uint8_t **dsts = NULL;
    size_t *sizes = NULL, passed = 0, total = 0;
    int have = 0;

    (void)self;
    if (!PyArg_ParseTuple(args, "OOnOOOO:unshuffle_check", &buf_obj, &frames_obj, &k, &src_obj, &outs_obj,
                          &ids_obj, &ok_obj))
        return NULL;
    if (k < 0 || !dc_valid_elem_size((size_t)k)) {
        PyErr_Format(PyExc_ValueError, "elem_size must be 1, 2, 4 or 8, got %zd", k);
        return NULL;
    }
    if (get_all(outs_obj, 1, &outs, &n, "outs") < 0)
        return NULL;
    if (get_out(ok_obj, &ok) < 0)
        goto done;
    have = 1;
    if (ok.len != n) {
        PyErr_Format(PyExc_ValueError, "ok must hold %zd bytes, got %zd", n, ok.len);
        goto done;
    }
    if (get_in(buf_obj, &buf, "buf") < 0)
        goto done;
    have = 2;
    if (get_i64(src_obj, &src, n * (k + 1), "src") < 0)
        goto done;
    have = 3;
    if (get_in(ids_obj, &ids, "ids") < 0)
        goto done;
    have = 4;
    if (ids.len != 16 * n) {
        PyErr_Format(PyExc_ValueError, "ids must hold %zd bytes, got %zd", 16 * n, ids.len);
        goto done;
    }
    if (get_all(frames_obj, 0, &frames, &nframes, "frames") < 0)
        goto done;
    segs = PyMem_Malloc((size_t)(n * (k + 1) + 1) * sizeof(*segs));
    dsts = PyMem_Malloc((size_t)(n + 1) * sizeof(*dsts));
    sizes = PyMem_Malloc((size_t)(n + 1) * sizeof(*sizes));
    if (segs == NULL || dsts == NULL || sizes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (j = 0; j < n; j++) {
        const uint8_t *sj = (const uint8_t *)src.buf + 8 * j * (k + 1);  /* src: any alignment */
        Py_ssize_t len = outs[j].len, per = len / k;
        dsts[j] = (uint8_t *)outs[j].buf;
        sizes[j] = (size_t)len;
        total += (size_t)len;
        for (s = 0; s <= k; s++) {
            int64_t want = s < k ? per : len - per * k, at;
            memcpy(&at, sj + 8 * s, 8);
            if (at >= 0 && at <= buf.len && want <= buf.len - at) {
                segs[j * (k + 1) + s] = (const uint8_t *)buf.buf + at;
            } else if (at < 0 && -1 - at < nframes && frames[-1 - at].len == want) {
                segs[j * (k + 1) + s] = (const uint8_t *)frames[-1 - at].buf;
            } else {
                PyErr_Format(PyExc_ValueError, "chunk %zd: segment %zd is out of bounds", j, s);
                goto done;
            }
        }
    }
    {
        PyThreadState *ts = release_if((Py_ssize_t)total);
        passed = dc_unshuffle_check(segs, dsts, sizes, (size_t)n, (size_t)k, (const uint8_t *)ids.buf,
                                    (uint8_t *)ok.buf);
        reacquire(ts);
    }
done:
    PyMem_Free(sizes);
    PyMem_Free(dsts);
    PyMem_Free(segs);
    if (frames != NULL)
        release_all(frames, nframes);
    if (have >= 4)
        PyBuffer_Release(&ids);
    if (have >= 3)
        PyBuffer_Release(&src);
    if (have >= 2)
        PyBuffer_Release(&buf);
    if (have >= 1)
        PyBuffer_Release(&ok);
    release_all(outs, n);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSize_t(passed);
}

PyDoc_STRVAR(xxh3_64_rows_doc,
"xxh3_64_rows(rows, stride, nbytes, out) -> None\n\n"
"out[i] = xxh3-64 (seed 0) of rows[i * stride:i * stride + nbytes] for each of len(out) // 8 rows\n"
"(out: a writable uint64 array); ValueError when rows is too short.");
static PyObject *py_xxh3_64_rows(PyObject *self, PyObject *args)
{
    PyObject *rows_obj, *out_obj;
    Py_ssize_t stride, nbytes, i, n;
    Py_buffer rows, out;

    (void)self;
    if (!PyArg_ParseTuple(args, "OnnO:xxh3_64_rows", &rows_obj, &stride, &nbytes, &out_obj))
        return NULL;
    if (stride < 0 || nbytes < 0 || nbytes > stride) {
        PyErr_SetString(PyExc_ValueError, "need 0 <= nbytes <= stride");
        return NULL;
    }
    if (get_in(rows_obj, &rows, "rows") < 0)
        return NULL;
    if (get_out(out_obj, &out) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    n = out.len / (Py_ssize_t)sizeof(uint64_t);
    if (out.len % (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "out must hold whole uint64 values");
    } else if (n && (nbytes > rows.len || (stride && n - 1 > (rows.len - nbytes) / stride))) {  /* no overflow */
        PyErr_Format(PyExc_ValueError, "rows has %zd bytes, %zd rows of stride %zd need more", rows.len, n, stride);
    } else {
        for (i = 0; i < n; i++) {
            uint64_t h = dc_xxh3_64((const uint8_t *)rows.buf + i * stride, (size_t)nbytes);
            memcpy((uint8_t *)out.buf + i * sizeof(uint64_t), &h, sizeof(h));
        }
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&rows);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* The first index of set[lo:n] (16-byte keys in memcmp order) whose key is >= key: a galloping search from
 * lo, so sorted keys walk the set forward through nearby memory instead of from its middle each time. */
static size_t gallop16(const uint8_t *set, size_t n, size_t lo, const uint8_t *key)
{
    size_t bound = 1, left, right;

    while (bound <= n - lo && memcmp(set + 16 * (lo + bound - 1), key, 16) < 0)
        bound *= 2;
    left = lo + bound / 2;  /* every key before it is < key */
    right = bound <= n - lo ? lo + bound - 1 : n;  /* its key is >= key, or the end */
    while (left < right) {
        size_t mid = left + (right - left) / 2;
        if (memcmp(set + 16 * mid, key, 16) < 0)
            left = mid + 1;
        else
            right = mid;
    }
    return left;
}

PyDoc_STRVAR(find_sorted_doc,
"find_sorted(ids, keys, out) -> None\n\n"
"out[i] = the index in ids (16-byte ids, sorted unique in memcmp order) of keys[i], -1 where absent;\n"
"keys: 16-byte ids, fastest in sorted order (each search gallops on from the last; a key out of order\n"
"searches from the start); out: a writable int64 array of len(keys) // 16. ValueError when a length is\n"
"not a multiple of 16 or out has the wrong size.");
static PyObject *py_find_sorted(PyObject *self, PyObject *args)
{
    PyObject *ids_obj, *keys_obj, *out_obj;
    Py_buffer ids, keys, out;
    size_t n, m, i, lo = 0;

    (void)self;
    if (!PyArg_ParseTuple(args, "OOO:find_sorted", &ids_obj, &keys_obj, &out_obj))
        return NULL;
    if (get_in(ids_obj, &ids, "ids") < 0)
        return NULL;
    if (get_in(keys_obj, &keys, "keys") < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    if (get_out(out_obj, &out) < 0) {
        PyBuffer_Release(&keys);
        PyBuffer_Release(&ids);
        return NULL;
    }
    n = (size_t)ids.len / 16;
    m = (size_t)keys.len / 16;
    if (ids.len % 16 || keys.len % 16 || (size_t)out.len != m * sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "ids and keys must be 16-byte ids, out an int64 per key");
    } else {
        const uint8_t *set = (const uint8_t *)ids.buf, *key = (const uint8_t *)keys.buf;
        uint8_t *pos = (uint8_t *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (i = 0; i < m; i++, key += 16) {
            int64_t found;
            if (lo > 0 && memcmp(set + 16 * (lo - 1), key, 16) >= 0)
                lo = 0;  /* out of order: search from the start again (a wrong answer never) */
            lo = gallop16(set, n, lo, key);
            found = lo < n && memcmp(set + 16 * lo, key, 16) == 0 ? (int64_t)lo : -1;
            memcpy(pos + 8 * i, &found, 8);  /* out: any alignment */
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&ids);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* The bucket of a 16-byte key: its first `bits` bits, big-endian. */
static inline size_t bucket_of(const uint8_t *key, Py_ssize_t bits)
{
    uint64_t head = 0;
    int k;
    for (k = 0; k < 8; k++)
        head = (head << 8) | key[k];
    return (size_t)(head >> (64 - bits));
}

#define FIND_AHEAD 8

PyDoc_STRVAR(find_bucketed_doc,
"find_bucketed(ids, starts, bits, keys, out) -> None\n\n"
"As find_sorted, keys in any order, each looked for among the ids of its bucket only: b = its first `bits`\n"
"bits (1-32, big-endian), ids[starts[b]:starts[b + 1]] (starts: 2**bits + 1 uint32, as idset.bucket_starts\n"
"makes them; a wrong table gives wrong answers, never a read out of bounds). ValueError on bad lengths.");
static PyObject *py_find_bucketed(PyObject *self, PyObject *args)
{
    PyObject *ids_obj, *starts_obj, *keys_obj, *out_obj;
    Py_buffer ids, starts, keys, out;
    Py_ssize_t bits;
    size_t n, m, i;

    (void)self;
    if (!PyArg_ParseTuple(args, "OOnOO:find_bucketed", &ids_obj, &starts_obj, &bits, &keys_obj, &out_obj))
        return NULL;
    if (bits < 1 || bits > 32) {
        PyErr_SetString(PyExc_ValueError, "bits must be 1-32");
        return NULL;
    }
    if (get_in(ids_obj, &ids, "ids") < 0)
        return NULL;
    if (get_in(starts_obj, &starts, "starts") < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    if (get_in(keys_obj, &keys, "keys") < 0) {
        PyBuffer_Release(&starts);
        PyBuffer_Release(&ids);
        return NULL;
    }
    if (get_out(out_obj, &out) < 0) {
        PyBuffer_Release(&keys);
        PyBuffer_Release(&starts);
        PyBuffer_Release(&ids);
        return NULL;
    }
    n = (size_t)ids.len / 16;
    m = (size_t)keys.len / 16;
    if (ids.len % 16 || keys.len % 16 || (size_t)out.len != m * sizeof(int64_t)
            || (size_t)starts.len != (((size_t)1 << bits) + 1) * sizeof(uint32_t)) {
        PyErr_SetString(PyExc_ValueError,
                        "ids and keys must be 16-byte ids, out an int64 per key, starts 2**bits + 1 uint32");
    } else {
        const uint8_t *set = (const uint8_t *)ids.buf, *key = (const uint8_t *)keys.buf;
        const uint8_t *table = (const uint8_t *)starts.buf, *first = key;
        uint8_t *pos = (uint8_t *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (i = 0; i < m; i++, key += 16) {
            uint32_t lo32, hi32;
            size_t b, left, right;
            /* Keys in any order miss the caches twice each in a large set (its table, then its bucket):
             * fetch the table entry of the key FIND_AHEAD * 2 on and the bucket of the key FIND_AHEAD on
             * (whose table entry came in by now), so the misses of many keys overlap. */
            if (i + 2 * FIND_AHEAD < m)
                __builtin_prefetch(table + 4 * bucket_of(first + 16 * (i + 2 * FIND_AHEAD), bits));
            if (i + FIND_AHEAD < m) {
                uint32_t ahead;
                memcpy(&ahead, table + 4 * bucket_of(first + 16 * (i + FIND_AHEAD), bits), 4);
                if (ahead < n)
                    __builtin_prefetch(set + 16 * (size_t)ahead);
                if ((size_t)ahead + 4 < n)  /* a bucket of ~8 ids spans two cache lines */
                    __builtin_prefetch(set + 16 * ((size_t)ahead + 4));
            }
            b = bucket_of(key, bits);
            memcpy(&lo32, table + 4 * b, 4);
            memcpy(&hi32, table + 4 * (b + 1), 4);
            left = lo32 < n ? lo32 : n;
            right = hi32 < left ? left : (hi32 < n ? hi32 : n);
            while (left < right) {  /* the first id >= key in the bucket */
                size_t mid = left + (right - left) / 2;
                if (memcmp(set + 16 * mid, key, 16) < 0)
                    left = mid + 1;
                else
                    right = mid;
            }
            {
                int64_t found = left < n && memcmp(set + 16 * left, key, 16) == 0 ? (int64_t)left : -1;
                memcpy(pos + 8 * i, &found, 8);  /* out: any alignment */
            }
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&ids);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* In-place sort of 16-byte ids in memcmp order: an MSD radix sort (American flag: each byte's buckets
 * counted, then filled by swaps in place; no second buffer), an insertion sort for small buckets. Ids are
 * hashes, so two byte levels leave buckets of a few ids: O(n), where numpy's comparison sort of V16 is
 * O(n log n) and compares through a generic void path. */
static void insertion16(uint8_t *base, uint32_t *pay, size_t n)
{
    size_t i, j;
    uint8_t key[16];
    uint32_t p = 0;
    for (i = 1; i < n; i++) {
        memcpy(key, base + 16 * i, 16);
        if (pay)
            p = pay[i];
        for (j = i; j > 0 && memcmp(base + 16 * (j - 1), key, 16) > 0; j--) {
            memcpy(base + 16 * j, base + 16 * (j - 1), 16);
            if (pay)
                pay[j] = pay[j - 1];
        }
        memcpy(base + 16 * j, key, 16);
        if (pay)
            pay[j] = p;
    }
}

/* pay: NULL, or a uint32 per id, moved with it. */
static void flag_sort16(uint8_t *base, uint32_t *pay, size_t n, int depth)
{
    size_t count[256] = {0}, start[256], next[256], i;
    int b;
    if (depth >= 16)
        return;  /* every byte equal: repeats */
    if (n <= 32) {
        insertion16(base, pay, n);
        return;
    }
    for (i = 0; i < n; i++)
        count[base[16 * i + depth]]++;
    start[0] = 0;
    for (b = 1; b < 256; b++)
        start[b] = start[b - 1] + count[b - 1];
    memcpy(next, start, sizeof(next));
    for (b = 0; b < 256; b++) {
        size_t end = start[b] + count[b];
        while (next[b] < end) {
            uint8_t *x = base + 16 * next[b];
            int v = x[depth];
            if (v == b) {
                next[b]++;
            } else {  /* to the next free place of its bucket, and what was there here */
                uint8_t tmp[16];
                size_t k = next[v]++;
                uint8_t *y = base + 16 * k;
                memcpy(tmp, x, 16);
                memcpy(x, y, 16);
                memcpy(y, tmp, 16);
                if (pay) {
                    uint32_t t = pay[next[b]];
                    pay[next[b]] = pay[k];
                    pay[k] = t;
                }
            }
        }
    }
    for (b = 0; b < 256; b++)
        if (count[b] > 1)
            flag_sort16(base + 16 * start[b], pay ? pay + start[b] : NULL, count[b], depth + 1);
}

PyDoc_STRVAR(sort_ids_doc,
"sort_ids(ids, pay=None) -> None\n\n"
"Sort the 16-byte ids of the writable buffer ids in place, in memcmp order (numpy's order for V16): a\n"
"radix sort, no second buffer. pay: a writable uint32 buffer of as many entries, each moved with its id\n"
"(the order among repeated ids is unspecified). ValueError when its length is not a multiple of 16.");
static PyObject *py_sort_ids(PyObject *self, PyObject *args)
{
    PyObject *ids_obj, *pay_obj = Py_None;
    Py_buffer ids, pay;
    int has_pay = 0;

    (void)self;
    if (!PyArg_ParseTuple(args, "O|O:sort_ids", &ids_obj, &pay_obj))
        return NULL;
    if (get_out(ids_obj, &ids) < 0)
        return NULL;
    if (pay_obj != Py_None) {
        if (get_out(pay_obj, &pay) < 0) {
            PyBuffer_Release(&ids);
            return NULL;
        }
        has_pay = 1;
    }
    if (ids.len % 16) {
        PyErr_SetString(PyExc_ValueError, "ids must be 16-byte ids");
    } else if (has_pay && (pay.len != ids.len / 4 || (uintptr_t)pay.buf % 4)) {
        PyErr_SetString(PyExc_ValueError, "pay must hold a 4-byte aligned uint32 per id");
    } else {
        Py_BEGIN_ALLOW_THREADS
        flag_sort16((uint8_t *)ids.buf, has_pay ? (uint32_t *)pay.buf : NULL, (size_t)ids.len / 16, 0);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&ids);
    if (has_pay)
        PyBuffer_Release(&pay);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* -- hash_spans / wait_hashed: chunk ids computed by a thread ahead of the writer that needs them --------- */

PyDoc_STRVAR(hash_spans_doc,
"hash_spans(bufs, spans, out, state) -> int\n\n"
"For each span i of spans (an int64 array of (buffer, start, end) triples): out[16 * i:16 * i + 16] = the\n"
"xxh3-128 digest, canonical as xxhash.xxh3_128_digest gives it, of bufs[buffer][start:end]; then state[0] =\n"
"i + 1, stored with release order (wait_hashed reads it). Stops before a span once state[1] is nonzero (a\n"
"cancel), and sets state[2] = 1 as it returns, hashed or not. The GIL is released while it hashes. state: 3\n"
"aligned writable int64; out: 16 bytes per span, overlapping no buffer. Returns the spans hashed; ValueError\n"
"(nothing hashed) when a span is out of its buffer's bounds or an argument has the wrong size.");
static PyObject *py_hash_spans(PyObject *self, PyObject *args)
{
    PyObject *bufs_obj, *spans_obj, *out_obj, *state_obj;
    Py_buffer spans, out, state, *bufs = NULL;
    Py_ssize_t nbufs = 0, n = 0, i, hashed = 0;
    int64_t *st = NULL;
    int have = 0;

    (void)self;
    if (!PyArg_ParseTuple(args, "OOOO:hash_spans", &bufs_obj, &spans_obj, &out_obj, &state_obj))
        return NULL;
    if (get_out(state_obj, &state) < 0)
        return NULL;
    have = 1;
    if (state.len != 3 * (Py_ssize_t)sizeof(int64_t) || (uintptr_t)state.buf % sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "state must be 3 aligned int64 values");
        goto done;
    }
    st = (int64_t *)state.buf;
    if (get_in(spans_obj, &spans, "spans") < 0)
        goto done;
    have = 2;
    if (spans.len % (3 * (Py_ssize_t)sizeof(int64_t))) {
        PyErr_Format(PyExc_ValueError, "spans must hold int64 triples, got %zd bytes", spans.len);
        goto done;
    }
    n = spans.len / (3 * (Py_ssize_t)sizeof(int64_t));
    if (get_out(out_obj, &out) < 0)
        goto done;
    have = 3;
    if (out.len != 16 * n) {
        PyErr_Format(PyExc_ValueError, "out must hold %zd bytes (16 per span), got %zd", 16 * n, out.len);
        goto done;
    }
    if (get_all(bufs_obj, 0, &bufs, &nbufs, "bufs") < 0)
        goto done;
    have = 4;
    for (i = 0; i < nbufs; i++) {
        const char *b = (const char *)bufs[i].buf, *o = (const char *)out.buf;
        if (out.len && bufs[i].len && o < b + bufs[i].len && b < o + out.len) {
            PyErr_Format(PyExc_ValueError, "out overlaps bufs[%zd]", i);
            goto done;
        }
    }
    for (i = 0; i < n; i++) {
        int64_t t[3];
        memcpy(t, (const uint8_t *)spans.buf + 24 * i, sizeof(t));
        if (t[0] < 0 || t[0] >= nbufs || t[1] < 0 || t[2] < t[1] || t[2] > bufs[t[0]].len) {
            PyErr_Format(PyExc_ValueError, "span %zd is out of bounds", i);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) {
        int64_t t[3];
        if (__atomic_load_n(&st[1], __ATOMIC_ACQUIRE))
            break;
        memcpy(t, (const uint8_t *)spans.buf + 24 * i, sizeof(t));
        dc_xxh3_128((const uint8_t *)bufs[t[0]].buf + t[1], (size_t)(t[2] - t[1]), (uint8_t *)out.buf + 16 * i);
        __atomic_store_n(&st[0], (int64_t)(i + 1), __ATOMIC_RELEASE);
    }
    hashed = i;
    Py_END_ALLOW_THREADS
done:
    if (st != NULL)
        __atomic_store_n(&st[2], (int64_t)1, __ATOMIC_RELEASE);
    if (have >= 4)
        release_all(bufs, nbufs);
    if (have >= 3)
        PyBuffer_Release(&out);
    if (have >= 2)
        PyBuffer_Release(&spans);
    PyBuffer_Release(&state);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(hashed);
}

PyDoc_STRVAR(wait_hashed_doc,
"wait_hashed(state, n, timeout_us) -> int\n\n"
"Wait, without the GIL, until hash_spans has hashed n spans (state[0] >= n) or has returned (state[2] != 0),\n"
"at most about timeout_us microseconds; returns state[0] (read with acquire order: the digests it counts are\n"
"in out).");
static PyObject *py_wait_hashed(PyObject *self, PyObject *args)
{
    PyObject *state_obj;
    Py_buffer state;
    Py_ssize_t n, timeout_us;
    int64_t got = 0;
    int64_t *st;

    (void)self;
    if (!PyArg_ParseTuple(args, "Onn:wait_hashed", &state_obj, &n, &timeout_us))
        return NULL;
    if (get_out(state_obj, &state) < 0)
        return NULL;
    if (state.len != 3 * (Py_ssize_t)sizeof(int64_t) || (uintptr_t)state.buf % sizeof(int64_t)) {
        PyBuffer_Release(&state);
        PyErr_SetString(PyExc_ValueError, "state must be 3 aligned int64 values");
        return NULL;
    }
    st = (int64_t *)state.buf;
    got = __atomic_load_n(&st[0], __ATOMIC_ACQUIRE);
    if (got < n && !__atomic_load_n(&st[2], __ATOMIC_ACQUIRE)) {
        Py_BEGIN_ALLOW_THREADS
        struct timespec start, now, pause = {0, 20000};
        clock_gettime(CLOCK_MONOTONIC, &start);
        for (long spins = 0;; spins++) {
            got = __atomic_load_n(&st[0], __ATOMIC_ACQUIRE);
            if (got >= n || __atomic_load_n(&st[2], __ATOMIC_ACQUIRE))
                break;
            if (spins < 64) {
                sched_yield();
                continue;
            }
            clock_gettime(CLOCK_MONOTONIC, &now);
            if ((now.tv_sec - start.tv_sec) * 1000000L + (now.tv_nsec - start.tv_nsec) / 1000 >= timeout_us)
                break;
            nanosleep(&pause, NULL);
        }
        got = __atomic_load_n(&st[0], __ATOMIC_ACQUIRE);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&state);
    return PyLong_FromLongLong((long long)got);
}

static PyMethodDef native_methods[] = {
    {"find_sorted", py_find_sorted, METH_VARARGS, find_sorted_doc},
    {"find_bucketed", py_find_bucketed, METH_VARARGS, find_bucketed_doc},
    {"sort_ids", py_sort_ids, METH_VARARGS, sort_ids_doc},
    {"shuffle", py_shuffle, METH_VARARGS, shuffle_doc},
    {"unshuffle", py_unshuffle, METH_VARARGS, unshuffle_doc},
    {"xor_shuffle", py_xor_shuffle, METH_VARARGS, xor_shuffle_doc},
    {"unshuffle_xor", py_unshuffle_xor, METH_VARARGS, unshuffle_xor_doc},
    {"zigzag_shuffle", py_zigzag_shuffle, METH_VARARGS, zigzag_shuffle_doc},
    {"unshuffle_zigzag", py_unshuffle_zigzag, METH_VARARGS, unshuffle_zigzag_doc},
    {"fastcdc_cuts", py_fastcdc_cuts, METH_VARARGS, fastcdc_cuts_doc},
    {"sparse_split", py_sparse_split, METH_VARARGS, sparse_split_doc},
    {"plane_stats", py_plane_stats, METH_O, plane_stats_doc},
    {"sparse_merge", py_sparse_merge, METH_VARARGS, sparse_merge_doc},
    {"sparse_apply", py_sparse_apply, METH_VARARGS, sparse_apply_doc},
    {"gear_table", py_gear_table, METH_NOARGS, gear_table_doc},
    {"chunk_refs", py_chunk_refs, METH_VARARGS, chunk_refs_doc},
    {"walk_refs", py_walk_refs, METH_VARARGS, walk_refs_doc},
    {"unshuffle_check", py_unshuffle_check, METH_VARARGS, unshuffle_check_doc},
    {"xxh3_64_rows", py_xxh3_64_rows, METH_VARARGS, xxh3_64_rows_doc},
    {"hash_spans", py_hash_spans, METH_VARARGS, hash_spans_doc},
    {"wait_hashed", py_wait_hashed, METH_VARARGS, wait_hashed_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    "deltackpt._native",
    "Native kernels for deltackpt (byte-plane shuffle, XOR and zigzag deltas, FastCDC).",
    -1,
    native_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL)
        return NULL;
    dc_sparse_init();
    if (PyModule_AddIntConstant(m, "GIL_RELEASE_THRESHOLD", (long)DC_GIL_THRESHOLD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "WALKER_BYTES", (long)sizeof(dc_walker)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "SIMD", DC_SIMD_NAME) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
