"""mark: gc's live set, the chunks the manifests reference plus the delta bases those chunks need.

Down each chain: a base is live while any live delta needs it. The set is a sorted numpy array of 16-byte ids
(:mod:`.idset`: 16 bytes a chunk, not a Python object each), so stores with millions of chunks stay within
tens of MB. The chains are followed in the pack tables, which gc's sweep reads anyway (:func:`mark_live`: one
vectorised pass over every entry per level); only a chunk no table holds is looked up in the index (and when
a table could not be read, every live chunk is, as :func:`with_chain_bases` does). A mark costs O(live
chunks + pack entries), and reads no index record per chunk.
"""

from __future__ import annotations

import numpy as np

from ..errors import CheckpointNotFoundError
from . import idset
from .pack import PackTable, read_pack_table
from .progress import Progress, phase
from .threads import ordered_map, table_read_threads

def live_chunk_ids(store, names=None) -> np.ndarray:
    """Sorted unique ids (dtype ``V16``, see :mod:`.idset`) of every chunk a manifest references, plus their
    delta bases (looked up in the index); of the checkpoints ``names`` only, if given."""
    return with_chain_bases(store, manifest_ids(store, names))


def manifest_ids(store, names=None) -> np.ndarray:
    """Sorted unique ids of every chunk the manifests (of the checkpoints ``names`` only, if given) reference."""
    refs = idset.Collector()
    for name in store.checkpoint_names() if names is None else names:
        try:
            store.add_manifest_ids(name, refs)
        except CheckpointNotFoundError:
            continue  # forgotten since it was listed (forget takes no lock): it makes nothing live
    return refs.result()


def with_chain_bases(store, live: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    """``live`` (sorted unique V16 ids) with ``ids`` (default: those of ``live`` itself) and the delta bases
    they need added, down each chain (a base is live while any live delta needs it): one batched index
    look-up per level, to the end of every chain: not the limit of the config this Store read at open, which
    another process may have raised since, nor even ``MAX_CHAIN``: a chain too deep to read is verify's to
    report, and a base left unmarked is deleted for good. (It ends: each level adds ids not yet live.)"""
    frontier = live if ids is None else idset.unique(ids)
    live = live if ids is None else idset.union(live, frontier)
    while True:
        bases = idset.unique(store.index.locate(frontier).delta_base)
        frontier = bases[~idset.isin(live, bases)]
        if not frontier.size:
            break
        live = idset.union(live, frontier)
    return live


def mark_live(store, live: np.ndarray, pins: np.ndarray, ids: np.ndarray, bases: np.ndarray,
          has_base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``live`` (sorted unique V16 ids) and ``pins`` (any order) with the delta bases they need, down each
    chain as :func:`with_chain_bases` follows them, read from the pack tables: ``ids``, ``bases`` and
    ``has_base`` of every entry of every pack (all read); and the position of each entry's chunk in that
    set (-1: dead). A chunk no table holds (its pack unreadable, or published after the listing) is looked
    up in the index. Every copy of a chunk counts: where two copies were coded differently, the bases of
    both stay. One search of the whole set (a level's new bases are searched on their own, and the
    positions found shifted past them): no index record read per live chunk (1.2M chunks: 1.0 s of LMDB
    look-ups saved), no second pass over the set (a cache miss an entry)."""
    frontier = live = idset.union(live, pins)
    pos = idset.find(live, ids)
    fpos = pos  # each entry's position in the frontier
    while True:  # to the end of every chain, as with_chain_bases
        hit = fpos >= 0
        held = np.zeros(frontier.size, dtype=bool)
        held[fpos[hit]] = True
        found = [bases[hit & has_base]]
        if not held.all():
            found.append(store.index.locate(frontier[~held]).delta_base)
        new = idset.unique(np.concatenate(found))
        frontier = new[~idset.isin(live, new)]
        if not frontier.size:
            break
        live = idset.union(live, frontier)
        at = idset.find(live, frontier)  # where the new ids went: each shifts the positions past it by one
        # shift[p]: how many new ids went before old position p (a count and a running sum over the old set:
        # linear, where a search of the sorted insertion points per entry cost 0.125 s at 1.2M entries).
        shift = np.cumsum(np.bincount(at - np.arange(at.size), minlength=live.size - at.size + 1))
        old = pos >= 0
        pos[old] += shift[pos[old]]
        fpos = idset.find(frontier, ids)
        pos[fpos >= 0] = at[fpos[fpos >= 0]]
    return live, pos


def read_tables(store, listed: dict, progress: Progress | None = None) -> dict[str, PackTable]:
    def read(name: str) -> PackTable | None:
        try:
            return read_pack_table(store.backend, name, listed[name].size_bytes)
        except Exception:  # noqa: BLE001 - an unreadable pack is verify's business; gc leaves it alone
            return None

    tables = {}
    threads = table_read_threads(store.backend)
    with phase(progress, "gc plan", len(listed), "pack") as bar:
        for name, table in zip(listed, ordered_map(read, listed, threads)):
            bar.advance(1)
            if table is not None:
                tables[name] = table
    return tables


def delta_bases(store, listed: dict) -> np.ndarray:
    """The delta bases the entries of the packs ``listed`` need (V16 ids)."""
    return concat([t.base_ids[t.has_base] for t in read_tables(store, listed).values()])


def concat(arrays: list[np.ndarray], dtype=idset.ID) -> np.ndarray:
    """The arrays end to end (an empty one of ``dtype`` when there are none)."""
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)
