"""``diff``: what changed between two checkpoints, item by item, streamed chunk by chunk (torch-free).

Each tensor (a DCP fqn, or a ``Store.save`` array) is compared in a byte space both checkpoints share: the
global tensor's when every shard of both is a contiguous range of it (the usual case, whatever the world
sizes), else each shard's own when both were saved with the same shards. There the two lists of chunk refs
are walked side by side; a stretch where both name the same chunk at the same place is equal without being
read, so a tensor whose chunks all match is reported unchanged without decoding anything. Stretches that
differ are read (both sides, in windows of at most ``WINDOW_BYTES``) and compared element by element; for a
changed tensor the equal stretches of A are read too, for the norm that relative L2 change divides by.
Tensors sharded differently in other ways are compared a slab of rows at a time (no chunk counts then).

Per item: status (unchanged, changed, added, removed, shape, dtype), changed elements and their bytes, the
chunks of B that hold a change, max |a-b| and ||b-a|| / ||a|| over finite values, both inf when a changed
element's difference is not finite (a value that became inf or NaN: ranked first); for floats, ints, bools,
bfloat16, complex; None for dtypes without a numeric view, e.g. float8, whose bytes are still compared.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from ..store import CheckpointReader, Progress, Store, phase
from .layout import TensorLayout, read_layout, read_rows, slabs
from .numeric import EXACT_INTS, as_numbers, int_distance

WINDOW_BYTES = 16 << 20


@dataclass
class ItemDiff:
    name: str
    status: str  # unchanged | changed | added | removed | shape | dtype
    kind: str  # tensor | bytes
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    nbytes: int = 0  # B's bytes (A's for a removed item)
    num_chunks: int = 0  # B's chunk refs (A's for a removed item)
    changed_bytes: int = 0
    changed_chunks: int | None = 0
    numel: int | None = None
    changed_elements: int | None = None
    max_abs_diff: float | None = None
    rel_l2: float | None = None

    @property
    def changed_fraction(self) -> float | None:
        if self.changed_elements is None or not self.numel:
            return None
        return self.changed_elements / self.numel

    def as_dict(self) -> dict:
        d = asdict(self)
        d["changed_fraction"] = self.changed_fraction
        for k in ("max_abs_diff", "rel_l2"):
            if d[k] is not None and not math.isfinite(d[k]):
                d[k] = None if math.isnan(d[k]) else "inf"
        return d


@dataclass
class DiffReport:
    a: str
    b: str
    items: list[ItemDiff] = field(default_factory=list)
    decoded_bytes: int = 0  # what the comparison had to read and decode

    def count(self, *statuses: str) -> int:
        return sum(i.status in statuses for i in self.items)

    @property
    def identical(self) -> bool:
        return all(i.status == "unchanged" for i in self.items)

    def top(self, n: int | None = None) -> list[ItemDiff]:
        """The items that differ, largest relative change first (then most changed bytes)."""
        changed = [i for i in self.items if i.status != "unchanged"]
        changed.sort(key=lambda i: (-(i.rel_l2 if i.rel_l2 is not None and not math.isnan(i.rel_l2) else math.inf),
                                    -i.changed_bytes, i.name))
        return changed if n is None else changed[:n]

    def totals(self) -> dict:
        return {"items": len(self.items), "unchanged": self.count("unchanged"), "changed": self.count("changed"),
                "shape_or_dtype": self.count("shape", "dtype"), "added": self.count("added"),
                "removed": self.count("removed"), "changed_bytes": sum(i.changed_bytes for i in self.items),
                "changed_chunks": sum(i.changed_chunks or 0 for i in self.items),
                "bytes_b": sum(i.nbytes for i in self.items if i.status != "removed"),
                "decoded_bytes": self.decoded_bytes}

    def as_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "identical": self.identical, "totals": self.totals(),
                "items": [i.as_dict() for i in self.items]}


def diff(store, a: str, b: str, *, progress: Progress | None = None, storage_options: dict | None = None
         ) -> DiffReport:
    """Compare checkpoint ``b`` against ``a`` (names or ``latest``) of ``store`` (a path, URL or Store)."""
    store = store if isinstance(store, Store) else Store.open(store, storage_options=storage_options)
    ma, mb = store.read_manifest(store.resolve(a)), store.read_manifest(store.resolve(b))
    la, lb = read_layout(ma), read_layout(mb)
    report = DiffReport(ma.name, mb.name)
    common = [n for n in lb.tensors if n in la.tensors]
    total = sum(lb.tensors[n].nbytes for n in common)
    with CheckpointReader(store, ma) as ra, CheckpointReader(store, mb) as rb, \
            phase(progress, "diff", total, "B") as prog:
        for name in _union(la, lb):
            report.items.append(_diff_item(name, la, lb, ra, rb, report, prog))
    return report


def _union(la, lb) -> list[str]:
    seen = dict.fromkeys([*la.tensors, *la.byte_items])
    seen.update(dict.fromkeys([*lb.tensors, *lb.byte_items]))
    return list(seen)


def _diff_item(name, la, lb, ra, rb, report, prog) -> ItemDiff:
    ta, tb = la.tensors.get(name), lb.tensors.get(name)
    ba, bb = la.byte_items.get(name), lb.byte_items.get(name)
    in_a, in_b = ta is not None or ba is not None, tb is not None or bb is not None
    kind = "tensor" if (tb or ta) is not None else "bytes"
    d = ItemDiff(name, "unchanged", kind)
    if ta is not None:
        d.dtype_a, d.shape_a = ta.dtype, list(ta.shape)
    if tb is not None:
        d.dtype_b, d.shape_b = tb.dtype, list(tb.shape)
    refs_a, refs_b = _refs(ta, ba), _refs(tb, bb)
    d.nbytes = sum(r.length for r in (refs_b if in_b else refs_a))
    d.num_chunks = len(refs_b if in_b else refs_a)
    if not in_a or not in_b:
        d.status = "added" if in_b else "removed"
        d.changed_bytes, d.changed_chunks = d.nbytes, d.num_chunks
        return d
    if ta is None or tb is None:
        if ta is not None or tb is not None:
            d.status = "dtype"  # a tensor in one, a pickled value in the other
            d.changed_bytes, d.changed_chunks = d.nbytes, len(refs_b)
            return d
        return _diff_bytes(d, ba, bb, ra, rb, report)
    if (ta.dtype, ta.itemsize) != (tb.dtype, tb.itemsize) or ta.shape != tb.shape:
        d.status = "dtype" if ta.dtype != tb.dtype else "shape"
        ids_a = {r.id for r in refs_a}
        d.changed_bytes, d.changed_chunks = d.nbytes, sum(r.id not in ids_a for r in refs_b)
        return d
    d.numel = tb.numel
    _TensorDiff(d, ta, tb, ra, rb, report, prog).run()
    return d


def _refs(t: TensorLayout | None, item) -> list:
    if t is not None:
        return [r for box in t.boxes for r in box.item.chunks]
    return list(item.chunks) if item is not None else []


def _diff_bytes(d: ItemDiff, ia, ib, ra, rb, report) -> ItemDiff:
    if ia.chunks == ib.chunks:
        d.changed_chunks = 0
        return d
    a, b = ra.read(ia.key), rb.read(ib.key)
    report.decoded_bytes += len(a) + len(b)
    n = min(len(a), len(b))
    changed = int(np.count_nonzero(a[:n] != b[:n])) + abs(len(a) - len(b))
    ids_a = {r.id for r in ia.chunks}
    d.changed_bytes, d.changed_chunks = changed, sum(r.id not in ids_a for r in ib.chunks)
    d.status = "changed" if changed else "unchanged"
    return d


class _TensorDiff:
    """The comparison of one tensor of equal dtype and shape in A and B."""

    def __init__(self, d: ItemDiff, ta: TensorLayout, tb: TensorLayout, ra, rb, report, prog) -> None:
        self.d, self.ta, self.tb, self.ra, self.rb, self.report, self.prog = d, ta, tb, ra, rb, report, prog
        self.size = ta.itemsize
        self.changed = 0
        self.max_abs = -math.inf
        self.diff_sq = self.norm_sq = 0.0
        self.numeric = True

    def run(self) -> None:
        ext_a, ext_b = _space(self.ta, self.tb)
        if ext_a is None:
            self._compare_slabs()
        else:
            self._compare_space(ext_a, ext_b)
        d = self.d
        d.changed_elements = self.changed
        d.changed_bytes = self.changed * self.size
        if self.changed:
            d.status = "changed"
            if self.numeric:
                d.max_abs_diff = self.max_abs if self.max_abs > -math.inf else math.nan
                d.rel_l2 = (math.sqrt(self.diff_sq / self.norm_sq) if self.norm_sq
                            else math.inf if self.diff_sq else 0.0)
        elif self.numeric:
            d.max_abs_diff, d.rel_l2 = 0.0, 0.0

    # -- in a shared byte space ------------------------------------------------------------------------------
    def _compare_space(self, ext_a: list, ext_b: list) -> None:
        differing = _differing(ext_a, ext_b, self.size)
        if not differing:
            self.d.changed_chunks = 0
            self.prog.advance(self.tb.nbytes)
            return
        hit = set()  # indexes into ext_b of B's chunk refs that hold a change
        starts_a, starts_b = [x[0] for x in ext_a], [x[0] for x in ext_b]
        for s, e, differs in _windows(differing, self.tb.nbytes, self.size):
            a = _read_space(self.ra, ext_a, starts_a, s, e)
            self.report.decoded_bytes += e - s
            if differs:
                b = _read_space(self.rb, ext_b, starts_b, s, e)
                self.report.decoded_bytes += e - s
                mask = self._add(a, b)
                for k, (es, ee, *_rest) in _overlapping(ext_b, starts_b, s, e):
                    lo, hi = (max(es, s) - s) // self.size, -(-(min(ee, e) - s) // self.size)
                    if mask[lo:hi].any():
                        hit.add(k)
            else:
                self._add_norm(a)
            self.prog.advance(e - s)
        self.d.changed_chunks = len(hit)

    # -- differently sharded: slabs of the global tensor -----------------------------------------------------
    def _compare_slabs(self) -> None:
        self.d.changed_chunks = None
        for r0, r1 in slabs(self.tb, WINDOW_BYTES):
            a, b = read_rows(self.ra, self.ta, r0, r1), read_rows(self.rb, self.tb, r0, r1)
            self.report.decoded_bytes += 2 * len(a)
            self._add(a, b)
            self.prog.advance(len(b))

    # -- statistics ------------------------------------------------------------------------------------------
    def _add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Count the elements of window ``a``/``b`` (raw bytes) that differ in any bit; return that mask."""
        n = len(a) // self.size
        mask = (a.reshape(n, self.size) != b.reshape(n, self.size)).any(axis=1)
        self.changed += int(np.count_nonzero(mask))
        va = as_numbers(a, self.ta.dtype)
        if va is None:
            self.numeric = False
            return mask
        vb = as_numbers(b, self.ta.dtype)
        if self.ta.dtype in EXACT_INTS:
            rows_a, rows_b = a.reshape(n, self.size)[mask], b.reshape(n, self.size)[mask]
            delta = int_distance(rows_a.reshape(-1), rows_b.reshape(-1), self.ta.dtype)
        else:
            delta = np.abs(vb[mask] - va[mask])
        finite = np.isfinite(delta)
        if not finite.all():  # an element that became (or stopped being) inf or NaN: the largest change
            self.max_abs = self.diff_sq = math.inf
        delta = delta[finite]
        if delta.size:
            self.max_abs = max(self.max_abs, float(delta.max()))
            self.diff_sq += float(np.dot(delta, delta))
        self._add_norm(a, va)
        return mask

    def _add_norm(self, a: np.ndarray, va: np.ndarray | None = None) -> None:
        va = as_numbers(a, self.ta.dtype) if va is None else va
        if va is None:
            return
        mag = np.abs(va)
        mag = mag[np.isfinite(mag)]
        self.norm_sq += float(np.dot(mag, mag))


def _space(ta: TensorLayout, tb: TensorLayout):
    """(A's, B's) chunk extents ``(start, end, chunk id, skip, item key, item offset)`` in one byte space
    both cover exactly, or (None, None) if the shardings share none, or either's bytes are in the other
    byte order (:func:`read_rows` swaps them)."""
    if ta.swap is not None or tb.swap is not None:
        return None, None
    if all(box.contiguous for box in ta.boxes + tb.boxes):
        ext_a, ext_b = _extents(ta, None), _extents(tb, None)
    else:
        key_a = sorted((box.offsets, box.sizes) for box in ta.boxes)
        if key_a != sorted((box.offsets, box.sizes) for box in tb.boxes):
            return None, None
        order = {k: i for i, k in enumerate(key_a)}
        ext_a, ext_b = _extents(ta, order), _extents(tb, order)
    if not (_tiles(ext_a, ta.nbytes) and _tiles(ext_b, tb.nbytes)):
        return None, None
    return ext_a, ext_b


def _extents(t: TensorLayout, order: dict | None) -> list[tuple]:
    """Chunk extents of ``t``: in the global tensor's byte space (``order`` None), else in the space of its
    boxes laid end to end in ``order``."""
    boxes = t.boxes if order is None else sorted(t.boxes, key=lambda b: order[(b.offsets, b.sizes)])
    out, base = [], 0
    for box in boxes:
        item = box.item
        pos = item.global_offset if order is None else base
        off = 0
        for ref in item.chunks:
            out.append((pos, pos + ref.length, ref.id, ref.skip, item.key, off))
            pos += ref.length
            off += ref.length
        base += item.nbytes
    out.sort(key=lambda e: e[0])
    return out


def _tiles(ext: list, nbytes: int) -> bool:
    pos = 0
    for s, e, *_ in ext:
        if s != pos:
            return False
        pos = e
    return pos == nbytes


def _differing(ext_a: list, ext_b: list, size: int) -> list[tuple[int, int]]:
    """Element-aligned, merged [start, end) ranges where A and B do not name the same chunk bytes."""
    out: list[list[int]] = []
    i = j = pos = 0
    while i < len(ext_a) and j < len(ext_b):
        sa, ea, ca, ka, *_ = ext_a[i]
        sb, eb, cb, kb, *_ = ext_b[j]
        end = min(ea, eb)
        if end > pos and (ca != cb or ka + pos - sa != kb + pos - sb):
            lo, hi = pos - pos % size, -(-end // size) * size
            if out and lo <= out[-1][1]:
                out[-1][1] = max(out[-1][1], hi)
            else:
                out.append([lo, hi])
        pos = end
        i += ea == end
        j += eb == end
    return [(s, e) for s, e in out]


def _windows(differing: list, nbytes: int, size: int):
    """(start, end, differs) covering [0, nbytes): the differing ranges and the equal ones between them,
    each cut into pieces of at most WINDOW_BYTES (element-aligned)."""
    step = max(size, WINDOW_BYTES - WINDOW_BYTES % size)
    pos = 0
    for s, e in [*differing, (nbytes, nbytes)]:
        for lo, hi, differs in ((pos, s, False), (s, e, True)):
            for w in range(lo, hi, step):
                yield w, min(w + step, hi), differs
        pos = e


def _overlapping(ext: list, starts: list[int], s: int, e: int):
    """(index, extent) of the extents overlapping [s, e) (``ext`` sorted and tiling its space, ``starts``
    their start offsets)."""
    k = max(0, bisect.bisect_right(starts, s) - 1)
    while k < len(ext) and ext[k][0] < e:
        if ext[k][1] > s:
            yield k, ext[k]
        k += 1


def _read_space(reader, ext: list, starts: list[int], s: int, e: int) -> np.ndarray:
    out = np.empty(e - s, dtype=np.uint8)
    for _k, (es, ee, _cid, _skip, key, off) in _overlapping(ext, starts, s, e):
        lo, hi = max(es, s), min(ee, e)
        reader.read_into(key, out[lo - s:hi - s], off + lo - es)
    return out
