"""verify: prove a store's contents are intact, and say what any damage affects.

Levels (each includes the ones below):

0. structure: every manifest parses; every chunk a manifest references is indexed and its pack exists;
   every delta's chain of bases exists down to a keyframe, within the store's chain limit (a delta's base
   is a keyframe unless the store has the feature ``delta-chains``).
1. packs: every pack's bytes hash to its name.
2. data: every chunk is decoded (deltas through their bases) and re-hashed.

Levels 1 and 2 can be partial (``sample`` fraction of packs, ``max_duration_s``); packs verified longest
ago go first, and each pack's last verification time is recorded in the index cache. A partial report says
what it skipped and is never ``clean``, even when it found no problems. The report maps
damage upward: chunk -> pack -> every checkpoint and item that depends on it, directly or as a delta base.
Damage is reported as data; ``verify`` raises only when it cannot run at all.

Phases (restic's checker: index, structure, packs, read data), each a function below: needed chunks (the
manifests), cache refresh, structure, then per pack its hash and the decoding of its chunks, and last the
attribution of every finding to the checkpoints and items it affects.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from ..errors import CorruptChunkError, DeltackptError, ManifestFormatError, MissingChunkError
from . import idset
from .config import chain_limit
from .pack import PackTable, list_packs, pack_bytes_ok, pack_key, pack_stamps, read_pack_table, walk_entries
from .progress import Progress, phase
from .source import ChunkSource

_BLOCK = 1 << 12  # ids per vectorised pass where a pass's temporaries would otherwise grow with all the ids
_LOCATE_BLOCK = 1 << 10  # ids located per call: its records (~210 B an id) and the packs they name held at once
_KEYFRAME, _UNFOLLOWED = -1, -2  # _Findings.node_base of a chunk that is no delta (or not found), of a chain's end


class ProblemKind(str, Enum):
    """What a :class:`Problem` is (its ``kind`` in the JSON report is the value)."""

    MANIFEST = "manifest"  # a manifest does not parse
    MISSING_CHUNK = "missing-chunk"  # a referenced chunk is in no pack
    MISSING_PACK = "missing-pack"  # the pack holding a chunk is gone
    BAD_BASE = "bad-base"  # a delta's base is missing, or is itself a delta
    PACK_HASH = "pack-hash"  # a pack's bytes do not hash to its name, or its table is unreadable
    BAD_CHUNK = "bad-chunk"  # a chunk does not decode to its id (or its pack's table is unreadable)

    def __str__(self) -> str:
        return self.value


@dataclass
class Problem:
    """One piece of damage, of a :class:`ProblemKind` (a plain string is accepted and checked)."""

    kind: ProblemKind
    detail: str
    pack: str | None = None
    chunk_id: str | None = None
    checkpoints: list[str] = field(default_factory=list)
    items: list[str] = field(default_factory=list)  # "checkpoint:item"

    def __post_init__(self) -> None:
        self.kind = ProblemKind(self.kind)

    def as_dict(self) -> dict:
        return {"kind": self.kind.value, "detail": self.detail, "pack": self.pack, "chunk_id": self.chunk_id,
                "checkpoints": self.checkpoints, "items": self.items}


@dataclass
class VerifyReport:
    level: int
    num_checkpoints: int = 0
    num_packs: int = 0
    packs_checked: int = 0
    chunks_checked: int = 0
    bytes_checked: int = 0
    complete: bool = True  # False when sample / max_duration_s left packs unchecked
    packs_skipped: int = 0  # packs in use that were not read (sample or time limit)
    chunks_skipped: int = 0  # chunks in use whose pack was not read
    skipped_by: str | None = None  # "sample" or "max_duration" when incomplete
    duration_s: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    orphan_packs: list[str] = field(default_factory=list)  # packs no checkpoint uses (gc removes them)

    @property
    def ok(self) -> bool:
        """No problems found in what was checked."""
        return not self.problems

    @property
    def clean(self) -> bool:
        """Everything was checked and no problem found."""
        return self.ok and self.complete

    @property
    def damaged_checkpoints(self) -> list[str]:
        return sorted({c for p in self.problems for c in p.checkpoints})

    def as_dict(self) -> dict:
        return {"level": self.level, "ok": self.ok, "clean": self.clean, "num_checkpoints": self.num_checkpoints,
                "num_packs": self.num_packs, "packs_checked": self.packs_checked,
                "chunks_checked": self.chunks_checked, "bytes_checked": self.bytes_checked,
                "complete": self.complete, "packs_skipped": self.packs_skipped,
                "chunks_skipped": self.chunks_skipped, "skipped_by": self.skipped_by,
                "duration_s": round(self.duration_s, 3),
                "damaged_checkpoints": self.damaged_checkpoints, "orphan_packs": self.orphan_packs,
                "problems": [p.as_dict() for p in self.problems]}


@dataclass
class _Findings:
    """What the phases learn and hand on to the next ones. Chunk ids are sorted 16-byte arrays
    (:mod:`.idset`), never a Python object per chunk or per reference: memory O(unique chunks)."""

    names: list[str] = field(default_factory=list)  # checkpoints whose manifest reads
    users: np.ndarray = field(default_factory=lambda: idset.from_ids(b""))  # chunks the manifests reference
    extra_bases: np.ndarray = field(default_factory=lambda: idset.from_ids(b""))  # other chunks down their chains
    # Per node (users, then extra_bases): whether it is in a pack present, and the node of its base when it is a
    # delta in a pack present (_KEYFRAME: none; _UNFOLLOWED: a delta whose base was not looked up). 5 bytes a
    # chunk: chains are walked in arrays of node numbers, never an id per delta.
    node_ok: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=bool))
    node_base: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    bad: dict[bytes, Problem] = field(default_factory=dict)  # the first problem found with each chunk
    live_packs: set[str] = field(default_factory=set)  # packs holding a needed chunk, or unreadable
    chunks_in: dict[str, int] = field(default_factory=dict)  # pack -> needed chunks it holds
    # Packs whose hash or table is bad: their problem, and the entries found in them.
    damaged_packs: dict[str, tuple[Problem, PackTable]] = field(default_factory=dict)

    def needed(self, ids: np.ndarray) -> np.ndarray:
        """A bool per id: whether a checkpoint needs it (references it, or a delta it references has it as base)."""
        return idset.isin(self.users, ids) | idset.isin(self.extra_bases, ids)


def verify_store(store, *, level: int = 1, sample: float | None = None, max_duration_s: float | None = None,
                 checkpoints: list[str] | None = None, progress: Progress | None = None) -> VerifyReport:
    """Check ``store`` (or only ``checkpoints``) at ``level``; returns a report, raising only if it cannot run.

    ``progress`` hears of each phase: manifests, index rebuild, structure (chunks), packs (bytes)."""
    if level not in (0, 1, 2):
        raise ValueError(f"verify level must be 0, 1 or 2, got {level}")
    if sample is not None and not (0.0 < sample <= 1.0):
        raise ValueError("sample must be a fraction in (0, 1]")
    start = time.monotonic()
    report = VerifyReport(level=level)
    found = _Findings()
    names = checkpoints if checkpoints is not None else store.checkpoint_names()
    _needed_chunks(store, names, found, report, progress)
    packs, seen, records = _refresh_cache(store, found.users, level, progress)
    report.num_packs = len(packs)
    _check_structure(store, found, seen, packs, level, records, progress)
    report.orphan_packs = sorted(packs.keys() - found.live_packs) if checkpoints is None else []
    if level >= 1:
        deadline = None if max_duration_s is None else start + max_duration_s
        _check_packs(store, found, packs, level, sample, deadline, report, progress)
    _attribute(store, found, report)
    report.duration_s = time.monotonic() - start
    return report


def _needed_chunks(store, names: list[str], found: _Findings, report: VerifyReport, progress) -> None:
    """Which chunks the checkpoints reference (a manifest that does not read is a problem)."""
    users = idset.Collector()
    with phase(progress, "verify manifests", len(names), "checkpoint") as bar:
        for name in names:
            try:
                store.add_manifest_ids(name, users)
            except (ManifestFormatError, DeltackptError) as e:
                report.problems.append(Problem(ProblemKind.MANIFEST, str(e), checkpoints=[name]))
                continue
            finally:
                bar.advance(1)
            report.num_checkpoints += 1
            found.names.append(name)
    found.users = users.result()


def _refresh_cache(store, users: np.ndarray, level: int, progress):
    """Bring the index cache in line with the packs; returns (pack name -> size, ``seen``: ``seen(i, chunk id)``
    is the pack the cache located ``users[i]`` in before, where the refresh moved or dropped its record, so
    that a pack that vanished is reported by name, not just as chunks that are nowhere; what to locate
    chunks with: the index, or at levels 1-2 the snapshot of its records the reconcile left)."""
    index = store.index
    if level == 0:
        known, listed = index.known_packs(), list_packs(store.backend)  # known first: see ChunkIndex.refresh
        if not index.check_records():
            if known <= listed.keys():
                # Sound records, and no pack gone: the refresh only indexes the packs new since (a cache of
                # another store is rebuilt: where it located them says nothing); no record moves.
                store.refresh_index(pack_stamps(listed))
                return _sizes(listed), _nowhere, index
            # A pack gone: the cache is rebuilt, so where it located each chunk is taken first.
            try:
                names, pack_of = _pack_numbers(index, users)
            except ManifestFormatError:
                names, pack_of = [], np.full(users.size, -1, dtype=np.int32)
            store.refresh_index()
            return _list_pack_sizes(store), lambda i, _cid: names[pack_of[i]] if pack_of[i] >= 0 else None, index
    # Levels 1-2 read every pack anyway, so checking the cache against the pack tables costs little and means
    # no damage to the cache (a malformed or a well-formed but wrong record) is mistaken for damage to the store.
    moved: dict[bytes, str] = {}
    records = _reconciled(index, moved, progress)
    return _list_pack_sizes(store), lambda _i, cid: moved.get(cid), records


def _reconciled(index, moved: dict, progress):
    """Reconcile the cache with the pack tables (``moved`` as ``ChunkIndex.reconcile`` fills it); returns what
    to locate chunks with: the snapshot of the records it left, or the index when it rebuilt instead."""
    snapshot: list = []
    index.reconcile(progress=progress, moved=moved, snapshot=snapshot)
    return snapshot[0] if snapshot else index


def _nowhere(_i, _cid) -> None:
    return None


def _moved_first(moved: dict[bytes, str], seen):
    """``seen`` after a reconcile that moved or dropped the records of ``moved`` (chunk id -> pack before)."""
    return lambda i, cid: moved.get(cid) or seen(i, cid)


def _sizes(listed: dict) -> dict[str, int]:
    """Pack name -> size of a pack listing (:func:`~.pack.list_packs`)."""
    return {name: info.size_bytes for name, info in listed.items()}


def _list_pack_sizes(store) -> dict[str, int]:
    return _sizes(list_packs(store.backend))


def _check_structure(store, found: _Findings, seen, packs, level: int, records, progress) -> None:
    """Level 0: every needed chunk is indexed, in an existing pack, with an intact base; and which packs
    hold the needed chunks. ``records``: what locates chunks (the index, or a snapshot of its records)."""
    index, users = store.index, found.users
    with phase(progress, "verify structure", users.size, "chunk") as bar:
        base, present, held, absent, outside = _locate_users(records, users, packs)
        if level == 0 and absent:
            # After a refresh the cache knows exactly the packs present; a record missing or pointing elsewhere
            # may mean the cache itself is damaged (a record well-formed but wrong, or under a wrong key),
            # which is not damage to the store: check it against the pack tables and look again.
            moved: dict[bytes, str] = {}
            records = _reconciled(index, moved, progress)
            base, present, held, absent, outside = _locate_users(records, users, packs)
            seen = _moved_first(moved, seen)
        bar.advance(users.size)
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


def _pack_numbers(index, ids: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(pack names, the number of the pack holding each of ``ids``: -1 where not indexed)."""
    names: dict[str, int] = {}
    pack_of = np.empty(ids.size, dtype=np.int32)

    def block(start, loc):
        number = np.array([names.setdefault(p, len(names)) for p in loc.packs] + [-1], dtype=np.int32)
        pack_of[start:start + loc.pack_of.size] = number[loc.pack_of]  # pack_of -1: the last, -1

    index.locate_each(ids, block, _LOCATE_BLOCK)
    return list(names), pack_of


def _locate(index, ids: np.ndarray, packs, deltas):
    """(a bool per id: indexed in a pack present; pack -> ids it holds; [(position, pack or None)] of the
    others; what ``deltas(positions, base ids)`` returned for each block's deltas, None left out). Located a
    block at a time: no pass holds every delta's base id, nor a pack number per id."""
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
        out = deltas(loc.delta_at + start, loc.delta_base)
        if out is not None:
            told.append(out)

    index.locate_each(ids, block, _LOCATE_BLOCK)
    return present, held, absent, told


def _locate_users(index, users: np.ndarray, packs):
    """(the node of each user's base when it is a user, else _KEYFRAME; then as :func:`_locate`, the last part
    the (positions, base ids) of the deltas whose base is no user)."""
    base = np.full(users.size, _KEYFRAME, dtype=np.int32)

    def deltas(at, ids):
        pos = idset.find(users, ids)
        inside = pos >= 0
        base[at[inside]] = pos[inside]
        return (at[~inside], ids[~inside]) if not inside.all() else None

    return (base, *_locate(index, users, packs, deltas))


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


def _absent(found: _Findings, absent: list, seen, packs) -> set[str]:
    """Report each user in no pack present (``absent``: position, pack indexed in or None) by what became of
    it (``seen``: see :func:`_refresh_cache`); returns the packs whose table is unreadable."""
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


def _node_id(found: _Findings, node: int) -> bytes:
    n = found.users.size
    return (found.users[node] if node < n else found.extra_bases[node - n]).tobytes()


def _user_deltas(found: _Findings):
    """(user deltas in a pack present, their bases' nodes) a block of users at a time."""
    base, n = found.node_base, found.users.size
    for lo in range(0, n, _BLOCK):
        at = lo + np.flatnonzero(base[lo:min(n, lo + _BLOCK)] >= 0)
        yield at, base[at]


def _check_bases(store, found: _Findings, limit: int = 1) -> None:
    """A delta's base must be indexed, in a pack present, and a keyframe; in a store with delta chains, a
    delta whose own chain (at most ``limit`` deltas in all, no cycle) ends in one. The chains are walked a
    level at a time in arrays; the few that fail are walked again one by one to say how."""
    ok, base = found.node_ok, found.node_base
    for at, cur in _user_deltas(found):
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


def _chain_problem(found: _Findings, d: int, limit: int) -> str:
    """What is wrong down the chain of user delta ``d`` (known to be wrong)."""
    ok, base = found.node_ok, found.node_base
    cur, depth, seen = int(base[d]), 1, {d}
    while True:
        cid = _node_id(found, cur).hex()
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


def _check_packs(store, found: _Findings, packs: dict[str, int], level: int, sample, deadline, report,
                 progress) -> None:
    """Levels 1-2: read the packs in use, least recently verified first, as many as ``sample`` and
    ``deadline`` allow; check each one's hash, then decode its needed chunks."""
    index = store.index
    order = sorted(found.live_packs & packs.keys(), key=lambda p: (index.last_verified(p), p))
    skipped: list[str] = []
    if sample is not None:
        keep = max(1, round(len(order) * sample)) if order else 0
        order, skipped = order[:keep], order[keep:]
        report.skipped_by = "sample" if skipped else None
    source = ChunkSource(store, cache_bytes=0)
    done: list[str] = []
    # Each pack is read into one buffer, reused: a new one per pack cost a page fault per 4 KiB (4.3 GB of
    # packs: 2.1 s read that way, 0.34 s into a buffer read before).
    scratch = memoryview(bytearray(max((packs[p] for p in order), default=0)))
    try:
        with phase(progress, f"verify level {level}", sum(packs[p] for p in order), "B") as bar:
            for i, name in enumerate(order):
                if deadline is not None and time.monotonic() > deadline:
                    skipped += order[i:]
                    report.skipped_by = "max_duration"
                    break
                try:
                    data = scratch[:store.backend.get_range_into(pack_key(name), 0, [scratch[:packs[name]]])]
                except FileNotFoundError:
                    data = None  # reported at level 0 for every chunk it held
                if data is not None:
                    report.packs_checked += 1
                    report.bytes_checked += len(data)
                    table, hash_ok = _check_pack_hash(name, data, found, report)
                    if level >= 2 or not hash_ok:
                        _decode_chunks(source, table, found, report)
                done.append(name)
                bar.advance(packs[name])
    finally:
        index.mark_verified(done)  # one transaction for the run (also when it is interrupted)
    report.complete = not skipped
    report.packs_skipped = len(skipped)
    report.chunks_skipped = sum(found.chunks_in.get(p, 0) for p in skipped)


def _check_pack_hash(name: str, data, found: _Findings, report) -> tuple[PackTable, bool]:
    """Whether the pack's bytes hash to its name, and its entries (as arrays): from its table, or when the
    table is unreadable, the intact ones found from their headers."""
    hash_ok = pack_bytes_ok(name, data)
    problem = None
    if not hash_ok:
        problem = Problem(ProblemKind.PACK_HASH, "pack bytes do not hash to its name", pack=name)
        report.problems.append(problem)
    try:
        table = read_pack_table(_Bytes(data), name, len(data))
    except ManifestFormatError as e:
        if problem is None:
            problem = Problem(ProblemKind.PACK_HASH, "", pack=name)
            report.problems.append(problem)
        problem.detail = f"pack table unreadable ({e})"
        table = PackTable.from_entries(name, walk_entries(data, name))
    if problem is not None:
        found.damaged_packs[name] = (problem, table)
    return table, hash_ok


def _decode_chunks(source, table: PackTable, found: _Findings, report) -> None:
    """Decode the needed chunks of a pack (deltas through their bases) and re-hash them."""
    name = table.name
    for e in table.entries(np.flatnonzero(found.needed(table.chunk_ids))):
        report.chunks_checked += 1
        try:
            # Decode this pack's copy, as its table describes it, not whatever the cache points at.
            source.decode_entry(e)
        except (CorruptChunkError, MissingChunkError, ManifestFormatError) as err:
            if e.chunk_id not in found.bad:
                found.bad[e.chunk_id] = Problem(ProblemKind.BAD_CHUNK, str(err), pack=name,
                                                chunk_id=e.chunk_id.hex())


def _attribute(store, found: _Findings, report: VerifyReport) -> None:
    """Map damage upward: a chunk is damaged if it or its base is; report who needs it."""
    bad = found.bad
    damaged = {name: (problem, table.entries()) for name, (problem, table) in found.damaged_packs.items()}
    whole = {name: (problem, entries) for name, (problem, entries) in damaged.items()
             if not any(bad.get(e.chunk_id) and bad[e.chunk_id].pack == name for e in entries)}
    targets = set(bad) | {e.chunk_id for _, entries in whole.values() for e in entries}
    dependents = _dependents(store, found, targets) if targets else {}
    for name, (problem, entries) in whole.items():
        # Damage no chunk accounts for (the table, the footer, a truncated tail): everything that keeps
        # chunks in this pack is at risk, even though those chunks still decode.
        _set_dependents(problem, {d for e in entries for d in dependents.get(e.chunk_id, ())})
    for cid, problem in bad.items():
        _set_dependents(problem, dependents.get(cid, set()))
        report.problems.append(problem)
    report.problems.sort(key=lambda p: (p.kind.value, p.pack or "", p.chunk_id or ""))


def _dependents(store, found: _Findings, targets: set[bytes]) -> dict[bytes, set[str]]:
    """"checkpoint:item" of every item that reads one of ``targets``, directly or as the base of a delta it
    references: the manifests are read again, so that no attribution is held per reference meanwhile."""
    via: dict[bytes, list[bytes]] = {}  # a referenced delta -> the targets that are its base (down its chain)
    wanted = idset.unique(idset.from_ids(list(targets)))
    is_target = np.concatenate([idset.isin(wanted, found.users), idset.isin(wanted, found.extra_bases)])
    base = found.node_base
    for at, cur in _user_deltas(found) if is_target.any() else ():
        for _ in range(chain_limit(store.config)):  # a target anywhere down a referenced delta's chain
            hit = is_target[cur]
            for d, b in zip(at[hit].tolist(), cur[hit].tolist()):
                via.setdefault(found.users[d].tobytes(), []).append(_node_id(found, b))
            go = base[cur] >= 0
            at, cur = at[go], base[cur[go]]
            if not at.size:
                break
    out: dict[bytes, set[str]] = {}
    keys = idset.unique(idset.from_ids(list(targets | via.keys())))
    for name in found.names:
        try:
            refs = store.read_manifest_refs(name)
            hits = np.flatnonzero(idset.isin(keys, refs.ids))
            items = store.read_manifest(name).items if hits.size else []  # item names: only where damage is used
        except (ManifestFormatError, DeltackptError):
            continue  # forgotten or damaged since the first read
        if hits.size and len(items) != refs.item_end.size:
            continue  # replaced between the two reads (forgotten and saved again)
        for k, at in zip(hits.tolist(), np.searchsorted(refs.item_end, hits, side="right").tolist()):
            cid = refs.ids[k].tobytes()
            for target in ([cid] if cid in targets else []) + via.get(cid, []):
                out.setdefault(target, set()).add(f"{name}:{items[at].key}")
    return out


def _set_dependents(problem: Problem, dependents: set[str]) -> None:
    problem.items = sorted(dependents)
    problem.checkpoints = sorted({d.split(":", 1)[0] for d in dependents})


class _Bytes:
    """A one-object backend over bytes already read, so the pack table is parsed without another read (its
    ranges copied out: the buffer is reused for the next pack, the table may be kept)."""

    def __init__(self, data) -> None:
        self.data = data

    def get_range(self, key, offset, length):
        return bytes(self.data[offset:offset + length])
