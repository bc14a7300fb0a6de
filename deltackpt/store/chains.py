"""Delta chains: the chunks a delta needs to be restored.

A delta is coded against a base chunk; in a store with the feature ``delta-chains`` that base may itself be a
delta, so restoring a chunk needs every chunk down its chain to a keyframe (at most
``config.chain_limit(cfg)`` deltas: ``MAX_CHAIN`` with the feature, else 1; a store's own writer stops at its
``max_chain``). Saves (what may be deduplicated against), commits (what must exist), copies (what to send), gc
(what stays live) and verify (what is needed) all ask the same question: :func:`chain_entries` answers it
with one batched index look-up per level of the chains.
"""

from __future__ import annotations

from .config import MAX_CHAIN
from .pack import PackEntry


def chain_entries(index, ids, limit: int = MAX_CHAIN) -> dict[bytes, PackEntry]:
    """Index entries of ``ids`` and of every base their deltas need, transitively (``limit`` levels at most;
    a cycle ends where it meets a chunk already found). Chunks not indexed are simply absent."""
    found = index.lookup_many(set(ids))
    frontier = {e.base_id for e in found.values() if e.base_id is not None} - found.keys()
    for _ in range(limit):
        if not frontier:
            break
        more = index.lookup_many(frontier)
        found.update(more)
        frontier = {e.base_id for e in more.values() if e.base_id is not None} - found.keys()
    return found


def needed_ids(found: dict[bytes, PackEntry]) -> set[bytes]:
    """Every chunk the entries ``found`` (from :func:`chain_entries`) need: themselves and their bases."""
    return found.keys() | {e.base_id for e in found.values() if e.base_id is not None}


def restorable(cid: bytes, found: dict[bytes, PackEntry], limit: int) -> bool:
    """Whether chunk ``cid`` can be restored from the entries ``found``: it and every base down its chain
    are there, the chain holds at most ``limit`` deltas and no cycle."""
    entry = found.get(cid)
    for _ in range(limit + 1):
        if entry is None:
            return False
        if entry.base_id is None:
            return True
        entry = found.get(entry.base_id)
    return False


def chain_packs(cid: bytes, found: dict[bytes, PackEntry], limit: int) -> set[str]:
    """The packs of chunk ``cid`` and the bases down its chain in ``found`` (at most ``limit`` deltas)."""
    packs, entry = set(), found.get(cid)
    for _ in range(limit + 1):
        if entry is None:
            break
        packs.add(entry.pack)
        entry = found.get(entry.base_id) if entry.base_id is not None else None
    return packs
