"""Copy checkpoints between two stores (local <-> object storage, store <-> store), incrementally.

Content addressing makes the copy incremental: the destination is asked which chunks it already holds,
and only the rest is sent, coded as it is stored (no decode, no re-encode). A source pack whose every chunk
is needed and missing is sent whole, under its own name; a pack only part of which is needed (one
checkpoint out of a long history) is re-packed, so the destination never receives unrelated chunks.

Order (why an interrupted copy is safe and resumable): checkpoints go oldest first; for each, its missing
chunks (and their delta bases) are put into packs, the packs are indexed, every referenced chunk is checked
present, and only then the manifest is put -- the same commit rule as a save, so the destination never shows
a checkpoint whose data is not all there. Re-running finds what arrived and sends nothing twice. The
destination is held under a shared lock, like a save, so its gc treats the copy's packs as in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

import msgspec
import numpy as np

from . import codec
from .chains import chain_entries, chain_packs, needed_ids
from .config import CHAINS_FEATURE, MAX_CHAIN, chain_limit, data_features
from ..errors import (CheckpointExistsError, CheckpointNotFoundError, CorruptChunkError, CorruptManifestError,
                      DeltackptError, MissingChunkError)
from .lock import SHARED
from .manifest import Manifest, Stats, encode_manifest
from .pack import HEADER_SIZE, PackBuilder, PackEntry, pack_bytes_ok, pack_key, read_pack_entries
from .progress import Progress, phase
from .retention import DAMAGED_TAGS, read_tags, set_tags
from .source import ChunkSource

MAX_COALESCE_GAP = 64 * 1024  # entries closer than this are read with one ranged GET


@dataclass
class CopyReport:
    copied: list[str] = field(default_factory=list)  # checkpoints put into the destination
    skipped: list[str] = field(default_factory=list)  # already there, identical
    packs_sent: int = 0  # source packs sent whole
    packs_repacked: int = 0  # destination packs built from parts of source packs
    chunks_sent: int = 0
    chunks_skipped: int = 0  # needed chunks the destination already had
    bytes_sent: int = 0  # bytes put into the destination (packs and manifests)
    bytes_skipped: int = 0  # stored bytes of the chunks the destination already had
    seconds: float = 0.0
    damaged: list[str] = field(default_factory=list)  # of all checkpoints (names None): not copied, unreadable
    forgotten: list[str] = field(default_factory=list)  # of all checkpoints: forgotten in the source meanwhile
    verified: bool = False  # whether the copied checkpoints were read back from the destination
    problems: list[str] = field(default_factory=list)  # what that read-back found

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def copy_checkpoints(src, dst, names: Iterable[str] | None = None, *, overwrite: bool = False,
                     progress: Progress | None = None) -> CopyReport:
    """Copy checkpoints ``names`` (default: all, oldest first) from Store ``src`` to Store ``dst``.

    A named checkpoint whose manifest is damaged raises CorruptManifestError when its turn comes; of all
    checkpoints, the damaged ones are left out and listed in ``report.damaged``. A checkpoint forgotten in the
    source while the copy runs (retention, a gc since) is not damage: of all checkpoints it is left out and
    listed in ``report.forgotten``; a named one raises CheckpointNotFoundError.
    ``progress`` hears of each checkpoint sent (a phase ``copy NAME``), in stored bytes, pack by pack."""
    start = time.perf_counter()
    report = CopyReport()
    src.refresh_config(), dst.refresh_config()  # their chain limits as they are now
    infos = src.list_checkpoints(include_damaged=True)
    if names is None:
        order = [i.name for i in infos if i.damage is None]
        report.damaged = [i.name for i in infos if i.damage is not None]
    else:
        wanted = {src.resolve(n) for n in names}
        order = [i.name for i in infos if i.name in wanted]
    dst.ensure_features(data_features(src.config.features))  # not src's config fields' (chain_links)
    with dst.lock(SHARED) as lock:
        dst.index.sync()
        for name in order:
            try:
                _copy_one(src, dst, name, overwrite, lock, report, progress)
            except (CheckpointNotFoundError, MissingChunkError, CorruptChunkError):
                if src.exists(name):
                    raise  # still there: its chunks really are missing or damaged
                if names is not None:
                    raise CheckpointNotFoundError(name, reason="forgotten in the source during the copy") from None
                report.forgotten.append(name)
    report.seconds = time.perf_counter() - start
    return report


def _needed_entries(src, manifest: Manifest) -> dict[bytes, PackEntry]:
    """Every chunk the checkpoint reads, with the bases its deltas are coded against (down each chain)."""
    ids = {ref.id for it in manifest.items for ref in it.chunks}
    for attempt in range(2):
        found = chain_entries(src.index, ids, chain_limit(src.config))
        missing = (ids | needed_ids(found)) - found.keys()
        if not missing:
            return found
        if attempt == 0:  # a cache that missed a commit (or the walk of the commit log did): look again
            src.refresh_index()
    raise MissingChunkError(next(iter(missing)).hex(), checkpoint=manifest.name)


def _copy_one(src, dst, name: str, overwrite: bool, lock, report: CopyReport, progress) -> None:
    manifest = src.read_manifest(name)
    if dst.exists(name):
        try:
            theirs = dst.read_manifest(name)
        except CorruptManifestError:
            if not overwrite:
                raise CheckpointExistsError(name, "in the destination, its manifest damaged (--overwrite replaces "
                                                  "it with the source's)") from None
            theirs = None
        if theirs is not None and _same_content(theirs, manifest):
            if not _holds_damage(dst, manifest):
                report.skipped.append(name)
                _copy_tags(src, dst, name)
                return
            overwrite = True  # the same checkpoint, its data damaged or lost there: the source's is sent again
        elif not overwrite:
            raise _exists_error(name)
    packs: dict[str, int] = {}  # what this copy put into the destination, kept across a retry
    entries: list[PackEntry] = []
    for last in (False, True):
        skipped = _send_all(src, dst, name, manifest, packs, entries, report, progress)
        body = msgspec.structs.replace(
            manifest, store_id=dst.config.store_id,
            stats=Stats(logical_bytes=manifest.stats.logical_bytes, stored_bytes=sum(packs.values()),
                        num_chunks=manifest.stats.num_chunks, new_chunks=len(entries)))
        try:  # create-if-absent unless told to replace: another writer may have committed this name meanwhile
            committed = dst.commit(name, body.items, entries=entries, packs=packs, metadata=body.metadata,
                                   layer_data=body.layer_data, parent=body.parent, overwrite=overwrite, lock=lock,
                                   created_ns=manifest.created_ns)
        except CheckpointExistsError:
            if not _same_content(dst.read_manifest(name), manifest):
                raise _exists_error(name) from None
            report.skipped.append(name)  # the same checkpoint, committed by another copy meanwhile
        except MissingChunkError:
            if last:
                raise
            # A chunk the destination's index located is not there: its pack went outside deltackpt (a bucket
            # lifecycle rule, a manual delete). The index, refreshed, no longer locates it: send it again, once.
            dst.refresh_index()
            continue
        else:
            report.bytes_sent += len(encode_manifest(committed))
            report.copied.append(name)
        break
    report.chunks_skipped += len(skipped)
    report.bytes_skipped += sum(e.span for e in skipped)
    _copy_tags(src, dst, name)


def _send_all(src, dst, name: str, manifest: Manifest, packs: dict[str, int], entries: list[PackEntry],
              report: CopyReport, progress) -> list[PackEntry]:
    """:func:`_send_chunks`, once more after a gc of the source moved chunks. When it fails (a dropped link,
    throttling past the retries), the packs it did put are indexed in ``dst`` first: a retry (the next
    save's upload, say) finds them there instead of sending them all again."""
    try:
        try:
            return _send_chunks(src, dst, name, manifest, packs, entries, report, progress)
        except _PackGone:
            src.refresh_index()  # a gc of the source moved the chunks since its index was read: find them
        try:
            return _send_chunks(src, dst, name, manifest, packs, entries, report, progress)
        except _PackGone as gone:
            raise CorruptChunkError(f"pack {gone.pack} of the source is missing; run `deltackpt verify` on the "
                                    "source", pack=gone.pack, checkpoint=name) from None
    except BaseException:
        if packs:
            try:
                dst.index.add(entries, dict(packs))
            except Exception:  # noqa: BLE001 - the copy's own error matters more; a retry then resends them
                pass
        raise


def _holds_damage(dst, manifest: Manifest) -> bool:
    """Whether a chunk ``manifest`` reads (or a base of it) is not located in ``dst`` (its pack lost), or is
    located in a pack of ``dst`` a read or verify found damaged."""
    ids = {ref.id for it in manifest.items for ref in it.chunks}
    limit = chain_limit(dst.config)
    held = chain_entries(dst.index, ids, limit)
    if (ids | needed_ids(held)) - held.keys():
        return True
    damaged = dst.index.damaged_packs(refresh=True)
    return bool(damaged) and any(chain_packs(cid, held, limit) & damaged for cid in ids)


class _PackGone(Exception):
    def __init__(self, pack: str) -> None:
        super().__init__(pack)
        self.pack = pack


def _exists_error(name: str) -> CheckpointExistsError:
    return CheckpointExistsError(name, "in the destination, with other data",
                                 hint="copy with overwrite=True (--overwrite) to replace it")


def _send_chunks(src, dst, name: str, manifest: Manifest, packs: dict[str, int], entries: list[PackEntry],
                 report: CopyReport, progress) -> list[PackEntry]:
    """Put the chunks ``manifest`` needs and ``dst`` lacks (nor holds from an earlier attempt, ``entries``)
    into ``dst``, adding to ``packs`` and ``entries``; returns the needed entries ``dst`` already held.
    Raises _PackGone when a source pack is not there."""
    needed = _needed_entries(src, manifest)
    have = dst.index.lookup_many(needed.keys())
    damaged = dst.index.damaged_packs(refresh=True)
    if damaged and have:  # a copy a read found damaged there is no copy: the source's is sent instead
        limit = chain_limit(dst.config)
        held = chain_entries(dst.index, have.keys(), limit)
        have = {cid: e for cid, e in have.items() if not chain_packs(cid, held, limit) & damaged}
    sent = {e.chunk_id for e in entries}
    send = {cid: e for cid, e in needed.items() if cid not in have and cid not in sent}
    _fit_chains(dst, send, needed, entries, name, src.config.max_chain)
    by_pack: dict[str, list[PackEntry]] = {}
    for e in send.values():
        by_pack.setdefault(e.pack, []).append(e)
    builder = _Repacker(dst)
    check = _PayloadCheck(src, name)
    with phase(progress, f"copy {name}", sum(e.span for e in send.values()), "B") as bar:
        for pack, wanted in sorted(by_pack.items()):
            try:
                table = read_pack_entries(src.backend, pack)
                whole = len(table) == len(wanted)  # the whole pack is needed: send it as is, under its name
                data = src.backend.get(pack_key(pack)) if whole else None
            except FileNotFoundError:
                raise _PackGone(pack) from None
            if whole:
                if not pack_bytes_ok(pack, data):
                    raise CorruptChunkError(f"pack {pack} of the source does not match its hash; run "
                                            "`deltackpt verify` on the source", pack=pack, checkpoint=name)
                dst.backend.put(pack_key(pack), data)
                packs[pack] = len(data)
                entries.extend(table)  # same name, same bytes: same offsets
                report.packs_sent += 1
                report.bytes_sent += len(data)
            else:
                read = list(_source_reads(pack, _read_payloads(src.backend, pack, wanted)))
                check.fetch_bases(wanted, read)
                for e, stored in read:
                    check(e, stored)
                    sealed = builder.add(e, stored[HEADER_SIZE:])
                    if sealed is not None:
                        _account(sealed, packs, entries, report)
            report.chunks_sent += len(wanted)
            bar.advance(sum(e.span for e in wanted))
    sealed = builder.finish()
    if sealed is not None:
        _account(sealed, packs, entries, report)
    return [needed[c] for c in have]


def _source_reads(pack: str, reads):
    """``reads`` (a generator reading pack ``pack`` of the source), a missing pack raised as _PackGone."""
    try:
        yield from reads
    except FileNotFoundError:
        raise _PackGone(pack) from None


def _fit_chains(dst, send: dict[bytes, PackEntry], needed: dict[bytes, PackEntry], earlier: list[PackEntry],
                name: str, src_max_chain: int = 1) -> None:
    """Keep the chains the sent chunks make in ``dst`` within what its readers follow. Two stores may code a
    chunk differently: a sent delta whose base ``dst`` holds as a delta of its own makes a chain longer than
    either store's. Then the source's copy of that base is sent too when it is a keyframe (the destination's
    index locates a keyframe copy first), else ``dst`` gains the feature ``delta-chains``; past MAX_CHAIN, an
    error before anything is sent. ``earlier``: entries an earlier attempt of this copy sent."""
    limit = chain_limit(dst.config)
    # Longer than either store's max_chain: the source's keyframe of the base goes along (never past limit).
    bound = min(limit, max(dst.config.max_chain, src_max_chain))
    sent_before = {e.chunk_id: e for e in earlier}
    held = {e.base_id for e in send.values() if e.base_id is not None and e.base_id not in send
            and e.base_id not in sent_before}
    if not held:
        return  # the sent chains are the source's, within its limit (dst has its features)
    below = chain_entries(dst.index, held, MAX_CHAIN)

    def deepest() -> tuple[int, dict[bytes, int]]:
        depth: dict[bytes, int] = {}  # deltas from a chunk down to its keyframe, as dst will hold it
        for cid in send:
            path, at = [], cid
            while at not in depth:
                e = send.get(at) or sent_before.get(at) or below.get(at)
                if e is None or e.base_id is None or len(path) > MAX_CHAIN:  # a keyframe, missing (the commit
                    depth[at] = 0 if e is None or e.base_id is None else MAX_CHAIN + 1  # says so), a cycle
                    break
                path.append(at)
                at = e.base_id
            d = depth[at]
            for c in reversed(path):
                d += 1
                depth[c] = d
        return max((depth[c] for c in send), default=0), depth

    worst, depth = deepest()
    if worst <= bound:
        return
    for base in held:  # the source's keyframe of a base dst holds as a delta: its chain ends there
        if depth.get(base, 0) and needed.get(base) is not None and needed[base].base_id is None:
            send[base] = needed[base]
    worst, depth = deepest()
    if worst <= limit:
        return
    if worst > MAX_CHAIN:
        raise DeltackptError(f"copy of {name!r}: a chunk would be a delta more than {MAX_CHAIN} deep in the "
                             "destination (its base is coded there as a deeper delta); nothing of it was sent")
    dst.ensure_features([CHAINS_FEATURE])


def _copy_tags(src, dst, name: str) -> None:
    """Add the source's tags of ``name`` to the destination's (a pin survives the copy, e.g. an upload)."""
    tags = [t for t in read_tags(src, name) if t != DAMAGED_TAGS]  # a damaged object: nothing to carry
    if tags and not set(tags) <= set(theirs := read_tags(dst, name)):
        set_tags(dst, name, [*theirs, *tags])


def _account(sealed, packs, entries, report) -> None:
    name, size, sealed_entries = sealed
    packs[name] = size
    entries.extend(sealed_entries)
    report.packs_repacked += 1
    report.bytes_sent += size


class _PayloadCheck:
    """Checks a chunk sent without its whole pack as a read of it would (header against the source's index,
    decoded, hashed; a delta against its base read from the source): a pack sent whole is checked by its
    name, and a copy must not carry damage a load would refuse into a store that then calls it good. The
    links of the deltas' chains are read first, a ranged read per stretch of each pack that holds them
    (a read each was a request per delta: from object storage, a round trip each)."""

    def __init__(self, src, name: str) -> None:
        self.src = src
        self.source = ChunkSource(src)
        self.name = name
        self.scratch = np.empty(0, dtype=np.uint8)
        self.fetched: dict[tuple[str, int], object] = {}

    def fetch_bases(self, wanted: list[PackEntry], read: list) -> None:
        """The stored bytes of every link below the deltas of ``wanted`` (``read``: theirs, as read)."""
        self.fetched = {(e.pack, e.offset): stored for e, stored in read}
        bases = {e.base_id for e in wanted if e.base_id is not None}
        if not bases:
            return
        links = chain_entries(self.src.index, bases, chain_limit(self.src.config))
        by_pack: dict[str, list[PackEntry]] = {}
        for e in links.values():
            if (e.pack, e.offset) not in self.fetched:
                by_pack.setdefault(e.pack, []).append(e)
        for pack, entries in by_pack.items():
            try:
                for e, stored in _read_payloads(self.src.backend, pack, entries):
                    self.fetched[(e.pack, e.offset)] = stored
            except (FileNotFoundError, CorruptChunkError):
                pass  # read again, one at a time, by the check, which then names the damage

    def __call__(self, e: PackEntry, stored) -> None:
        if self.scratch.size < e.raw_len:
            self.scratch = np.empty(e.raw_len, dtype=np.uint8)
        out = self.scratch[:e.raw_len]
        head, payload = stored[:HEADER_SIZE], stored[HEADER_SIZE:]
        if e.codec == codec.RAW:  # checked where it is (decode_read's convention for a raw chunk)
            if len(payload) == e.raw_len:
                out[:] = np.frombuffer(payload, dtype=np.uint8)
            payload = out
        self.source.decode_read(e, head, payload, len(stored), out, checkpoint=self.name, fetched=self.fetched)


def _read_payloads(backend, pack: str, wanted: list[PackEntry]):
    """(entry, its stored bytes: header and payload) for ``wanted`` entries of one pack, adjacent ones fetched by
    one ranged read."""
    key = pack_key(pack)
    wanted = sorted(wanted, key=lambda e: e.offset)
    i = 0
    while i < len(wanted):
        j = i + 1
        while j < len(wanted) and wanted[j].offset - (wanted[j - 1].offset + wanted[j - 1].span) <= MAX_COALESCE_GAP:
            j += 1
        first, last = wanted[i], wanted[j - 1]
        data = memoryview(backend.get_range(key, first.offset, last.offset + last.span - first.offset))
        for e in wanted[i:j]:
            at = e.offset - first.offset + HEADER_SIZE
            payload = data[at:at + e.stored_len]
            if len(payload) != e.stored_len:
                raise CorruptChunkError(f"pack {pack} of the source is truncated", pack=pack)
            yield e, data[at - HEADER_SIZE:at + e.stored_len]
        i = j


class _Repacker:
    """Coded chunks into destination packs of the destination's target size."""

    def __init__(self, dst) -> None:
        self.dst = dst
        self.builder: PackBuilder | None = None

    def add(self, e: PackEntry, payload):
        if self.builder is None:
            self.builder = PackBuilder(None)
        self.builder.add(e.chunk_id, e.codec, e.elem_size, e.raw_len, payload, e.base_id, e.age)
        if self.builder.size_bytes >= self.dst.config.pack_target_bytes:
            return self.finish()
        return None

    def finish(self):
        if self.builder is None or not len(self.builder):
            return None
        builder, self.builder = self.builder, None
        return builder.publish(self.dst.backend)


def _same_content(a: Manifest, b: Manifest) -> bool:
    return (a.created_ns == b.created_ns and a.metadata == b.metadata
            and [(i.key, i.nbytes, [r.id for r in i.chunks]) for i in a.items]
            == [(i.key, i.nbytes, [r.id for r in i.chunks]) for i in b.items])


def open_or_create_destination(src, dst, storage_options: dict | None = None):
    """The destination Store: opened, or created with the source's settings (same chunking, so the next
    save into it deduplicates and delta-codes against what was copied)."""
    from .config import CONFIG_KEY
    from .location import open_backend
    from .repository import Store

    if isinstance(dst, Store):
        return dst
    backend = open_backend(dst, storage_options)
    if backend.exists(CONFIG_KEY):
        return Store.open(backend)
    settings = msgspec.structs.asdict(src.config)
    for key in ("store_id", "format_version"):
        settings.pop(key)
    return Store.init(backend, exist_ok=True, **settings)


def copy(src, dst, checkpoints: Iterable[str] | None = None, *, verify: bool = False, overwrite: bool = False,
         src_storage_options: dict | None = None, dst_storage_options: dict | None = None,
         progress: Progress | None = None) -> CopyReport:
    """Copy ``checkpoints`` (default: all) from store ``src`` to store ``dst`` (paths, URLs or Stores).

    The destination is created with the source's settings if it does not exist. With ``verify``, every
    copied checkpoint is then read back from the destination and re-hashed (``report.problems``).
    """
    from .repository import Store
    from .verify import verify_store

    src_store = src if isinstance(src, Store) else Store.open(src, storage_options=src_storage_options)
    if checkpoints is not None:
        checkpoints = [src_store.resolve(n) for n in checkpoints]  # a wrong name creates no destination
    dst_store = open_or_create_destination(src_store, dst, dst_storage_options)
    report = copy_checkpoints(src_store, dst_store, checkpoints, overwrite=overwrite, progress=progress)
    if verify:
        checked = report.copied + report.skipped
        found = verify_store(dst_store, level=2, checkpoints=checked, progress=progress) if checked else None
        report.problems = [p.detail for p in found.problems] if found is not None else []
        report.verified = True
    return report
