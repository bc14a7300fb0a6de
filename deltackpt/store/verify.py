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
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from ..errors import CorruptChunkError, DeltackptError, ManifestFormatError, MissingChunkError
from . import idset
from .config import chain_limit
from .pack import PackTable, pack_bytes_ok, walk_entries, pack_key, pack_name_from_key, read_pack_table
from .progress import Progress, phase
from .source import ChunkSource

_BLOCK = 1 << 12  # ids per vectorised pass where a pass's temporaries would otherwise grow with all the ids


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
    extra_bases: np.ndarray = field(default_factory=lambda: idset.from_ids(b""))  # other bases of their deltas
    delta_at: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))  # users[delta_at] are deltas
    delta_base: np.ndarray = field(default_factory=lambda: idset.from_ids(b""))  # ... with these bases
    # Deltas among extra_bases (inner links of chains: only in a store with delta chains), sorted, and theirs.
    link_delta: np.ndarray = field(default_factory=lambda: idset.from_ids(b""))
    link_base: np.ndarray = field(default_factory=lambda: idset.from_ids(b""))
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
    packs, last_seen = _refresh_cache(store, found.users, level, progress)
    report.num_packs = len(packs)
    _check_structure(store, found, last_seen, packs, level, progress)
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


def _refresh_cache(store, users: np.ndarray, level: int, progress) -> tuple[dict[str, int], tuple]:
    """Bring the index cache in line with the packs; returns (pack name -> size, where the cache located each
    of ``users`` before: (pack names, pack number per chunk or -1), None when that is where it locates them now)."""
    # Where the cache last saw each chunk, before refreshing it: a pack that vanished since is then
    # reported by name, not just as chunks that are nowhere.
    index = store.index
    token = index.write_token()
    try:
        before = index.locate(users)
        last_seen = (before.packs, before.pack_of)
    except ManifestFormatError:
        last_seen = ([], np.full(users.size, -1, dtype=np.int32))
    if level >= 1 or index.check_records():
        # Levels 1-2 read every pack anyway, so checking the cache against the pack tables costs little and
        # means no damage to the cache (a malformed or a well-formed but wrong record) is mistaken for
        # damage to the store.
        index.reconcile(progress=progress)
    else:
        store.refresh_index()
    if token is not None and index.write_token() == token:
        last_seen = None  # the cache was not written meanwhile: where it located them is where it locates them
    packs = {pack_name_from_key(i.key): i.size_bytes for i in store.backend.list("packs/")}
    packs.pop(None, None)
    return packs, last_seen


def _check_structure(store, found: _Findings, last_seen, packs, level: int, progress) -> None:
    """Level 0: every needed chunk is indexed, in an existing pack, with an intact base; and which packs
    hold the needed chunks."""
    index, users, bad = store.index, found.users, found.bad
    with phase(progress, "verify structure", users.size, "chunk") as bar:
        loc = index.locate(users)
        present = _in_packs(loc, packs)
        if level == 0 and not present.all():
            # After a refresh the cache knows exactly the packs present; a record missing or pointing elsewhere
            # may mean the cache itself is damaged (a record well-formed but wrong, or under a wrong key),
            # which is not damage to the store: check it against the pack tables and look again.
            index.reconcile(progress=progress)
            loc = index.locate(users)
            present = _in_packs(loc, packs)
        bar.advance(users.size)
    unreadable: set[str] = set()
    seen_packs, seen_at = last_seen if last_seen is not None else ([], None)
    for i in np.flatnonzero(~present):
        cid = users[i].tobytes()
        if loc.pack_of[i] >= 0:
            bad[cid] = Problem(ProblemKind.MISSING_PACK, "pack holding the chunk is missing",
                               pack=loc.packs[loc.pack_of[i]], chunk_id=cid.hex())
            continue
        gone = seen_packs[seen_at[i]] if seen_at is not None and seen_at[i] >= 0 else None
        if gone is not None and gone not in packs:
            bad[cid] = Problem(ProblemKind.MISSING_PACK, "pack holding the chunk is missing", pack=gone,
                               chunk_id=cid.hex())
        elif gone is not None:
            bad[cid] = Problem(ProblemKind.BAD_CHUNK, "its pack's table is unreadable", pack=gone,
                               chunk_id=cid.hex())
            unreadable.add(gone)
        else:
            bad[cid] = Problem(ProblemKind.MISSING_CHUNK, "chunk is not in any pack", chunk_id=cid.hex())
    # Deltas in a pack present: their bases are needed too, and must be keyframes in a pack present.
    ok = present[loc.delta_at]
    found.delta_at, found.delta_base = loc.delta_at[ok], loc.delta_base[ok]
    found.extra_bases = idset.unique(found.delta_base[~idset.isin(users, found.delta_base)])
    extra = index.locate(found.extra_bases)
    limit = chain_limit(store.config)
    if limit > 1 and extra.delta_at.size:
        _follow_chains(index, found, users, extra, limit)
        extra = index.locate(found.extra_bases)
    _check_bases(found, users, loc, present, extra, packs, limit)
    found.live_packs = set(unreadable)
    for where in (loc, extra):
        counts = np.zeros(len(where.packs), dtype=np.int64)
        for start in range(0, where.pack_of.size, _BLOCK):  # bincount's index copy (8 B an id): a block's worth
            block = where.pack_of[start:start + _BLOCK]
            counts += np.bincount(block[block >= 0], minlength=len(where.packs))
        for name, n in zip(where.packs, counts.tolist()):
            if n:
                found.live_packs.add(name)
                found.chunks_in[name] = found.chunks_in.get(name, 0) + n


def _in_packs(loc, packs) -> np.ndarray:
    """A bool per located chunk: whether it is indexed in a pack that exists."""
    exists = np.array([p in packs for p in loc.packs] + [False], dtype=bool)  # pack_of -1: the last, False
    out = np.empty(loc.pack_of.size, dtype=bool)
    for start in range(0, out.size, _BLOCK):  # indexing copies the indices as int64: a block's worth at a time
        out[start:start + _BLOCK] = exists[loc.pack_of[start:start + _BLOCK]]
    return out


def _follow_chains(index, found: _Findings, users: np.ndarray, extra, limit: int) -> None:
    """Add the inner links of the referenced deltas' chains to ``found.extra_bases``, down to the keyframes
    (``limit`` levels at most), and record which of them are deltas and their bases (``found.link_*``)."""
    deltas, bases = [], []
    frontier, where = found.extra_bases, extra
    for _ in range(limit):
        d, b = frontier[where.delta_at], where.delta_base
        if not d.size:
            break
        deltas.append(d)
        bases.append(b)
        new = idset.unique(b[~(idset.isin(users, b) | idset.isin(found.extra_bases, b))])
        if not new.size:
            break
        found.extra_bases = idset.union(found.extra_bases, new)
        frontier, where = new, index.locate(new)
    d, b = np.concatenate(deltas), np.concatenate(bases)
    order = np.argsort(d, kind="stable")
    found.link_delta, found.link_base = d[order], b[order]


def _base_of(found: _Findings, cid: np.ndarray):
    """The base of needed chunk ``cid`` (a V16 scalar) when it is a delta found in a pack present, else None."""
    for ids, bases, at in ((found.users, found.delta_base, found.delta_at), (found.link_delta, found.link_base, None)):
        i = int(np.searchsorted(ids, cid))
        if i < ids.size and ids[i] == cid:
            if at is None:
                return bases[i]
            j = int(np.searchsorted(at, i))
            if j < at.size and at[j] == i:
                return bases[j]
    return None


def _check_bases(found: _Findings, users: np.ndarray, loc, present: np.ndarray, extra, packs,
                 limit: int = 1) -> None:
    """A delta's base must be indexed, in a pack present, and a keyframe; in a store with delta chains, a
    delta whose own chain (at most ``limit`` deltas in all, no cycle) ends in one."""
    is_delta = np.zeros(users.size, dtype=bool)
    is_delta[loc.delta_at] = True
    extra_delta = np.zeros(found.extra_bases.size, dtype=bool)
    extra_delta[extra.delta_at] = True
    extra_present = _in_packs(extra, packs)
    for d, base in zip(found.delta_at.tolist(), found.delta_base):
        cid = users[d].tobytes()
        seen, depth = {cid}, 1
        while True:
            i = int(np.searchsorted(users, base))
            if i < users.size and users[i] == base:
                base_ok, base_delta = present[i], is_delta[i]
            else:
                j = int(np.searchsorted(found.extra_bases, base))
                base_ok, base_delta = extra_present[j], extra_delta[j]
            below = "" if depth == 1 else f" ({depth} deltas down its chain)"
            if not base_ok:
                detail = f"base chunk {base.tobytes().hex()} is missing{below}"
            elif not base_delta:
                break
            elif depth >= limit:
                detail = (f"base chunk {base.tobytes().hex()} is itself a delta" if limit == 1
                          else f"delta chain holds more than {limit} deltas")
            elif base.tobytes() in seen:
                detail = f"delta chain meets itself at base chunk {base.tobytes().hex()}"
            else:
                seen.add(base.tobytes())
                base, depth = _base_of(found, base), depth + 1
                if base is None:
                    break  # a link not followed: nothing more to tell here
                continue
            found.bad[cid] = Problem(ProblemKind.BAD_BASE, detail, pack=loc.packs[loc.pack_of[d]], chunk_id=cid.hex())
            break


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
    try:
        with phase(progress, f"verify level {level}", sum(packs[p] for p in order), "B") as bar:
            for i, name in enumerate(order):
                if deadline is not None and time.monotonic() > deadline:
                    skipped += order[i:]
                    report.skipped_by = "max_duration"
                    break
                try:
                    data = store.backend.get(pack_key(name))
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


def _check_pack_hash(name: str, data: bytes, found: _Findings, report) -> tuple[PackTable, bool]:
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
    limit = chain_limit(store.config)
    if limit > 1:  # chains: a target anywhere down a referenced delta's chain
        for d, base in zip(found.delta_at.tolist(), found.delta_base):
            for _ in range(limit):
                if base is None:
                    break
                if base.tobytes() in targets:
                    via.setdefault(found.users[d].tobytes(), []).append(base.tobytes())
                base = _base_of(found, base)
    else:
        for j in np.flatnonzero(idset.isin(wanted, found.delta_base)).tolist():
            via.setdefault(found.users[found.delta_at[j]].tobytes(), []).append(found.delta_base[j].tobytes())
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
    """A one-object backend over bytes already read, so the pack table is parsed without another read."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def get_range(self, key, offset, length):
        return self.data[offset:offset + length]
