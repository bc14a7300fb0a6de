"""Catching an index cache up to a commit: through the commit log's records when they vouch for every commit
the cache missed (a request each), else through a listing of every pack (:meth:`Store.index_as_of`).

The records' format and the walk that vouches for them are in :mod:`.commitlog`.
"""

from __future__ import annotations

from .commitlog import Commit, read_commit_record, records_since
from .index import ChunkIndex, read_gc_epoch


def catch_up(index: ChunkIndex, backend, store_id: str, head: str | None) -> None:
    """Index the packs committed since the cache's last commit up to ``head``: from the commit records
    when they vouch for every commit in between (a request each), else from a listing of every pack."""
    if head is None:
        index.refresh()
        return
    seen = index.last_commit()
    # Read before any listing: the packs of the commit it names were published before it.
    record = read_commit_record(backend, head, store_id)
    records = None
    if record is not None and seen is not None:
        records = records_since(backend, store_id, record, seen)
    if records is None:
        index.refresh()
    else:
        packs, tables = {}, {}
        epoch = read_gc_epoch(backend)
        for r in records:  # newest first: a chunk keeps the first location found, as in a rebuild
            for pack, size in r.packs.items():
                packs.setdefault(pack, size)
            if r.epoch == epoch:  # else a gc since may have deleted some: their own tables tell
                for pack, rows in r.tables.items():
                    tables.setdefault(pack, rows)
        index.add_packs(packs, tables)
    index.set_last_commit(Commit(head, record.created_ns if record is not None else None))
