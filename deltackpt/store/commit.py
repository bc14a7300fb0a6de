"""The steps of :meth:`Store.commit` before its manifest put: index the save's packs, check that every chunk
the checkpoint references can be restored, build the manifest.

The check costs what the save touched, not what the store holds: a ChunkWriter looked each chunk it
reused up once (under the store lock, with its delta base) and reports the packs it found them in
(``WriteSummary.reused_packs``); the commit then only checks that those packs still exist, a stat each.
The chunks of the parent checkpoint are not even looked up when the writer was handed the packs that held
them at the parent's own commit (a Store remembers them from its last commit): those packs join the report.
Without that report (a caller assembling items itself) every referenced chunk is looked up. Either way a
pack gone since (damage, or a gc that ran behind a stale cache) sends the commit to the full look-up after
an index refresh, and a chunk still missing then is a MissingChunkError: nothing is committed.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

from ..errors import MissingChunkError
from .chains import chain_entries, chain_packs, needed_ids, restorable
from .config import chain_limit
from .crashpoints import crash_point
from .manifest import Item, Manifest, Stats
from .pack import PackEntry, pack_key, read_pack_entries


def index_new_packs(store, entries: Iterable[PackEntry] | None, packs: dict[str, int]) -> list[PackEntry]:
    """Record the save's packs (and their entries, read from the pack tables unless given) in the index."""
    if entries is None:
        entries = [e for p, size in packs.items() for e in read_pack_entries(store.backend, p, size)]
    entries = list(entries)
    store.index.clear_damaged(packs)  # written from memory by this save
    crash_point("commit:before-index")
    _index_rewritten_chunks(store, store.index.add(entries, packs))
    crash_point("commit:after-index")
    return entries


def check_chunks(store, name: str, items: list[Item], entries: list[PackEntry], packs: dict[str, int],
                 checked_packs: Iterable[str] | None = None) -> set[str] | None:
    """Raise MissingChunkError unless every chunk ``items`` reference, and its delta base, is indexed in a
    pack that exists (``packs``: this save's, just indexed). ``checked_packs``: see the module docstring.
    Returns the packs found to hold all those chunks when ``checked_packs`` sufficed, else None."""
    present = set(packs)
    if checked_packs is not None:
        # Only the packs this save points into, a stat each: listing every pack of a long run's store took
        # 53 ms at 10,000 packs, on the coordinator's commit of every save.
        checked = set(checked_packs)
        if all(store.backend.exists(pack_key(p)) for p in checked - present):
            return checked | present
    wanted = {ref.id for it in items for ref in it.chunks}
    missing = _missing_chunks(store, wanted, present)
    if missing:
        # Another process may be rebuilding the index cache (it drops it first): re-index, look again.
        store.index.refresh()
        store.index.add(entries, packs)
        missing = _missing_chunks(store, wanted, present)
    if missing:
        cid = next(iter(missing))
        owner = next((it.key for it in items if any(r.id == cid for r in it.chunks)), None)
        raise MissingChunkError(cid.hex(), checkpoint=name, item=owner)
    return None


def build_manifest(store, name: str, items: list[Item], *, entries: list[PackEntry], packs: Mapping[str, int],
                   parent: str | None, metadata: Mapping[str, Any] | None, layer_data: Mapping[str, Any] | None,
                   created_ns: int | None, after_ns: int | None = None) -> Manifest:
    stats = Stats(
        logical_bytes=sum(it.nbytes for it in items),
        stored_bytes=sum(packs.values()),
        num_chunks=sum(len(it.chunks) for it in items),
        new_chunks=len(entries),
    )
    return Manifest(
        name=name,
        store_id=store.config.store_id,
        # A copy keeps the source's time; a save is made after the newest checkpoint it saw, even on a host
        # whose clock is behind the one that made that checkpoint.
        created_ns=created_ns or max(time.time_ns(), after_ns + 1 if after_ns is not None else 0),
        parent=parent if parent != name else None,
        items=items,
        stats=stats,
        metadata=dict(metadata or {}),
        layer_data=dict(layer_data or {}),
    )


def _missing_chunks(store, wanted: set[bytes], present: set[str]) -> set[bytes]:
    """Which of ``wanted`` or their delta bases are not indexed in an existing pack (``present``: packs
    known to exist, e.g. the ones this save just wrote and indexed)."""
    # Delta bases (down each chain) must survive too; and every pack we point into must still exist.
    found = chain_entries(store.index, wanted, chain_limit(store.config))
    missing = (wanted | needed_ids(found)) - found.keys()
    if not missing:
        gone = {p for p in {e.pack for e in found.values()} - present if not store.backend.exists(pack_key(p))}
        missing = {cid for cid, e in found.items() if e.pack in gone}
    return missing


def _index_rewritten_chunks(store, entries: list[PackEntry]) -> None:
    """Point the index at this save's copy of a chunk whose indexed copy cannot be restored: the writer
    wrote it again because it was a delta whose base is gone. ``entries``: those the index kept another
    copy of (Index.add returns them; the rest are indexed where this save put them)."""
    if not entries:
        return
    index = store.index
    indexed = index.lookup_many({e.chunk_id for e in entries})
    others = [e for e in entries if (old := indexed.get(e.chunk_id)) is not None and old != e
              and old.base_id is not None]  # another copy, a delta: is its chain whole?
    if not others:
        return
    limit = chain_limit(store.config)
    found = chain_entries(index, {e.chunk_id for e in others}, limit)
    damaged = index.damaged_packs()  # a chain through a pack a read found damaged is no whole chain either
    own = [e for e in others if not restorable(e.chunk_id, found, limit)
           or (damaged and chain_packs(e.chunk_id, found, limit) & damaged)]
    if own:
        index.relocate(own, {})

