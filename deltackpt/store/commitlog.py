"""The commit log: a record per commit of the packs it added, so a cache that missed a few commits catches up
without a listing of every pack.

A cache remembers the last commit it indexed (``LAST_COMMIT_KEY``, and when known that commit's
``created_ns``). Before a save it must also hold the packs of every commit since, up to the store's newest
(:meth:`Store.index_as_of`). Listing every pack costs a request per 1,000 packs on object storage, and a long
run on many ranks holds 10^5 packs: on a job of many hosts, every host but the committing one missed the
last commit at every save. So :meth:`Store.commit` writes, after its manifest, a record ``commits/<name>``
(:func:`record_commit`)::

    b"DCCR", version byte 1, msgpack(CommitRecord), xxh3-64 of what precedes (LE u64)

``CommitRecord``: ``store_id``, ``name``, ``created_ns`` (the manifest's), ``packs`` (name -> size: the packs
this commit indexed), ``tables`` (name -> the pack's table rows, as the pack stores them; left out when they
would pass ``MAX_TABLE_BYTES`` together), ``epoch`` (the gc epoch the commit was made in) and ``after`` /
``after_ns``: the commit the committing cache had indexed last, before this one (its name and
``created_ns``).

A cache that last saw commit ``L`` (created at ``t``) and is asked for ``H`` reads ``H``'s record, then its
``after``'s, ... until a record names ``L`` created at ``t`` as its ``after``, and indexes those records'
packs with the entries their tables give: a request per missed commit, where a listing and a table read per
new pack cost packs / 1,000 + new packs requests (a save of many ranks adds a pack per rank). A record of an
older gc epoch than the store's gives pack names only (a gc since may have deleted some: their own tables,
read, tell which are left). A table that does not check out as its pack's (:func:`~.pack.entries_from_rows`:
its rows must fill the pack back to back), or was left out, is read from its pack; a cache holding tables
from the log is not trusted as one built from the packs is, so a read that finds a wrong location rebuilds it
from the packs. Each step checks that the record it reads is of the
commit the step before named (same ``created_ns``), so a name forgotten and saved again, or overwritten,
never ends a walk early.

The records are hints, never the truth: no reader needs them, and a record that is wrong costs time (so no feature
gates them; older releases ignore the ``commits/`` prefix). Whenever the walk cannot vouch for every commit
since ``L`` (a record missing: a commit by an older release, a record gc removed, a put that failed;
damaged; of another store or of a later commit of that name; unreadable; a cycle; more than ``MAX_WALK``
steps; ``L`` or its time unknown) the cache lists the packs as before. What a walk can miss is a commit made
concurrently with another (both name the same ``after``): that costs only dedup (the next save re-stores
what the cache lacked), and a read that misses a chunk refreshes from a listing. A gc is not a commit: it
changes the gc epoch, which sends a cache to a listing before it is trusted (:meth:`ChunkIndex.sync`).

An empty cache (a spare host that took over a dead node's work) must index every pack; on object storage,
where that is a request per pack, it reads the commit log first and takes the tables it holds
(:func:`logged_tables`), reading only the other packs' (of commits whose records are gone or left their
tables out). So ``forget`` leaves a checkpoint's record: gc deletes it once none of its packs is left. gc logs
the packs its repacks write the same way (:func:`gc_record`): after a gc most packs may be its merges.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterator
from typing import Annotated, NamedTuple

import msgspec
import xxhash

from ..errors import DeltackptError, ManifestFormatError
from .location import describe
from .manifest import validate_name
from .pack import ROW_SIZE, PackEntry, entries_from_rows, is_pack_name, table_rows
from .threads import ordered_map

MAGIC = b"DCCR"
VERSION = 1
PREFIX = "commits/"
MAX_RECORD_BYTES = 256 << 20
MAX_WALK = 64  # records read to catch up; a cache further behind lists the packs
GC_RECORD_PREFIX = ".gc-"  # names of gc's records: no checkpoint's name starts with "."
# A commit's pack tables in its record, at most: 3.1M entries (a save of 1.2 TB in 1 MiB chunks holds 1.14M).
MAX_TABLE_BYTES = 192 << 20
_DIGEST = struct.Struct("<Q")
log = logging.getLogger("deltackpt.store")


class CommitRecord(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    store_id: str
    name: str
    created_ns: Annotated[int, msgspec.Meta(ge=0)]
    packs: dict[str, Annotated[int, msgspec.Meta(ge=0)]]
    tables: dict[str, bytes] = {}
    epoch: bytes = b""  # the gc epoch the commit was made in: a later gc may have deleted its packs
    after: str | None = None
    after_ns: Annotated[int, msgspec.Meta(ge=0)] | None = None


class Commit(NamedTuple):
    """A commit as a cache remembers it: the checkpoint's name and, when known, its ``created_ns``."""

    name: str
    created_ns: int | None


_DECODER = msgspec.msgpack.Decoder(CommitRecord)


def commit_record_key(name: str) -> str:
    return PREFIX + validate_name(name)


def encode_commit_record(record: CommitRecord) -> bytes:
    out = MAGIC + bytes([VERSION]) + msgspec.msgpack.encode(record)
    return out + _DIGEST.pack(xxhash.xxh3_64_intdigest(out))


def decode_commit_record(data: bytes, name: str, store_id: str) -> CommitRecord | None:
    """The record of commit ``name`` of store ``store_id``, or None when ``data`` is not one (damaged, of an
    unknown version, of another commit or store): the caller then lists the packs."""
    head = len(MAGIC) + 1
    if not head + _DIGEST.size <= len(data) <= MAX_RECORD_BYTES or data[:len(MAGIC)] != MAGIC:
        return None
    if data[len(MAGIC)] != VERSION:
        return None
    view = memoryview(data)  # no copy of the record (its tables: 16 B a chunk) to hash or decode it
    (digest,) = _DIGEST.unpack(view[-_DIGEST.size:])
    if xxhash.xxh3_64_intdigest(view[:-_DIGEST.size]) != digest:
        return None
    try:
        record = _DECODER.decode(view[head:-_DIGEST.size])
    except (msgspec.DecodeError, RecursionError):  # ValidationError included
        return None
    if (record.store_id != store_id or record.name != name or not all(map(is_pack_name, record.packs))
            or not record.tables.keys() <= record.packs.keys()):
        return None
    if record.after is not None:
        try:
            validate_name(record.after)
        except ValueError:
            return None
    return record


def read_commit_record(backend, name: str, store_id: str) -> CommitRecord | None:
    """:func:`decode_commit_record` of the stored record; None when there is none or it cannot be read (a hint:
    a request that failed costs a listing, never the save)."""
    try:
        key = commit_record_key(name)
    except ValueError:  # a name no checkpoint can have
        return None
    return _read_record(backend, key, name, store_id)


def _read_record(backend, key: str, name: str, store_id: str) -> CommitRecord | None:
    try:
        data = bytes(backend.get(key))
    except FileNotFoundError:
        return None
    except (OSError, DeltackptError, ValueError) as exc:
        log.warning("commit record of %s not read (%s: %s); listing the packs instead", name,
                    type(exc).__name__, exc)
        return None
    return decode_commit_record(data, name, store_id)


def gc_record(store_id: str, epoch: bytes, packs: dict[str, tuple[int, list[PackEntry]]]) -> tuple[str, bytes]:
    """(key, bytes) of the record of a gc's repacks: the packs it wrote (name -> (size, entries)) with their
    tables, under a name no checkpoint can have (``.gc-<epoch>``), so an empty cache finds their tables in the
    log too (gc merges the small packs a save of many ranks writes, so after a gc most packs may be its)."""
    name = GC_RECORD_PREFIX + epoch.decode("ascii", "replace")
    entries = [e for _size, es in packs.values() for e in es]
    record = new_record(store_id, name, time.time_ns(), {p: size for p, (size, _) in packs.items()}, entries,
                        None, epoch)
    return PREFIX + name, encode_commit_record(record)


def new_record(store_id: str, name: str, created_ns: int, packs: dict[str, int], entries: list[PackEntry],
               after: Commit | None, epoch: bytes) -> CommitRecord:
    """The record of a commit that indexed ``packs``, whose entries are ``entries`` (every entry of each pack,
    as the commit indexed them; their tables go in when they fit ``MAX_TABLE_BYTES``)."""
    by_pack: dict[str, list[PackEntry]] = {p: [] for p in packs}
    for e in entries:
        if e.pack in by_pack:
            by_pack[e.pack].append(e)
    tables = {}
    if sum(map(len, by_pack.values())) * ROW_SIZE <= MAX_TABLE_BYTES:
        tables = {p: table_rows(es) for p, es in by_pack.items() if es}
    return CommitRecord(store_id=store_id, name=name, created_ns=created_ns, packs=dict(packs), tables=tables,
                        epoch=epoch, after=after and after.name, after_ns=after and after.created_ns)


def record_commit(backend, index, store_id: str, manifest, packs: dict[str, int], entries: list[PackEntry]) -> None:
    """Write the record of the commit of ``manifest`` (which indexed ``packs``, whose entries are ``entries``),
    naming the commit ``index`` (its ChunkIndex) indexed before it. A hint: a record that cannot be written is
    logged, not raised (the checkpoint is committed), and costs a listing of the packs to a cache that catches
    up through it."""
    after = index.last_commit()
    if after is not None and after.name == manifest.name:
        after = None  # an overwrite: the commit before it is not known here
    epoch = index.get_meta(b"gc_epoch") or b""  # synced under this save's lock: no gc since
    record = new_record(store_id, manifest.name, manifest.created_ns, dict(packs), entries, after, epoch)
    try:
        backend.put_transient(commit_record_key(manifest.name), encode_commit_record(record))
    except Exception as exc:  # noqa: BLE001 - the commit stands; only the next catch-up lists the packs
        log.warning("%s: commit record of %s not written (%s: %s)", describe(backend), manifest.name,
                    type(exc).__name__, exc)


def record_names(backend) -> list[str]:
    """The names of the records in the commit log (checkpoints', and gc's ``.gc-<epoch>``)."""
    return [n for n in (info.key[len(PREFIX):] for info in backend.list(PREFIX)) if "/" not in n]


def logged_tables(backend, store_id: str, packs: dict[str, int], threads: int) -> Iterator[tuple[str, bytes]]:
    """(pack, table rows) the commit log holds of those of ``packs`` (name -> size), record by record as they
    are read (``threads`` at once): a listing of ``commits/`` and a read of each record instead of a read per
    pack; nothing when there are as many records as packs. For a cache that must index every pack (an empty
    one: a spare host that took over). A pack is immutable (named by its hash), so a record of any age tells
    its table; the rows are checked when they are used (:func:`~.pack.entries_from_rows`)."""
    names = record_names(backend)
    if len(names) >= len(packs):
        return
    left = dict(packs)
    for record in ordered_map(lambda n: _read_record(backend, PREFIX + n, n, store_id), names, threads):
        if record is not None:
            for pack, rows in record.tables.items():
                if pack in left and left[pack] == record.packs[pack]:
                    del left[pack]
                    yield pack, rows
        if not left:
            return


def records_since(backend, store_id: str, head: CommitRecord, seen: Commit) -> list[CommitRecord] | None:
    """The records of the commits after ``seen`` up to the one of record ``head``, newest first; None when
    the records cannot vouch for every such commit (see the module docstring)."""
    if seen.created_ns is None:
        return None
    records = []
    record, visited = head, {head.name}
    for _ in range(MAX_WALK):
        records.append(record)
        if record.after == seen.name:
            return records if record.after_ns == seen.created_ns else None
        if record.after is None or record.after_ns is None or record.after in visited:
            return None
        visited.add(record.after)
        expected_ns = record.after_ns
        record = read_commit_record(backend, record.after, store_id)
        if record is None or record.created_ns != expected_ns:
            return None  # no record, or one of a later commit of that name than the step before named
    return None
