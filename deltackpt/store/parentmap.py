"""Where the previous checkpoint kept each global byte range of each group (tensor).

A save consults its parent checkpoint to reuse chunks whose content did not change even when the chunk
boundaries moved: after resharding (2 ranks -> 3), a shard boundary cuts a grid cell in two, and each piece
is referenced as a *slice* of the parent's chunk (``ChunkRef.skip``) once its bytes are checked equal,
instead of being stored again. The delta codec uses the same map to find a changed chunk's base.

A group the parent lacks is looked up under the name it was most likely renamed from: a fine-tune that wraps
its base model inserts or drops dotted name components (``model.`` prefixes, a LoRA wrapper's
``layer.base_layer.weight`` for ``layer.weight``), so its first checkpoint still finds the base's bytes.
A wrong guess costs only a comparison: slices are reused only when their bytes are equal.

A DCP save builds the map once, on its coordinator, and sends each rank only the part its items overlap
(:meth:`ParentMap.encode_part`): no rank reads the parent's manifest.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import msgspec

from .manifest import Manifest


@dataclass(frozen=True, slots=True)
class Extent:
    """Global bytes ``[start, end)`` of a group are bytes ``[skip, skip + end - start)`` of chunk ``chunk_id``."""

    start: int
    end: int
    chunk_id: bytes
    skip: int


class _LazyExtents(Sequence):
    """A group's extents, each made when asked for: a save asks for a few of a group's many (its changed
    chunks'), and an Extent per parent chunk was a tenth of a 1 % save."""

    def __init__(self, starts: list[int], refs: list) -> None:
        self._starts, self._refs = starts, refs

    def __len__(self) -> int:
        return len(self._refs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        ref, start = self._refs[i], self._starts[i]
        return Extent(start, start + ref.length, ref.id, ref.skip)

    def ids(self, i: int, j: int) -> list[bytes]:
        """The chunk ids of extents ``i:j``, without an Extent each."""
        return [ref.id for ref in self._refs[i:j]]


class ParentMap:
    """Group name -> sorted extents of the parent checkpoint's array items (or of the part of them one DCP
    rank's items overlap: :meth:`decode_part`)."""

    def __init__(self, manifest: Manifest | None) -> None:
        self.name = manifest.name if manifest is not None else None
        self._items: dict[str, list] = {}
        if manifest is not None:
            for it in manifest.items:
                if it.kind == "array":
                    self._items.setdefault(it.group_name, []).append(it)
        self._built: dict[str, tuple[list[int], Sequence[Extent]]] = {}
        self._by_rename_key: dict[tuple, list[tuple[list[str], str]]] | None = None  # built on the first miss

    @classmethod
    def from_extents(cls, name: str | None, extents: dict[str, list[Extent]]) -> "ParentMap":
        """A map of just these extents per group (e.g. those overlapping one rank's items): for a byte range
        inside the ranges they were chosen for, it answers as the whole parent's map does."""
        pm = cls(None)
        pm.name = name
        for group, found in extents.items():
            found = sorted(found, key=lambda e: e.start)
            pm._items[group] = []
            pm._built[group] = ([e.start for e in found], found)
        return pm

    def __bool__(self) -> bool:
        return bool(self._items)

    def encode_part(self, ranges) -> bytes:
        """The extents that overlap ``ranges`` (``(group, start, end)`` each; e.g. one DCP rank's items), for
        :meth:`decode_part` in another process: msgpack of group -> ``[start, end, chunk id, skip]`` rows."""
        part: dict[str, dict[int, Extent]] = {}
        for group, start, end in ranges:
            for e in self.overlapping(group, start, end):
                part.setdefault(group, {})[e.start] = e
        return msgspec.msgpack.encode({g: [(e.start, e.end, e.chunk_id, e.skip) for e in found.values()]
                                       for g, found in part.items()})

    @classmethod
    def decode_part(cls, name: str | None, data: bytes) -> "ParentMap":
        """The map :meth:`encode_part` sent (parsed with a strict schema)."""
        rows = msgspec.msgpack.decode(data, type=dict[str, list[tuple[int, int, bytes, int]]])
        return cls.from_extents(name, {g: [Extent(*row) for row in found] for g, found in rows.items()})

    def _extents(self, group: str) -> tuple[list[int], Sequence[Extent]]:
        hit = self._built.get(group)
        if hit is None:
            starts, refs = [], []
            for it in self._items.get(self._resolve(group), ()):
                lengths = [ref.length for ref in it.chunks]
                pos = list(accumulate(lengths, initial=it.global_offset))[:-1]
                chunks = it.chunks
                if 0 in lengths:  # an empty ref covers no byte
                    keep = [k for k, n in enumerate(lengths) if n]
                    pos, chunks = [pos[k] for k in keep], [chunks[k] for k in keep]
                starts.extend(pos)
                refs.extend(chunks)
            if starts != sorted(starts):  # items out of order: sorted stably, extents of equal start as listed
                order = sorted(range(len(starts)), key=starts.__getitem__)
                starts, refs = [starts[k] for k in order], [refs[k] for k in order]
            hit = self._built[group] = (starts, _LazyExtents(starts, refs))
        return hit

    def _resolve(self, group: str) -> str:
        """``group`` if the parent has it, else the parent group it was renamed from (see :func:`renamed_from`)."""
        if group in self._items:
            return group
        by_key = self._by_rename_key
        if by_key is None:  # built whole before it is shared: coding threads call this concurrently
            by_key = {}
            for name in self._items:
                parts = name.split(".")
                by_key.setdefault(_rename_key(parts), []).append((parts, name))
            self._by_rename_key = by_key
        return renamed_from(group, by_key) or group

    def exact(self, group: str, start: int, end: int) -> Extent | None:
        """The parent's extent with exactly these bounds, if any."""
        starts, extents = self._extents(group)
        i = bisect.bisect_left(starts, start)
        if i < len(extents) and extents[i].start == start and extents[i].end == end:
            return extents[i]
        return None

    def overlapping(self, group: str, start: int, end: int) -> list[Extent]:
        """The parent's extents that share a byte with ``[start, end)``, in order."""
        starts, extents = self._extents(group)
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        out = []
        while i < len(extents) and extents[i].start < end:
            if extents[i].end > start:
                out.append(extents[i])
            i += 1
        return out

    def ids_near(self, group: str, start: int, end: int) -> list[bytes]:
        """The chunk ids of the parent's extents that share a byte with ``[start, end)``, and maybe of the one
        before them (cheaper than :meth:`overlapping`: no Extent each)."""
        starts, extents = self._extents(group)
        i, j = max(bisect.bisect_right(starts, start) - 1, 0), bisect.bisect_left(starts, end)
        if isinstance(extents, _LazyExtents):
            return extents.ids(i, j)
        return [e.chunk_id for e in extents[i:j]]

    def covering(self, group: str, start: int, end: int) -> list[Extent] | None:
        """Parent extents that together cover ``[start, end)`` without a gap, else None."""
        starts, extents = self._extents(group)
        i = bisect.bisect_right(starts, start) - 1
        if i < 0:
            return None
        out, pos = [], start
        while i < len(extents) and pos < end:
            e = extents[i]
            if e.start > pos or e.end <= pos:
                return None
            out.append(e)
            pos = e.end
            i += 1
        return out if pos >= end else None


def _rename_key(parts: list[str]) -> tuple:
    # A rename keeps the leaf name and the layer indices: only groups alike in both are compared.
    return parts[-1], tuple(p for p in parts if p.isdigit())


def _subsequence(short: list[str], long: list[str]) -> bool:
    rest = iter(long)
    return all(p in rest for p in short)


def renamed_from(group: str, by_rename_key: dict[tuple, list[tuple[list[str], str]]]) -> str | None:
    """The one known group whose dotted name components are a subsequence of ``group``'s, or the other way
    round (a wrapper inserted or dropped components), with the same leaf name and layer indices; the one
    sharing the most components wins, and a tie is no answer."""
    parts = group.split(".")
    best, best_score, tie = None, -1, False
    for other, name in by_rename_key.get(_rename_key(parts), ()):
        short, long = (other, parts) if len(other) <= len(parts) else (parts, other)
        if not _subsequence(short, long):
            continue
        if len(short) > best_score:
            best, best_score, tie = name, len(short), False
        elif len(short) == best_score:
            tie = True
    return None if tie else best
