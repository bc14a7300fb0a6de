"""Where the previous checkpoint kept each global byte range of each group (tensor).

A save consults its parent checkpoint to reuse chunks whose content did not change even when the chunk
boundaries moved: after resharding (2 ranks -> 3), a shard boundary cuts a grid cell in two, and each piece
is referenced as a *slice* of the parent's chunk (``ChunkRef.skip``) once its bytes are checked equal,
instead of being stored again. The delta codec uses the same map to find a changed chunk's base.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .manifest import Manifest


@dataclass(frozen=True, slots=True)
class Extent:
    """Global bytes ``[start, end)`` of a group are bytes ``[skip, skip + end - start)`` of chunk ``chunk_id``."""

    start: int
    end: int
    chunk_id: bytes
    skip: int


class ParentMap:
    """Group name -> sorted extents of the parent checkpoint's array items."""

    def __init__(self, manifest: Manifest | None) -> None:
        self.name = manifest.name if manifest is not None else None
        self._items: dict[str, list] = {}
        if manifest is not None:
            for it in manifest.items:
                if it.kind == "array":
                    self._items.setdefault(it.group_name, []).append(it)
        self._built: dict[str, tuple[list[int], list[Extent]]] = {}

    def __bool__(self) -> bool:
        return bool(self._items)

    def _extents(self, group: str) -> tuple[list[int], list[Extent]]:
        hit = self._built.get(group)
        if hit is None:
            extents = []
            for it in self._items.get(group, ()):
                pos = it.global_offset
                for ref in it.chunks:
                    if ref.length:
                        extents.append(Extent(pos, pos + ref.length, ref.id, ref.skip))
                    pos += ref.length
            extents.sort(key=lambda e: e.start)
            hit = self._built[group] = ([e.start for e in extents], extents)
        return hit

    def exact(self, group: str, start: int, end: int) -> Extent | None:
        """The parent's extent with exactly these bounds, if any."""
        starts, extents = self._extents(group)
        i = bisect.bisect_left(starts, start)
        if i < len(extents) and extents[i].start == start and extents[i].end == end:
            return extents[i]
        return None

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
