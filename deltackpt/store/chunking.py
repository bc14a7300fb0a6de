"""Where items are cut into chunks.

Array items are cut on a fixed grid of ``chunk_size`` bytes in the *global* byte space of their group
(a tensor shard at global offset 3 MiB + 100 bytes gets a first, short chunk up to 4 MiB, then whole
chunks), so the same content at the same place of a tensor gives the same chunk whatever shard it came
from. Opaque byte items (pickled Python objects) have no coordinates; they are cut with FastCDC so an
insertion only changes the chunks around it.
"""

from __future__ import annotations

import xxhash

from .. import kernels


def grid_spans(global_offset: int, nbytes: int, chunk_size: int) -> list[tuple[int, int]]:
    """Item-relative (start, end) spans cut where ``global_offset + pos`` is a multiple of ``chunk_size``."""
    if nbytes == 0:
        return []
    first_end = min(chunk_size - (global_offset % chunk_size), nbytes)
    if first_end == nbytes:
        return [(0, nbytes)]
    cuts = [0, *range(first_end, nbytes, chunk_size), nbytes]
    return list(zip(cuts, cuts[1:]))


def cdc_spans(data, min_size: int, avg_size: int, max_size: int) -> list[tuple[int, int]]:
    """Content-defined (start, end) spans of ``data``."""
    if len(data) == 0:
        return []
    cuts = kernels.fastcdc_cuts(data, min_size, avg_size, max_size).tolist()
    starts = [0] + cuts[:-1]
    return list(zip(starts, cuts))


def chunk_id_of(view) -> bytes:
    """A chunk's id: the xxh3-128 digest (16 bytes) of its raw bytes."""
    return xxhash.xxh3_128_digest(view)


def chunk_ids_of(view, spans) -> list[bytes]:
    """The ids of ``view``'s (start, end) spans, as :func:`chunk_id_of` (one call for a batch of spans)."""
    digest = xxhash.xxh3_128_digest
    return [digest(view[s:e]) for s, e in spans]


def as_byte_view(data) -> memoryview:
    """A flat byte view of any C-contiguous buffer (bytes, bytearray, numpy array, memoryview)."""
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("item data must be C-contiguous; call numpy.ascontiguousarray first")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B") if mv.nbytes else memoryview(b"")
    return mv
