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

verify takes no lock, so a gc may run meanwhile: move a delta's base to a new pack, delete a pack after it was
listed, drop the chunks of checkpoints forgotten meanwhile. gc writes a new gc epoch before it deletes a pack
and again once every one is gone (and holds the exclusive lock in between), so verify reads the epoch first and
again at the end; when it changed, every finding a gc could have caused is checked again against the store as
it is then (:func:`_settle_after_gc`), and only what holds there is reported, and its pack marked damaged. A
chunk that no pack of a fresh listing holds is reported even while a gc runs (a gc never causes that); what
cannot be settled so is reported as not checked (``skipped_by="concurrent-gc"``), never as damage.

Phases (restic's checker: index, structure, packs, read data), each a function below: needed chunks (the
manifests), cache refresh, structure (:mod:`.verifystructure`), then per pack its hash and the decoding of
its chunks, and last the attribution of every finding to the checkpoints and items it affects. The report
types are in :mod:`.verifyreport`.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import (CheckpointNotFoundError, CorruptChunkError, DeltackptError, ManifestFormatError,
                      MissingChunkError, UnsupportedFormatError)
from . import idset
from .config import chain_limit
from .index import read_gc_epoch
from .lock import EXCLUSIVE, list_locks
from .mark import with_chain_bases
from .pack import PackTable, list_packs, pack_bytes_ok, pack_key, pack_stamps, read_pack_table, walk_entries
from .progress import Progress, phase
from .retention import DAMAGED_TAGS, read_all_tags
from .source import ChunkSource
from .verifyreport import Problem, ProblemKind, VerifyReport
from .verifystructure import Findings, check_structure, node_id, overrun_problems, pack_numbers, reconciled, \
    user_deltas

__all__ = ["Problem", "ProblemKind", "VerifyReport", "verify_store"]


def verify_store(store, *, level: int = 1, sample: float | None = None, max_duration_s: float | None = None,
                 checkpoints: list[str] | None = None, progress: Progress | None = None) -> VerifyReport:
    """Check ``store`` (or only ``checkpoints``) at ``level``; returns a report, raising only if it cannot run.

    ``progress`` hears of each phase: manifests, index rebuild, structure (chunks), packs (bytes)."""
    if level not in (0, 1, 2):
        raise ValueError(f"verify level must be 0, 1 or 2, got {level}")
    if sample is not None and not (0.0 < sample <= 1.0):
        raise ValueError("sample must be a fraction in (0, 1]")
    start = time.monotonic()
    watch = _GcWatch(store.backend)  # first: a gc that deletes a pack after this is seen at the end
    report = VerifyReport(level=level)
    found = Findings()
    store.refresh_config()  # its chain limit as it is now (a copy may have added chains since the open)
    names = checkpoints if checkpoints is not None else store.checkpoint_names()
    _needed_chunks(store, names, found, report, progress, listed=checkpoints is None)
    packs, seen, records = _refresh_cache(store, found.users, level, progress)
    report.num_packs = len(packs)
    check_structure(store, found, seen, packs, level, records, progress)
    report.problems.extend(overrun_problems(store, found))  # refs past their chunk's end: the manifest's fault
    # Orphans only when every manifest was read: a pack of one that was not would be called unused (and gc
    # refuses to run while a manifest is damaged, so "removed by gc" would not hold either).
    all_read = checkpoints is None and len(found.names) == len(names)
    report.orphan_packs = sorted(packs.keys() - found.live_packs) if all_read else []
    if level >= 1:
        deadline = None if max_duration_s is None else start + max_duration_s
        _check_packs(store, found, packs, level, sample, deadline, report, progress)
    _settle_after_gc(store, watch, found, report, level)  # before any pack is marked damaged
    _attribute(store, found, report)
    # The next save writes their chunks again rather than reuse them (ChunkIndex.damaged_packs).
    store.index.mark_damaged({p.pack for p in report.problems
                              if p.pack and p.kind in (ProblemKind.BAD_CHUNK, ProblemKind.PACK_HASH)})
    for name, tags in sorted(read_all_tags(store).items()):
        if DAMAGED_TAGS in tags and (checkpoints is None or name in checkpoints):
            report.problems.append(Problem(ProblemKind.TAGS, f"tags of {name!r} do not read; the checkpoint stays "
                                           f"pinned until `deltackpt tag` rewrites them"))
    report.duration_s = time.monotonic() - start
    return report


def _needed_chunks(store, names: list[str], found: Findings, report: VerifyReport, progress,
                   listed: bool = False) -> None:
    """Which chunks the checkpoints reference (a manifest that does not read is a problem; one ``listed``
    and gone when read was forgotten meanwhile: a checkpoint exists only while its manifest does)."""
    users = idset.Collector(with_ends=True)  # beside each chunk, the most of it a ref reads (checked at level 0)
    with phase(progress, "verify manifests", len(names), "checkpoint") as bar:
        for name in names:
            try:
                store.add_manifest_ids(name, users)
            except UnsupportedFormatError:
                raise  # written by a newer deltackpt: not damage, and nothing here can check it
            except CheckpointNotFoundError as e:
                if listed:
                    continue  # forgotten since the listing (forget takes no lock), as gc's mark takes it
                report.problems.append(Problem(ProblemKind.MANIFEST, str(e), checkpoints=[name]))
                continue
            except (ManifestFormatError, DeltackptError) as e:
                report.problems.append(Problem(ProblemKind.MANIFEST, str(e), checkpoints=[name]))
                continue
            finally:
                bar.advance(1)
            report.num_checkpoints += 1
            found.names.append(name)
    found.users, found.user_ends = users.result_with_ends()


def _refresh_cache(store, users: np.ndarray, level: int, progress):
    """Bring the index cache in line with the packs; returns (pack name -> size, ``seen``: ``seen(i, chunk id)``
    is the pack the cache located ``users[i]`` in before, where the refresh moved or dropped its record, so
    that a pack that vanished is reported by name, not just as chunks that are nowhere; what to locate
    chunks with: the index, or at levels 1-2 the snapshot of its records the reconcile left)."""
    index = store.index
    if level == 0:
        known, listed = index.known_packs(), list_packs(store.backend)  # known first: see ChunkIndex.refresh
        none_gone = known <= listed.keys()
        del known  # a string a pack: not held through the refresh
        if not index.check_records():
            if none_gone:
                # Sound records, and no pack gone: the refresh only indexes the packs new since (a cache of
                # another store is rebuilt: where it located them says nothing); no record moves.
                stamps = pack_stamps(listed)
                del listed  # the listing's objects, ~400 bytes a pack, not held through the refresh
                store.refresh_index(stamps)
                return {name: size for name, (size, _) in stamps.items()}, _nowhere, index
            # A pack gone: the cache is rebuilt, so where it located each chunk is taken first.
            try:
                names, pack_of = pack_numbers(index, users)
            except ManifestFormatError:
                names, pack_of = [], np.full(users.size, -1, dtype=np.int32)
            store.refresh_index()
            return _list_pack_sizes(store), lambda i, _cid: names[pack_of[i]] if pack_of[i] >= 0 else None, index
    # Levels 1-2 read every pack anyway, so checking the cache against the pack tables costs little and means
    # no damage to the cache (a malformed or a well-formed but wrong record) is mistaken for damage to the store.
    moved: dict[bytes, str] = {}
    records = reconciled(index, moved, progress)
    return _list_pack_sizes(store), lambda _i, cid: moved.get(cid), records


def _nowhere(_i, _cid) -> None:
    return None


def _sizes(listed: dict) -> dict[str, int]:
    """Pack name -> size of a pack listing (:func:`~.pack.list_packs`)."""
    return {name: info.size_bytes for name, info in listed.items()}


def _list_pack_sizes(store) -> dict[str, int]:
    return _sizes(list_packs(store.backend))


def _check_packs(store, found: Findings, packs: dict[str, int], level: int, sample, deadline, report,
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
                    # Listed at the start and gone now: a gc moved its chunks meanwhile (verify takes no lock),
                    # or level 0 reported it. Not read, so not verified: the report is not complete.
                    data = None
                    skipped.append(name)
                    report.skipped_by = report.skipped_by or "concurrent-gc"
                if data is not None:
                    report.packs_checked += 1
                    report.bytes_checked += len(data)
                    problems = len(found.bad)
                    table, hash_ok = _check_pack_hash(name, data, found, report)
                    if level >= 2 or not hash_ok:
                        _decode_chunks(source, table, found, report, every=not hash_ok)
                    if hash_ok and len(found.bad) == problems:
                        # Only a pack found sound counts as verified: a damaged one stays first in line for
                        # the next partial run (else a rotating --sample exits 0 right after finding it).
                        done.append(name)
                bar.advance(packs[name])
    finally:
        index.mark_verified(done)  # one transaction for the run (also when it is interrupted)
    report.complete = not skipped
    report.packs_skipped = len(skipped)
    report.chunks_skipped = sum(found.chunks_in.get(p, 0) for p in skipped)


def _check_pack_hash(name: str, data, found: Findings, report) -> tuple[PackTable, bool]:
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


def _decode_chunks(source, table: PackTable, found: Findings, report, every: bool = False) -> None:
    """Decode the needed chunks of a pack (deltas through their bases) and re-hash them; ``every``: all of
    them (a pack whose hash failed: the damage is pinned to a chunk where one accounts for it, instead of
    being blamed on every checkpoint with a chunk in the pack, when it lies in a chunk none of them needs)."""
    rows = np.arange(len(table)) if every else np.flatnonzero(found.needed(table.chunk_ids))
    for e in table.entries(rows):
        report.chunks_checked += 1
        _decode_copy(source, e, found.bad, found.stray, found.copies)


def _decode_copy(source, e, bad: dict, stray: list, copies: dict) -> bool:
    """Decode the copy of a chunk at pack entry ``e`` (as its table describes it, not whatever the cache points
    at); whether it decodes. A copy that does not is a problem in ``bad`` (chunk id -> the first one found),
    or in ``stray`` when the index locates another copy that decodes; ``copies`` keeps the entry (verify
    decodes it again when a gc ran meanwhile)."""
    try:
        source.decode_entry(e)
        return True
    except (CorruptChunkError, MissingChunkError, ManifestFormatError) as err:
        copies[(e.pack, e.chunk_id)] = e
        located = _other_good_copy(source, e)
        if located is not None:
            stray.append(Problem(
                ProblemKind.BAD_CHUNK, f"{err}; a stray copy: reads use the copy in pack {located}, which "
                "decodes (the next gc drops this one)", pack=e.pack, chunk_id=e.chunk_id.hex()))
        elif e.chunk_id not in bad:
            bad[e.chunk_id] = Problem(ProblemKind.BAD_CHUNK, str(err), pack=e.pack, chunk_id=e.chunk_id.hex())
        return False


def _other_good_copy(source, entry) -> str | None:
    """The pack of the copy of ``entry``'s chunk that the index locates, when that is another copy and it
    decodes; else None."""
    located = source.store.index.lookup(entry.chunk_id)
    if located is None or (located.pack, located.offset) == (entry.pack, entry.offset):
        return None
    try:
        source.decode_entry(located)
    except (CorruptChunkError, MissingChunkError, ManifestFormatError):
        return None
    return located.pack


class _GcWatch:
    """Whether a gc may have moved or dropped chunks since this was made: gc writes a new gc epoch before it
    deletes a pack and again once every one is gone (repair one before), and holds the exclusive lock
    meanwhile (one held now may be deleting already, under the epoch just read)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.epoch = read_gc_epoch(backend)  # before the locks: a gc that locks after this changes the epoch
        self.running = any(lk.get("kind") == EXCLUSIVE and not lk.get("stale") for lk in list_locks(backend))

    def moved(self) -> bool:
        return self.running or read_gc_epoch(self.backend) != self.epoch


_SETTLE_TRIES = 3  # windows in which to check the findings again, while gcs keep running
_SETTLE_WAIT_S = 1.0  # between two tries while a gc holds the exclusive lock (it may be deleting)
_LOST = (ProblemKind.MISSING_CHUNK, ProblemKind.MISSING_PACK)


def _settle_after_gc(store, watch: _GcWatch, found: Findings, report: VerifyReport, level: int) -> None:
    """When a gc ran meanwhile, check each finding again against the store as it is now (the index refreshed,
    the manifests and packs listed again), in a window no gc touches (the epoch unchanged from before it to
    after, and no gc running at its start): a chunk the gc moved (a delta whose base went to another pack, a
    pack gone between the listing and its read) or dropped with checkpoints forgotten meanwhile is no damage,
    and only what holds is reported, its pack then marked damaged. Without such a window, a chunk that a
    checkpoint still present needs and no pack of a fresh listing holds is reported all the same (gc publishes
    the copies it moves before it deletes a pack, and drops only what no checkpoint needs: that is loss, not a
    gc's doing); the rest is reported as not checked (``skipped_by="concurrent-gc"``). Without a gc, every
    finding stands as it is."""
    if not watch.moved():
        return
    if not (found.bad or found.stray or any(p.kind is ProblemKind.MANIFEST for p in report.problems)):
        return  # nothing a gc could have caused (a pack it deleted before its read is skipped already)
    for attempt in range(_SETTLE_TRIES):
        window = _GcWatch(store.backend)
        if window.running:  # it may be deleting still: a read failing now proves nothing
            if attempt + 1 < _SETTLE_TRIES:
                time.sleep(_SETTLE_WAIT_S)
            continue
        listed = _fresh_listing(store)
        store.index.set_meta(b"gc_epoch", window.epoch)  # the cache says what the packs say as of this epoch
        again = _Recheck(store, found, report, _sizes(listed), level)
        if not window.moved():
            again.apply(found, report)
            return
    # A gc kept moving chunks: of what it may have caused, only a chunk in no pack present is sure.
    listed = _fresh_listing(store)
    again = _Recheck(store, found, report, _sizes(listed), level)  # what decodes now is checked: it is sound
    lost = {cid: p for cid, p in again.bad.items() if p.kind in _LOST}
    unsettled = len(again.bad) - len(lost) + len(again.stray)
    again.bad, again.stray = lost, []
    again.apply(found, report)
    if unsettled:
        report.chunks_skipped += unsettled
        report.complete = False
        report.skipped_by = report.skipped_by or "concurrent-gc"


def _fresh_listing(store) -> list:
    """The packs listed now, with the index refreshed from that listing."""
    listed = list_packs(store.backend)
    store.refresh_index(pack_stamps(listed))
    return listed


class _Recheck:
    """Each finding of ``found`` checked again against the store as it is now (``packs``: name -> size, listed
    after the index was refreshed); :meth:`apply` puts what holds in its place, once no gc ran meanwhile."""

    def __init__(self, store, found: Findings, report: VerifyReport, packs: dict[str, int], level: int) -> None:
        self.store, self.packs = store, packs
        now = set(store.checkpoint_names())
        self.gone = {n for n in found.names if n not in now} | {
            c for p in report.problems if p.kind is ProblemKind.MANIFEST for c in p.checkpoints if c not in now}
        self.bad: dict[bytes, Problem] = {}
        self.stray: list[Problem] = []
        self.skipped = self.checked = 0
        source = ChunkSource(store, cache_bytes=0)
        elsewhere: list[bytes] = []
        for cid, p in found.bad.items():
            copy = found.copies.get((p.pack, cid))
            if copy is not None and copy.pack in packs:  # the copy found bad is still there: decode it again
                _decode_copy(source, copy, self.bad, self.stray, {})
            elif copy is None and p.kind is ProblemKind.BAD_CHUNK and p.pack in packs:
                self.bad[cid] = p  # its pack's table does not read: no gc's doing
            else:
                elsewhere.append(cid)
        for p in found.stray:
            copy = found.copies.get((p.pack, bytes.fromhex(p.chunk_id)))
            if copy is not None and copy.pack in packs:
                _decode_copy(source, copy, self.bad, self.stray, {})
            # else that copy is gone; reads used another one, found good
        if elsewhere:
            needed, sure = self._needed(found.names, idset.from_ids(elsewhere))
            located = [cid for cid, n in zip(elsewhere, needed.tolist()) if n]
            # What nothing needs now was dropped with the checkpoints forgotten meanwhile: no damage, unless a
            # manifest changed since (then what it needs is not known: not checked).
            self.skipped = 0 if sure else len(elsewhere) - len(located)
            if located:
                self._locate(source, found, located, level)

    def _needed(self, names: list[str], ids: np.ndarray) -> tuple[np.ndarray, bool]:
        """(a bool per id of ``ids``: whether a checkpoint of ``names`` still present needs it, directly or down
        a delta chain; whether every one of them read as before)."""
        refs, sure = idset.Collector(), True
        for name in names:
            if name in self.gone:
                continue
            try:
                self.store.add_manifest_ids(name, refs)
            except CheckpointNotFoundError:
                self.gone.add(name)  # forgotten since the listing above
            except DeltackptError:
                sure = False  # it read before: replaced since (forgotten and saved again)
        return idset.isin(with_chain_bases(self.store, refs.result()), ids), sure

    def _locate(self, source, found: Findings, ids: list[bytes], level: int) -> None:
        """Level 0's checks of ``ids`` against the refreshed index and the packs present; at levels 1-2 each
        one that passes them is also decoded where the index locates it now."""
        again = Findings(users=idset.unique(idset.from_ids(ids)))
        was = {cid: found.bad[cid].pack for cid in ids}  # a pack gone is named in the report
        check_structure(self.store, again, lambda _i, cid: was.get(cid), self.packs, 0, self.store.index, None)
        self.bad.update(again.bad)
        for cid in ids if level >= 1 else ():
            if cid in again.bad:
                continue
            try:
                source.decode_chunk(cid)
                self.checked += 1  # in a pack this run did not read
            except (CorruptChunkError, MissingChunkError, ManifestFormatError) as err:
                entry = self.store.index.lookup(cid)
                self.bad[cid] = Problem(ProblemKind.BAD_CHUNK, str(err), pack=entry.pack if entry else None,
                                        chunk_id=cid.hex())

    def apply(self, found: Findings, report: VerifyReport) -> None:
        found.bad, found.stray = self.bad, self.stray
        report.chunks_checked += self.checked
        found.names = [n for n in found.names if n not in self.gone]
        report.problems = [p for p in report.problems
                           if not (p.kind is ProblemKind.MANIFEST and set(p.checkpoints) & self.gone)]
        report.orphan_packs = [p for p in report.orphan_packs if p in self.packs]  # gc removed the others
        if self.skipped:
            report.chunks_skipped += self.skipped
            report.complete = False
            report.skipped_by = report.skipped_by or "concurrent-gc"


def _attribute(store, found: Findings, report: VerifyReport) -> None:
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
    report.problems.extend(found.stray)
    report.problems.sort(key=lambda p: (p.kind.value, p.pack or "", p.chunk_id or ""))


def _dependents(store, found: Findings, targets: set[bytes]) -> dict[bytes, set[str]]:
    """"checkpoint:item" of every item that reads one of ``targets``, directly or as the base of a delta it
    references: the manifests are read again, so that no attribution is held per reference meanwhile."""
    via: dict[bytes, list[bytes]] = {}  # a referenced delta -> the targets that are its base (down its chain)
    wanted = idset.unique(idset.from_ids(list(targets)))
    is_target = np.concatenate([idset.isin(wanted, found.users), idset.isin(wanted, found.extra_bases)])
    base = found.node_base
    for at, cur in user_deltas(found) if is_target.any() else ():
        for _ in range(chain_limit(store.config)):  # a target anywhere down a referenced delta's chain
            hit = is_target[cur]
            for d, b in zip(at[hit].tolist(), cur[hit].tolist()):
                via.setdefault(found.users[d].tobytes(), []).append(node_id(found, b))
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
