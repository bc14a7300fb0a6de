"""The tensors of a checkpoint as the manifest lays them out, and reads of them consolidated (torch-free).

A DCP checkpoint stores each saved shard as one item keyed ``fqn@o0,o1,...`` (``fqn@b`` for a pickled
value; see ``deltackpt.dcp.placement.item_key``); a shard that is one contiguous range of its row-major
global tensor sits in the tensor's byte space (``group == fqn`` at ``global_offset``), any other box in its
own. A checkpoint saved with ``Store.save`` has one item per array. :func:`read_layout` turns either into
:class:`TensorLayout` s (name, dtype, global shape, boxes) and byte items; :func:`read_rows` fills rows of a
global tensor from the chunks of every box that overlaps them, so a tensor is consolidated a slab at a time
with no process group and memory bounded by the slab.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

import numpy as np

from ..errors import ManifestFormatError
from ..store import CheckpointReader, Item, Manifest

DCP_LAYER = "dcp"  # deltackpt.dcp.LAYER_KEY (tests/interop check they agree; importing it would import torch)
SLAB_BYTES = 64 << 20  # a tensor is consolidated this many bytes of rows at a time (at least one row)

# Item size of each dtype name DCP items carry (torch's names) that numpy has no equal for.
_TORCH_ONLY = {"bfloat16": 2, "complex32": 4, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
               "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1}
_NUMERIC = {"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
            "float32", "float64", "complex64", "complex128"}


def dtype_name(stored: str) -> str:
    """A canonical dtype name (torch's, which numpy shares for the common ones) of an item's stored dtype:
    DCP items store torch's name (``float32``, ``bfloat16``), ``Store.save`` numpy's (``<f4``). A dtype
    that is neither comes back as it is."""
    if stored in _NUMERIC or stored in _TORCH_ONLY:
        return stored
    try:
        name = np.dtype(stored).name
    except TypeError:
        return stored
    return name if name in _NUMERIC else stored


def foreign_byte_order(stored: str) -> str | None:
    """``stored`` when it names a numpy dtype in the other byte order than this machine's (``Store.save`` of
    a ``>f4`` array keeps its bytes as they are), else None: :func:`read_rows` swaps such bytes, so that
    everything after it sees the canonical dtype in this machine's order."""
    try:
        dt = np.dtype(stored)
    except TypeError:
        return None
    return stored if dt.byteorder not in ("=", "|") and dt.newbyteorder("=") != dt else None


@dataclass
class Box:
    """One stored shard of a tensor: where it sits in the global tensor and the item holding its bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    item: Item
    contiguous: bool  # one byte range of the global tensor, at item.global_offset


@dataclass
class TensorLayout:
    name: str
    dtype: str  # canonical (dtype_name)
    itemsize: int
    shape: tuple[int, ...]
    boxes: list[Box] = field(default_factory=list)
    swap: str | None = None  # the stored dtype when its bytes are in the other order (foreign_byte_order)
    _by_row: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def boxes_over(self, r0: int, r1: int) -> list[Box]:
        """The non-empty boxes whose rows of dim 0 may meet rows [r0, r1), found by bisection in the boxes
        sorted by first row (a look at every box per slab made an export of a tensor row-sharded over R ranks
        cost R^2: 0.27 s of loop at 2,000 ranks). Built on first use: the boxes are all known by then."""
        if self._by_row is None:
            rb = self.row_bytes if self.shape else self.itemsize
            spans = []
            for box in self.boxes:
                if 0 in box.sizes:
                    continue
                if box.contiguous:
                    gs = box.item.global_offset
                    spans.append((gs // rb, -(-(gs + box.item.nbytes) // rb), box))
                else:
                    spans.append((box.offsets[0], box.offsets[0] + box.sizes[0], box))
            spans.sort(key=lambda s: s[0])
            self._by_row = ([s[0] for s in spans], [s[2] for s in spans],
                            max((hi - lo for lo, hi, _box in spans), default=0))
        starts, boxes, widest = self._by_row
        # A box that ends after r0 starts after r0 - widest; one that starts before r1 may meet [r0, r1).
        return boxes[bisect_right(starts, r0 - widest):bisect_left(starts, r1)]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def row_bytes(self) -> int:
        return self.itemsize * math.prod(self.shape[1:])


@dataclass
class Layout:
    """A checkpoint's tensors and byte items by name, in manifest order; ``dcp``: written through DCP."""

    tensors: dict[str, TensorLayout]
    byte_items: dict[str, Item]
    dcp: bool


def is_dcp(manifest: Manifest) -> bool:
    return DCP_LAYER in manifest.layer_data


def split_key(key: str) -> tuple[str, tuple[int, ...] | None]:
    """(fqn, box offsets) of a DCP item key; offsets None for a byte item."""
    fqn, sep, suffix = key.rpartition("@")
    if not sep:
        raise ManifestFormatError(f"item key {key!r} is not a DCP item key (fqn@offsets)")
    if suffix == "b":
        return fqn, None
    try:
        return fqn, tuple(int(x) for x in suffix.split(",")) if suffix else ()
    except ValueError:
        raise ManifestFormatError(f"item key {key!r} is not a DCP item key (fqn@offsets)") from None


def read_layout(manifest: Manifest) -> Layout:
    dcp = is_dcp(manifest)
    tensors: dict[str, TensorLayout] = {}
    byte_items: dict[str, Item] = {}
    for item in manifest.items:
        name, offsets = split_key(item.key) if dcp else (item.key, None if item.kind == "bytes" else ())
        if item.kind == "bytes" or offsets is None:
            byte_items[name] = item
            continue
        sizes = tuple(item.shape)
        offsets = offsets or (0,) * len(sizes)
        if len(offsets) != len(sizes):
            raise ManifestFormatError(f"item {item.key!r}: {len(offsets)} offsets for a shape of {len(sizes)} dims")
        n = math.prod(sizes)
        itemsize = item.nbytes // n if n else _TORCH_ONLY.get(item.dtype) or _numpy_itemsize(item)
        if n and item.nbytes != n * itemsize:
            raise ManifestFormatError(f"item {item.key!r}: {item.nbytes} bytes for shape {list(sizes)}")
        t = tensors.get(name)
        if t is None:
            t = tensors[name] = TensorLayout(name, dtype_name(item.dtype), itemsize, sizes,
                                             swap=foreign_byte_order(item.dtype))
        elif (t.dtype != dtype_name(item.dtype) or t.itemsize != itemsize or len(t.shape) != len(sizes)
              or t.swap != foreign_byte_order(item.dtype)):
            raise ManifestFormatError(f"shards of {name!r} disagree on dtype or rank")
        t.shape = tuple(max(g, o + s) for g, o, s in zip(t.shape, offsets, sizes))
        t.boxes.append(Box(offsets, sizes, item, contiguous=item.group_name == name))
    for t in tensors.values():  # DCP stores each region once: the boxes must tile the tensor
        if sum(math.prod(b.sizes) for b in t.boxes) != t.numel:
            raise ManifestFormatError(f"the shards of {t.name!r} do not tile its shape {list(t.shape)}")
    return Layout(tensors, byte_items, dcp)


def _numpy_itemsize(item: Item) -> int:
    try:
        return np.dtype(item.dtype).itemsize
    except TypeError:
        return item.elem_size


def slabs(t: TensorLayout, max_bytes: int = SLAB_BYTES) -> list[tuple[int, int]]:
    """Row ranges [r0, r1) of dim 0 covering ``t`` in slabs of at most ``max_bytes`` (or one row)."""
    if t.numel == 0:
        return []
    if not t.shape:
        return [(0, 1)]
    step = max(1, max_bytes // t.row_bytes)
    return [(r, min(r + step, t.shape[0])) for r in range(0, t.shape[0], step)]


def read_rows(reader: CheckpointReader, t: TensorLayout, r0: int, r1: int, out: np.ndarray | None = None
              ) -> np.ndarray:
    """Rows [r0, r1) of the global tensor ``t`` as raw bytes (a uint8 array) in this machine's byte order,
    read from every box that overlaps them (a 0-d tensor: rows [0, 1) are the scalar)."""
    rb = t.row_bytes if t.shape else t.itemsize
    if out is None:
        out = np.empty((r1 - r0) * rb, dtype=np.uint8)
    start, end = r0 * rb, r1 * rb
    for box in t.boxes_over(r0, r1):
        item = box.item
        if box.contiguous:
            gs = item.global_offset
            lo, hi = max(start, gs), min(end, gs + item.nbytes)
            if lo < hi:
                reader.read_into(item.key, out[lo - start:hi - start], lo - gs)
            continue
        o0, s0 = box.offsets[0], box.sizes[0]
        lo, hi = max(r0, o0), min(r1, o0 + s0)
        if lo >= hi:
            continue
        box_row = t.itemsize * math.prod(box.sizes[1:])
        part = reader.read(item.key, (lo - o0) * box_row, (hi - lo) * box_row)
        cell = np.dtype((np.void, t.itemsize))
        dst = out.view(cell).reshape((r1 - r0, *t.shape[1:]))
        where = (slice(lo - r0, hi - r0),) + tuple(slice(o, o + s) for o, s in zip(box.offsets[1:], box.sizes[1:]))
        dst[where] = part.view(cell).reshape((hi - lo, *box.sizes[1:]))
    if t.swap is not None:
        out.view(np.dtype(t.swap)).byteswap(inplace=True)  # per element (per part of a complex one)
    return out


def select(names, only) -> list[str]:
    """``names`` that start with one of the prefixes ``only`` (all of them when ``only`` is empty)."""
    prefixes = [only] if isinstance(only, str) else list(only or [])
    return [n for n in names if not prefixes or any(n.startswith(p) for p in prefixes)]
