"""verify: prove a store's contents are intact, and say what any damage affects.

Levels (each includes the ones below):

0. structure: every manifest parses; every chunk a manifest references is indexed and its pack exists;
   every delta's base exists and is a keyframe.
1. packs: every pack's bytes hash to its name.
2. data: every chunk is decoded (deltas through their bases) and re-hashed.

Levels 1 and 2 can be partial (``sample`` fraction of packs, ``max_duration_s``); packs verified longest
ago go first, and each pack's last verification time is recorded in the index cache. A partial report says
what it skipped and is never ``clean``, even when it found no problems. The report maps
damage upward: chunk -> pack -> every checkpoint and item that depends on it, directly or as a delta base.
Damage is reported as data; ``verify`` raises only when it cannot run at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import CorruptChunkError, DeltackptError, ManifestFormatError, MissingChunkError
from . import codec
from .pack import pack_bytes_ok, walk_entries, pack_key, pack_name_from_key, read_pack_entries
from .reader import ChunkSource


@dataclass
class Problem:
    """One piece of damage. ``kind``: manifest, missing-chunk, missing-pack, bad-base, pack-hash, bad-chunk."""

    kind: str
    detail: str
    pack: str | None = None
    chunk_id: str | None = None
    checkpoints: list[str] = field(default_factory=list)
    items: list[str] = field(default_factory=list)  # "checkpoint:item"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "detail": self.detail, "pack": self.pack, "chunk_id": self.chunk_id,
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


def verify_store(store, *, level: int = 1, sample: float | None = None, max_duration_s: float | None = None,
                 checkpoints: list[str] | None = None) -> VerifyReport:
    """Check ``store`` (or only ``checkpoints``) at ``level``; returns a report, raising only if it cannot run."""
    if level not in (0, 1, 2):
        raise ValueError(f"verify level must be 0, 1 or 2, got {level}")
    if sample is not None and not (0.0 < sample <= 1.0):
        raise ValueError("sample must be a fraction in (0, 1]")
    start = time.monotonic()
    report = VerifyReport(level=level)

    # Which chunks each checkpoint item needs (its refs and their delta bases).
    names = checkpoints if checkpoints is not None else store.checkpoint_names()
    users: dict[bytes, list[str]] = {}  # chunk id -> ["ckpt:item", ...]
    bad: dict[bytes, Problem] = {}
    for name in names:
        try:
            manifest = store.read_manifest(name)
        except (ManifestFormatError, DeltackptError) as e:
            report.problems.append(Problem("manifest", str(e), checkpoints=[name]))
            continue
        report.num_checkpoints += 1
        for item in manifest.items:
            for ref in item.chunks:
                users.setdefault(ref.id, []).append(f"{name}:{item.key}")

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
        store.rebuild_index()
    else:
        store.refresh_index()
    packs = {pack_name_from_key(i.key): i.size_bytes for i in store.backend.list("packs/")}
    packs.pop(None, None)
    report.num_packs = len(packs)

    # After a refresh the cache knows exactly the packs present; a record pointing elsewhere, or missing,
    # may mean the cache itself is damaged (a record well-formed but wrong, or under a wrong key), which is
    # not damage to the store: rebuild and look again.
    if level == 0 and any((e := index.lookup(cid)) is None or e.pack not in packs for cid in users):
        store.rebuild_index()

    # Level 0: every needed chunk is indexed, in an existing pack, with an intact base.
    needed = dict(users)
    unreadable: set[str] = set()
    for cid, where in users.items():
        entry = index.lookup(cid)
        if entry is None:
            gone = last_seen.get(cid)
            if gone is not None and gone not in packs:
                bad[cid] = Problem("missing-pack", "pack holding the chunk is missing", pack=gone,
                                   chunk_id=cid.hex())
            elif gone is not None:
                bad[cid] = Problem("bad-chunk", "its pack's table is unreadable", pack=gone, chunk_id=cid.hex())
                unreadable.add(gone)
            else:
                bad[cid] = Problem("missing-chunk", "chunk is not in any pack", chunk_id=cid.hex())
            continue
        if entry.pack not in packs:
            bad[cid] = Problem("missing-pack", "pack holding the chunk is missing", pack=entry.pack,
                               chunk_id=cid.hex())
            continue
        if entry.codec == codec.DELTA:
            base = index.lookup(entry.base_id)
            needed.setdefault(entry.base_id, []).extend(where)
            if base is None or base.pack not in packs:
                bad[cid] = Problem("bad-base", f"base chunk {entry.base_id.hex()} is missing", pack=entry.pack,
                                   chunk_id=cid.hex())
            elif base.codec == codec.DELTA:
                bad[cid] = Problem("bad-base", f"base chunk {entry.base_id.hex()} is itself a delta",
                                   pack=entry.pack, chunk_id=cid.hex())

    live_packs = set(unreadable)
    chunks_in: dict[str, int] = {}  # pack -> needed chunks it holds
    for cid in needed:
        entry = index.lookup(cid)
        if entry is not None:
            live_packs.add(entry.pack)
            chunks_in[entry.pack] = chunks_in.get(entry.pack, 0) + 1
    report.orphan_packs = sorted(p for p in packs if p not in live_packs) if checkpoints is None else []

    # Levels 1-2: pack hashes and chunk contents, least recently verified packs first.
    if level >= 1:
        order = sorted(live_packs & packs.keys(), key=lambda p: (index.last_verified(p), p))
        skipped: list[str] = []
        if sample is not None:
            keep = max(1, round(len(order) * sample)) if order else 0
            order, skipped = order[:keep], order[keep:]
            report.skipped_by = "sample" if skipped else None
        source = ChunkSource(store, cache_bytes=0)
        for i, name in enumerate(order):
            if max_duration_s is not None and time.monotonic() - start > max_duration_s:
                skipped += order[i:]
                report.skipped_by = "max_duration"
                break
            _check_pack(store, index, name, level, needed, source, bad, report)
            index.mark_verified(name)
        report.complete = not skipped
        report.packs_skipped = len(skipped)
        report.chunks_skipped = sum(chunks_in.get(p, 0) for p in skipped)

    # Map damage upward: a chunk is damaged if it or its base is; report who needs it.
    for cid, problem in bad.items():
        dependents = set(needed.get(cid, ()))
        problem.items = sorted(dependents)
        problem.checkpoints = sorted({d.split(":", 1)[0] for d in dependents})
        report.problems.append(problem)
    report.problems.sort(key=lambda p: (p.kind, p.pack or "", p.chunk_id or ""))
    report.duration_s = time.monotonic() - start
    return report


def _check_pack(store, index, name: str, level: int, needed, source, bad, report) -> None:
    try:
        data = store.backend.get(pack_key(name))
    except FileNotFoundError:
        return  # reported at level 0 for every chunk it held
    report.packs_checked += 1
    report.bytes_checked += len(data)
    hash_ok = pack_bytes_ok(name, data)
    pack_problem = None
    if not hash_ok:
        pack_problem = Problem("pack-hash", "pack bytes do not hash to its name", pack=name)
        report.problems.append(pack_problem)
    try:
        entries = read_pack_entries(_Bytes(data), name, len(data))
    except ManifestFormatError as e:
        if pack_problem is None:
            pack_problem = Problem("pack-hash", "", pack=name)
            report.problems.append(pack_problem)
        pack_problem.detail = f"pack table unreadable ({e})"
        entries = walk_entries(data, name)  # the intact entries, found from their headers
    for e in entries:
        if e.chunk_id not in needed:
            continue
        if level < 2 and hash_ok:
            continue
        report.chunks_checked += 1
        try:
            # Decode this pack's copy, as its table describes it, not whatever the cache points at.
            source.decode_entry(e)
        except (CorruptChunkError, MissingChunkError, ManifestFormatError) as err:
            if e.chunk_id not in bad:
                bad[e.chunk_id] = Problem("bad-chunk", str(err), pack=name, chunk_id=e.chunk_id.hex())
    if pack_problem is not None and not any(bad.get(e.chunk_id) and bad[e.chunk_id].pack == name
                                            for e in entries):
        # Damage no chunk accounts for (the table, the footer, a truncated tail): everything that keeps
        # chunks in this pack is at risk, even though those chunks still decode.
        at_risk = {d for e in entries for d in needed.get(e.chunk_id, ())}
        pack_problem.items = sorted(at_risk)
        pack_problem.checkpoints = sorted({d.split(":", 1)[0] for d in at_risk})


class _Bytes:
    """A one-object backend over bytes already read, so the pack table is parsed without another read."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def get_range(self, key, offset, length):
        return self.data[offset:offset + length]
