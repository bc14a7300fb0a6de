"""verifystructure: verify's level 0, where every needed chunk is and whether its delta chain is whole.

Every chunk a manifest references (a *user*) is located in the index (or a snapshot of its records) a block
at a time; a user in no pack present is reported by what became of it. The bases of the users' deltas are
needed too, and in a store with delta chains the chunks down their chains: each gets a *node* number (the
users, then those extra bases), and the chains are walked a level at a time in arrays of node numbers
(:class:`Findings`), never a Python object per chunk. A delta whose chain does not end in a keyframe in a
pack present, within the store's chain limit, is a ``bad-base`` problem. A chunk some ref reads past its end
(the largest end of its refs, gathered with the ids, against its size in the index) is a ``manifest`` problem
of each checkpoint with such a ref: the chunk is sound, the manifest is not (a load refuses it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..errors import DeltackptError
from . import idset
from .config import chain_limit
from .pack import PackEntry, PackTable
from .progress import phase
from .verifyreport import Problem, ProblemKind

_BLOCK = 1 << 12  # ids per vectorised pass where a pass's temporaries would otherwise grow with all the ids
_LOCATE_BLOCK = 1 << 10  # ids located per call: its records (~210 B an id) and the packs they name held at once
_KEYFRAME, _UNFOLLOWED = -1, -2  # Findings.node_base of a chunk that is no delta (or not found), of a chain's end


@dataclass
class Findings:
    """What the phases learn and hand on to the next ones. Chunk ids are sorted 16-byte arrays
    (:mod:`.idset`), never a Python object per chunk or per reference: memory O(unique chunks)."""

    names: list[str] = field(default_factory=list)  # checkpoints whose manifest reads
    users: np.ndarray = field(default_factory=lambda: idset.from_ids(b""))  # chunks the manifests reference
    # uint32 per user: the largest end (skip + length) of a ref to it; compared with its size as the structure
    # check locates it, then its memory holds the user's base node (:class:`_Bases`).
    user_ends: np.ndarray | None = None
    overruns: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # chunk read past its end -> (end, size)
    extra_bases: np.ndarray = field(default_factory=lambda: idset.from_ids(b""))  # other chunks down their chains
    # Per node (users, then extra_bases): whether it is in a pack present, and the node of its base when it is a
    # delta in a pack present (_KEYFRAME: none; _UNFOLLOWED: a delta whose base was not looked up). 5 bytes a
    # chunk: chains are walked in arrays of node numbers, never an id per delta.
    node_ok: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=bool))
    node_base: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    bad: dict[bytes, Problem] = field(default_factory=dict)  # the first problem found with each chunk
    # Copies that do not decode of chunks whose located copy does (a gc cut short left a delta without its
    # base; a save wrote the chunk again): reported, but no checkpoint reads them.
    stray: list[Problem] = field(default_factory=list)
    live_packs: set[str] = field(default_factory=set)  # packs holding a needed chunk, or unreadable
    chunks_in: dict[str, int] = field(default_factory=dict)  # pack -> needed chunks it holds
    # Packs whose hash or table is bad: their problem, and the entries found in them.
    damaged_packs: dict[str, tuple[Problem, PackTable]] = field(default_factory=dict)
    # (pack, chunk id) -> the entry of each copy that did not decode (decoded again when a gc ran meanwhile).
    copies: dict[tuple[str, bytes], PackEntry] = field(default_factory=dict)

    def needed(self, ids: np.ndarray) -> np.ndarray:
        """A bool per id: whether a checkpoint needs it (references it, or a delta it references has it as base)."""
        return idset.isin(self.users, ids) | idset.isin(self.extra_bases, ids)



def reconciled(index, moved: dict, progress):
    """Reconcile the cache with the pack tables (``moved`` as ``ChunkIndex.reconcile`` fills it); returns what
    to locate chunks with: the snapshot of the records it left, or the index when it rebuilt instead."""
    snapshot: list = []
    index.reconcile(progress=progress, moved=moved, snapshot=snapshot)
    return snapshot[0] if snapshot else index



def _moved_first(moved: dict[bytes, str], seen):
    """``seen`` after a reconcile that moved or dropped the records of ``moved`` (chunk id -> pack before)."""
    return lambda i, cid: moved.get(cid) or seen(i, cid)


def check_structure(store, found: Findings, seen, packs, level: int, records, progress) -> None:
    """Level 0: every needed chunk is indexed, in an existing pack, with an intact base; and which packs
    hold the needed chunks. ``records``: what locates chunks (the index, or a snapshot of its records)."""
    index, users = store.index, found.users
    bases = _Bases(found)
    with phase(progress, "verify structure", users.size, "chunk") as bar:
        base, present, held, absent, outside = _locate_users(records, users, packs, bases)
        if level == 0 and absent:
            # After a refresh the cache knows exactly the packs present; a record missing or pointing elsewhere
            # may mean the cache itself is damaged (a record well-formed but wrong, or under a wrong key),
            # which is not damage to the store: check it against the pack tables and look again.
            moved: dict[bytes, str] = {}
            records = reconciled(index, moved, progress)
            base, present, held, absent, outside = _locate_users(records, users, packs, bases)
            seen = _moved_first(moved, seen)
        bar.advance(users.size)
    del bases
    unreadable = _absent(found, absent, seen, packs)
    # Deltas in a pack present: their bases are needed too, and must be keyframes in a pack present.
    base[~present] = _KEYFRAME
    at = np.concatenate([o[0] for o in outside] + [np.empty(0, np.int32)])
    ids = np.concatenate([o[1] for o in outside] + [idset.from_ids(b"")])
    keep = present[at]
    at, ids = at[keep], ids[keep]
    limit = chain_limit(store.config)
    found.extra_bases = extra = _down_the_chains(records, users, ids, limit)
    extra_base, extra_present, extra_held = _locate_extras(records, users, extra, packs)
    base[at] = users.size + idset.find(extra, ids)
    del at, ids, keep
    found.node_ok = np.concatenate([present, extra_present])
    del present, extra_present
    base.resize(users.size + extra.size, refcheck=False)  # in place: the users' bases, then the extras'
    base[users.size:] = extra_base
    found.node_base = base
    _check_bases(store, found, limit)
    found.live_packs = set(unreadable)
    for name, n in (held + extra_held).items():
        if n:
            found.live_packs.add(name)
            found.chunks_in[name] = n


def pack_numbers(index, ids: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(pack names, the number of the pack holding each of ``ids``: -1 where not indexed)."""
    names: dict[str, int] = {}
    pack_of = np.empty(ids.size, dtype=np.int32)

    def block(start, loc):
        number = np.array([names.setdefault(p, len(names)) for p in loc.packs] + [-1], dtype=np.int32)
        pack_of[start:start + loc.pack_of.size] = number[loc.pack_of]  # pack_of -1: the last, -1

    index.locate_each(ids, block, _LOCATE_BLOCK)
    return list(names), pack_of


def _locate(index, ids: np.ndarray, packs, deltas, sizes=None):
    """(a bool per id: indexed in a pack present; pack -> ids it holds; [(position, pack or None)] of the
    others; what ``deltas(positions, base ids)`` returned for each block's deltas, None left out). Located a
    block at a time: no pass holds every delta's base id, nor a pack number per id. ``sizes(start, indexed,
    raw_len)``: told each block's chunks' sizes (``indexed``: a bool per id of the block), before ``deltas``."""
    present = np.empty(ids.size, dtype=bool)
    held: Counter = Counter()
    absent: list[tuple[int, str | None]] = []
    told: list = []

    def block(start, loc):
        if start == 0:  # the first block, or the first again after the cache was repaired: start over
            held.clear(), absent.clear(), told.clear()
        exists = np.array([p in packs for p in loc.packs] + [False], dtype=bool)  # pack_of -1: the last, False
        here = exists[loc.pack_of]
        present[start:start + here.size] = here
        counts = np.bincount(loc.pack_of[loc.pack_of >= 0], minlength=len(loc.packs))
        held.update(dict(zip(loc.packs, counts.tolist())))
        absent.extend((start + i, loc.packs[loc.pack_of[i]] if loc.pack_of[i] >= 0 else None)
                      for i in np.flatnonzero(~here).tolist())
        if sizes is not None:  # first: deltas may write over what it reads
            sizes(start, loc.pack_of >= 0, loc.raw_len)
        out = deltas(loc.delta_at + start, loc.delta_base)
        if out is not None:
            told.append(out)

    index.locate_each(ids, block, _LOCATE_BLOCK)
    return present, held, absent, told


class _Bases:
    """The users' base nodes, an int32 each, in the memory of their ends (``found.user_ends``) where there
    are any: a block's ends are compared with its chunks' sizes (:meth:`sizes`, which ``_locate`` calls
    first), then the block's bases are written over them; 4 bytes a user for both. Each indexed user a ref
    reads past its end goes to ``found.overruns``."""

    def __init__(self, found: Findings) -> None:
        self.found, self.base = found, found.user_ends
        found.user_ends = None
        if self.base is not None:
            self.base.dtype = np.int32  # the same memory; each block's ends are read before it is written
        self.upto = 0  # the users compared: their ends are gone (a second locate: the cache was repaired)
        self.later: dict[int, int] = {}  # user -> its end, of the users not indexed when compared

    def start(self, n: int) -> tuple[np.ndarray, object]:
        """(the bases, the ``sizes`` callback or None) for a locate of the ``n`` users."""
        if self.base is None:
            return np.full(n, _KEYFRAME, dtype=np.int32), None
        return self.base, self.sizes

    def sizes(self, start: int, indexed: np.ndarray, raw_len: np.ndarray) -> None:
        # A chunk's size is its content's: a record of a pack since repacked still tells it right.
        found, base, n = self.found, self.base, indexed.size
        if start >= self.upto:
            need = base[start:start + n].view(np.uint32)
            for i in np.flatnonzero(indexed & (need > raw_len)).tolist():  # rare: damage
                found.overruns[found.users[start + i].tobytes()] = (int(need[i]), int(raw_len[i]))
            self.later.update(zip((start + np.flatnonzero(~indexed)).tolist(), need[~indexed].tolist()))
            self.upto = start + n
        else:
            for k in [k for k in self.later if start <= k < start + n and indexed[k - start]]:  # indexed now
                end = self.later.pop(k)
                if end > raw_len[k - start]:
                    found.overruns[found.users[k].tobytes()] = (end, int(raw_len[k - start]))
        base[start:start + n] = _KEYFRAME


def _locate_users(index, users: np.ndarray, packs, bases: _Bases):
    """(the node of each user's base when it is a user, else _KEYFRAME; then as :func:`_locate`, the last part
    the (positions, base ids) of the deltas whose base is no user); ``bases``: where the bases go, and the
    check of the users' sizes."""
    base, sizes = bases.start(users.size)

    def deltas(at, ids):
        pos = idset.find(users, ids)
        inside = pos >= 0
        base[at[inside]] = pos[inside]
        return (at[~inside], ids[~inside]) if not inside.all() else None

    return (base, *_locate(index, users, packs, deltas, sizes))


def _down_the_chains(index, users: np.ndarray, roots: np.ndarray, limit: int) -> np.ndarray:
    """The needed chunks that are no users: ``roots`` (bases of the users' deltas), and in a store with delta
    chains the chunks down their chains, ``limit`` levels at most; sorted unique."""
    extra = frontier = idset.unique(roots)
    for _ in range(limit if limit > 1 else 0):
        b = index.locate(frontier).delta_base
        new = idset.unique(b[~(idset.isin(users, b) | idset.isin(extra, b))])
        if not new.size:
            break
        extra, frontier = idset.union(extra, new), new
    return extra


def _locate_extras(index, users: np.ndarray, extra: np.ndarray, packs):
    """(the node of each of ``extra``'s base: a user, an extra (after the users), _UNFOLLOWED when neither
    (past the chain limit), _KEYFRAME when it is no delta; a bool per extra: in a pack present; pack -> extras
    it holds)."""
    base = np.full(extra.size, _KEYFRAME, dtype=np.int32)

    def deltas(at, ids):
        node = idset.find(users, ids).astype(np.int32)
        no_user = node < 0
        pos = idset.find(extra, ids[no_user])
        node[no_user] = np.where(pos >= 0, users.size + pos, _UNFOLLOWED)
        base[at] = node

    present, held, _, _ = _locate(index, extra, packs, deltas)
    return base, present, held


def _absent(found: Findings, absent: list, seen, packs) -> set[str]:
    """Report each user in no pack present (``absent``: position, pack indexed in or None) by what became of
    it (``seen``: see :func:`.verify._refresh_cache`); returns the packs whose table is unreadable."""
    unreadable: set[str] = set()
    for i, pack in absent:
        cid = found.users[i].tobytes()
        if pack is not None:
            found.bad[cid] = Problem(ProblemKind.MISSING_PACK, "pack holding the chunk is missing", pack=pack,
                                     chunk_id=cid.hex())
            continue
        gone = seen(i, cid)
        if gone is not None and gone not in packs:
            found.bad[cid] = Problem(ProblemKind.MISSING_PACK, "pack holding the chunk is missing", pack=gone,
                                     chunk_id=cid.hex())
        elif gone is not None:
            found.bad[cid] = Problem(ProblemKind.BAD_CHUNK, "its pack's table is unreadable", pack=gone,
                                     chunk_id=cid.hex())
            unreadable.add(gone)
        else:
            found.bad[cid] = Problem(ProblemKind.MISSING_CHUNK, "chunk is not in any pack", chunk_id=cid.hex())
    return unreadable


def node_id(found: Findings, node: int) -> bytes:
    n = found.users.size
    return (found.users[node] if node < n else found.extra_bases[node - n]).tobytes()


def user_deltas(found: Findings):
    """(user deltas in a pack present, their bases' nodes) a block of users at a time."""
    base, n = found.node_base, found.users.size
    for lo in range(0, n, _BLOCK):
        at = lo + np.flatnonzero(base[lo:min(n, lo + _BLOCK)] >= 0)
        yield at, base[at]


def _check_bases(store, found: Findings, limit: int = 1) -> None:
    """A delta's base must be indexed, in a pack present, and a keyframe; in a store with delta chains, a
    delta whose own chain (at most ``limit`` deltas in all, no cycle) ends in one. The chains are walked a
    level at a time in arrays; the few that fail are walked again one by one to say how."""
    ok, base = found.node_ok, found.node_base
    for at, cur in user_deltas(found):
        depth = 1
        while at.size:
            below = base[cur]
            here = ok[cur]
            wrong = ~here | ((below != _KEYFRAME) & (depth >= limit))
            for d in at[wrong].tolist():
                cid = found.users[d].tobytes()
                entry = store.index.lookup(cid)  # rare: its pack is not kept for every chunk
                found.bad[cid] = Problem(ProblemKind.BAD_BASE, _chain_problem(found, d, limit),
                                         pack=entry.pack if entry is not None else None, chunk_id=cid.hex())
            go = here & (below >= 0) & (depth < limit)
            at, cur, depth = at[go], below[go], depth + 1


def _chain_problem(found: Findings, d: int, limit: int) -> str:
    """What is wrong down the chain of user delta ``d`` (known to be wrong)."""
    ok, base = found.node_ok, found.node_base
    cur, depth, seen = int(base[d]), 1, {d}
    while True:
        cid = node_id(found, cur).hex()
        below = "" if depth == 1 else f" ({depth} deltas down its chain)"
        if not ok[cur]:
            return f"base chunk {cid} is missing{below}"
        if depth >= limit:
            return (f"base chunk {cid} is itself a delta" if limit == 1
                    else f"delta chain holds more than {limit} deltas")
        if cur in seen:
            return f"delta chain meets itself at base chunk {cid}"
        seen.add(cur)
        cur, depth = int(base[cur]), depth + 1


def overrun_problems(store, found: Findings) -> list[Problem]:
    """A ``manifest`` problem for each checkpoint with a ref that reads a chunk past its end (``found.overruns``),
    naming its items that do: the manifests are read again, only when there is such a chunk (rare)."""
    if not found.overruns:
        return []
    wanted = idset.unique(idset.from_ids(list(found.overruns)))
    size_of = np.array([found.overruns[w.tobytes()][1] for w in wanted], dtype=np.int64)
    problems = []
    for name in found.names:
        try:
            refs = store.read_manifest_refs(name, with_ends=True)
            pos = idset.find(wanted, refs.ids)
            hits = np.flatnonzero(pos >= 0)
            hits = hits[refs.ends[hits] > size_of[pos[hits]]]
            items = store.read_manifest(name).items if hits.size else []
        except DeltackptError:
            continue  # forgotten or damaged since the first read
        if not hits.size or len(items) != refs.item_end.size:
            continue  # none past its chunk's end, or replaced between the two reads
        at = np.searchsorted(refs.item_end, hits, side="right").tolist()
        first = int(hits[0])
        cid = refs.ids[first].tobytes()
        problems.append(Problem(
            ProblemKind.MANIFEST, f"item {items[at[0]].key!r}: a chunk ref reads bytes up to "
            f"{int(refs.ends[first])} of chunk {cid.hex()} of {found.overruns[cid][1]} bytes", checkpoints=[name],
            items=sorted({f"{name}:{items[i].key}" for i in at})))
    return problems
