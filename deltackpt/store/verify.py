"""verify: prove a store's contents are intact, and say what any damage affects.

Levels (each includes the ones below):

0. structure: every manifest parses; every chunk a manifest references is indexed and its pack exists;
   every delta's chain of bases exists down to a keyframe, within the store's chain limit.
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

from ..errors import CorruptChunkError, DeltackptError, ManifestFormatError, MissingChunkError
from . import codec
from .config import chain_limit
from .pack import PackEntry, pack_bytes_ok, walk_entries, pack_key, pack_name_from_key, read_pack_entries
from .progress import Progress, phase
from .source import ChunkSource


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
    """What the phases learn and hand on to the next ones."""

    users: dict[bytes, list[str]] = field(default_factory=dict)  # chunk id -> "ckpt:item" that reference it
    needed: dict[bytes, list[str]] = field(default_factory=dict)  # users, plus the delta bases they read
    bad: dict[bytes, Problem] = field(default_factory=dict)  # the first problem found with each chunk
    live_packs: set[str] = field(default_factory=set)  # packs holding a needed chunk, or unreadable
    chunks_in: dict[str, int] = field(default_factory=dict)  # pack -> needed chunks it holds
    # Packs whose hash or table is bad: their problem, and the entries found in them.
    damaged_packs: dict[str, tuple[Problem, list[PackEntry]]] = field(default_factory=dict)


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
    found.users = _needed_chunks(store, names, report, progress)
    packs, last_seen = _refresh_cache(store, found.users, level, progress)
    report.num_packs = len(packs)
    _check_structure(store.index, found, last_seen, packs, progress, chain_limit(store.config))
    report.orphan_packs = sorted(packs.keys() - found.live_packs) if checkpoints is None else []
    if level >= 1:
        deadline = None if max_duration_s is None else start + max_duration_s
        _check_packs(store, found, packs, level, sample, deadline, report, progress)
    _attribute(found, report)
    report.duration_s = time.monotonic() - start
    return report


def _needed_chunks(store, names: list[str], report: VerifyReport, progress) -> dict[bytes, list[str]]:
    """Which chunks each checkpoint item references (a manifest that does not read is a problem)."""
    users: dict[bytes, list[str]] = {}
    with phase(progress, "verify manifests", len(names), "checkpoint") as bar:
        for name in names:
            try:
                manifest = store.read_manifest(name)
            except (ManifestFormatError, DeltackptError) as e:
                report.problems.append(Problem(ProblemKind.MANIFEST, str(e), checkpoints=[name]))
                continue
            finally:
                bar.advance(1)
            report.num_checkpoints += 1
            for item in manifest.items:
                for ref in item.chunks:
                    users.setdefault(ref.id, []).append(f"{name}:{item.key}")
    return users


def _refresh_cache(store, users, level: int, progress) -> tuple[dict[str, int], dict[bytes, str]]:
    """Bring the index cache in line with the packs; returns (pack name -> size, chunk -> pack the cache
    located it in before the refresh)."""
    # Where the cache last saw each chunk, before refreshing it: a pack that vanished since is then
    # reported by name, not just as chunks that are nowhere.
    index = store.index
    last_seen = {}
    for cid in users:
        try:
            entry = index.lookup(cid)
        except ManifestFormatError:
            entry = None
        if entry is not None:
            last_seen[cid] = entry.pack
    if level >= 1 or index.check_records():
        # Levels 1-2 read every pack anyway, so rebuilding the cache from the pack tables costs little and
        # means no damage to the cache (a malformed or a well-formed but wrong record) is mistaken for
        # damage to the store.
        store.rebuild_index(progress=progress)
    else:
        store.refresh_index()
    packs = {pack_name_from_key(i.key): i.size_bytes for i in store.backend.list("packs/")}
    packs.pop(None, None)
    # After a refresh the cache knows exactly the packs present; a record pointing elsewhere, or missing,
    # may mean the cache itself is damaged (a record well-formed but wrong, or under a wrong key), which is
    # not damage to the store: rebuild and look again.
    if level == 0 and any((e := index.lookup(cid)) is None or e.pack not in packs for cid in users):
        store.rebuild_index(progress=progress)
    return packs, last_seen


def _check_chain(index, entry: PackEntry, where: list[str], found: _Findings, packs, limit: int) -> Problem | None:
    """Follow delta ``entry``'s chain to its keyframe, marking every base as needed by ``where``; the first
    broken link (a base missing, a chain longer than ``limit`` deltas, a cycle) as a problem of ``entry``."""
    tip, seen = entry, {entry.chunk_id}
    for depth in range(1, limit + 1):
        base_id = entry.base_id
        found.needed.setdefault(base_id, []).extend(where)
        base = index.lookup(base_id)
        below = "" if depth == 1 else f" ({depth} deltas down its chain)"
        if base is None or base.pack not in packs:
            detail = f"base chunk {base_id.hex()} is missing{below}"
        elif base_id in seen:
            detail = f"delta chain meets itself at base chunk {base_id.hex()}"
        elif not codec.is_delta(base.codec):
            return None
        elif depth == limit:
            detail = (f"base chunk {base_id.hex()} is itself a delta" if limit == 1
                      else f"delta chain holds more than {limit} deltas")
        else:
            seen.add(base_id)
            entry = base
            continue
        return Problem(ProblemKind.BAD_BASE, detail, pack=tip.pack, chunk_id=tip.chunk_id.hex())
    return None


def _check_structure(index, found: _Findings, last_seen, packs, progress, limit: int = 1) -> None:
    """Level 0: every needed chunk is indexed, in an existing pack, with an intact chain of bases (at most
    ``limit`` deltas); and which packs hold the needed chunks."""
    found.needed = dict(found.users)
    bad = found.bad
    unreadable: set[str] = set()
    with phase(progress, "verify structure", len(found.users), "chunk") as bar:
        for cid, where in found.users.items():
            bar.advance(1)
            entry = index.lookup(cid)
            if entry is None:
                gone = last_seen.get(cid)
                if gone is not None and gone not in packs:
                    bad[cid] = Problem(ProblemKind.MISSING_PACK, "pack holding the chunk is missing", pack=gone,
                                       chunk_id=cid.hex())
                elif gone is not None:
                    bad[cid] = Problem(ProblemKind.BAD_CHUNK, "its pack's table is unreadable", pack=gone,
                                       chunk_id=cid.hex())
                    unreadable.add(gone)
                else:
                    bad[cid] = Problem(ProblemKind.MISSING_CHUNK, "chunk is not in any pack", chunk_id=cid.hex())
                continue
            if entry.pack not in packs:
                bad[cid] = Problem(ProblemKind.MISSING_PACK, "pack holding the chunk is missing", pack=entry.pack,
                                   chunk_id=cid.hex())
                continue
            if codec.is_delta(entry.codec):
                problem = _check_chain(index, entry, where, found, packs, limit)
                if problem is not None:
                    bad[cid] = problem
    found.live_packs = set(unreadable)
    for cid in found.needed:
        entry = index.lookup(cid)
        if entry is not None:
            found.live_packs.add(entry.pack)
            found.chunks_in[entry.pack] = found.chunks_in.get(entry.pack, 0) + 1


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
                entries, hash_ok = _check_pack_hash(name, data, found, report)
                if level >= 2 or not hash_ok:
                    _decode_chunks(source, name, entries, found, report)
            index.mark_verified(name)
            bar.advance(packs[name])
    report.complete = not skipped
    report.packs_skipped = len(skipped)
    report.chunks_skipped = sum(found.chunks_in.get(p, 0) for p in skipped)


def _check_pack_hash(name: str, data: bytes, found: _Findings, report) -> tuple[list[PackEntry], bool]:
    """Whether the pack's bytes hash to its name, and its entries: from its table, or when the table is
    unreadable, the intact ones found from their headers."""
    hash_ok = pack_bytes_ok(name, data)
    problem = None
    if not hash_ok:
        problem = Problem(ProblemKind.PACK_HASH, "pack bytes do not hash to its name", pack=name)
        report.problems.append(problem)
    try:
        entries = read_pack_entries(_Bytes(data), name, len(data))
    except ManifestFormatError as e:
        if problem is None:
            problem = Problem(ProblemKind.PACK_HASH, "", pack=name)
            report.problems.append(problem)
        problem.detail = f"pack table unreadable ({e})"
        entries = walk_entries(data, name)
    if problem is not None:
        found.damaged_packs[name] = (problem, entries)
    return entries, hash_ok


def _decode_chunks(source, name: str, entries: list[PackEntry], found: _Findings, report) -> None:
    """Decode the needed chunks of pack ``name`` (deltas through their bases) and re-hash them."""
    for e in entries:
        if e.chunk_id not in found.needed:
            continue
        report.chunks_checked += 1
        try:
            # Decode this pack's copy, as its table describes it, not whatever the cache points at.
            source.decode_entry(e)
        except (CorruptChunkError, MissingChunkError, ManifestFormatError) as err:
            if e.chunk_id not in found.bad:
                found.bad[e.chunk_id] = Problem(ProblemKind.BAD_CHUNK, str(err), pack=name,
                                                chunk_id=e.chunk_id.hex())


def _attribute(found: _Findings, report: VerifyReport) -> None:
    """Map damage upward: a chunk is damaged if it or its base is; report who needs it."""
    bad = found.bad
    for name, (problem, entries) in found.damaged_packs.items():
        if not any(bad.get(e.chunk_id) and bad[e.chunk_id].pack == name for e in entries):
            # Damage no chunk accounts for (the table, the footer, a truncated tail): everything that keeps
            # chunks in this pack is at risk, even though those chunks still decode.
            _set_dependents(problem, {d for e in entries for d in found.needed.get(e.chunk_id, ())})
    for cid, problem in bad.items():
        _set_dependents(problem, set(found.needed.get(cid, ())))
        report.problems.append(problem)
    report.problems.sort(key=lambda p: (p.kind.value, p.pack or "", p.chunk_id or ""))


def _set_dependents(problem: Problem, dependents: set[str]) -> None:
    problem.items = sorted(dependents)
    problem.checkpoints = sorted({d.split(":", 1)[0] for d in dependents})


class _Bytes:
    """A one-object backend over bytes already read, so the pack table is parsed without another read."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def get_range(self, key, offset, length):
        return self.data[offset:offset + length]
