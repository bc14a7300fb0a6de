"""repack: copy live pack entries byte for byte (no re-encoding) into new packs of the target size.

gc repacks a pack whose dead fraction is too high and merges small packs this way; repair rebuilds a
damaged pack's intact entries with it. The index is pointed at each new pack as it is published, and gc
records the packs it wrote in the commit log (:mod:`.commitlog`), so an empty cache reads their tables there.
"""

from __future__ import annotations

import logging

from ..errors import DeltackptError
from . import commitlog
from .backend import spool_for
from .crashpoints import crash_point
from .pack import HEADER_SIZE, PackBuilder, PackEntry, pack_bytes_ok, pack_key

log = logging.getLogger("deltackpt.store")


def repack_packs(store, repack: dict[str, list[PackEntry]], bar=None,
                 written: dict[str, tuple[int, list[PackEntry]]] | None = None, *,
                 check: bool = False) -> tuple[int, set[str], set[str]]:
    """Copy the live entries of the packs ``repack`` (name -> entries) into new packs of the target size,
    shared by all of them (small packs merge), and point the index at them; ``written`` gets each new pack's
    size and entries. ``check``: a pack whose bytes no longer hash to its name is not copied (gc: its damage
    would move into a pack with a valid hash, which verify's default level then passed), but marked damaged
    and left as it is for verify and repair.

    Returns (entries moved, names of the packs published, names of the damaged packs left)."""
    target = store.config.pack_target_bytes
    moved, names = 0, set()
    # Bytes are copied, not decoded (with ``check``, only from a pack that hashes to its name): chunks of a pack
    # a read found damaged stay distrusted where they go.
    tainted = bool(store.index.damaged_packs() & repack.keys())

    def flush(b: PackBuilder) -> None:
        nonlocal moved
        name, size, new_entries = b.publish(store.backend)
        if tainted:
            store.index.mark_damaged([name])
        store.index.relocate(new_entries, {name: size})
        if written is not None:
            written[name] = (size, new_entries)
        moved += len(new_entries)
        names.add(name)
        crash_point("gc:after-repack")

    builder = PackBuilder(spool_for(store.backend))
    damaged = set()
    for old, entries in sorted(repack.items()):
        data = store.backend.get(pack_key(old))
        if check and not pack_bytes_ok(old, data):
            log.warning("gc: pack %s does not hash to its name (damaged): not repacked, left for verify and "
                        "repair", old)
            store.index.mark_damaged([old])
            damaged.add(old)
            if bar is not None:
                bar.advance(1)
            continue
        for e in entries:
            payload = memoryview(data)[e.offset + HEADER_SIZE : e.offset + HEADER_SIZE + e.stored_len]
            builder.add(e.chunk_id, e.codec, e.elem_size, e.raw_len, payload, e.base_id, e.age)
            if builder.size_bytes >= target:
                flush(builder)
                builder = PackBuilder(spool_for(store.backend))
        if bar is not None:
            bar.advance(1)
    if len(builder):
        flush(builder)
    else:
        builder.discard()
    return moved, names, damaged


def log_repacks(store, epoch: bytes, written: dict[str, tuple[int, list[PackEntry]]]) -> None:
    """Write the commit log's record of the packs the repacks wrote (a hint: a failure is logged)."""
    key, data = commitlog.gc_record(store.config.store_id, epoch, written)
    try:
        store.backend.put_transient(key, data)
    except (OSError, DeltackptError) as exc:
        log.warning("gc: record of the repacked packs not written (%s: %s)", type(exc).__name__, exc)
