"""Packs: immutable objects holding many coded chunks, named by the hash of their bytes.

Layout (all integers little-endian)::

    pack    := MAGIC(8) entry* table footer
    entry   := header(64) payload(stored_len)
    header  := b"DCE1" codec:u8 elem_size:u8 age:u16 raw_len:u64 stored_len:u64
               chunk_id:16B base_id:16B header_hash:u64        (xxh3-64 of the 56 bytes before it)
    table   := row(64) * num_entries
    row     := chunk_id:16B base_id:16B offset:u64 stored_len:u64 raw_len:u64 codec:u8 elem_size:u8 age:u16 pad:4
    footer  := table_offset:u64 num_entries:u64 table_hash:u64 version:u16 pad:u16 b"DCPK"

``offset`` is where the entry header starts. ``base_id`` is all zeros unless the chunk is a delta; ``age`` is
0 for a keyframe and, for a delta, how many checkpoints its base keyframe has served (the refresh policy). The
header makes each entry self-describing (a damaged table can be rebuilt by walking entries); the table lets
the index be rebuilt from the pack's tail with one ranged read. The pack is stored under
``packs/<name[:2]>/<name>`` where ``name`` is the xxh3-128 of all its bytes, so a pack's integrity can be
checked without any other object.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from ..errors import ManifestFormatError
from .backend import raise_if_disk_full
from .codec import CODEC_NAMES, DELTA_CODECS, VALID_ELEM_SIZES, is_delta

PACK_MAGIC = b"DCPACK\x00\x01"
ENTRY_MAGIC = b"DCE1"
FOOTER_MAGIC = b"DCPK"
PACK_VERSION = 1
NO_BASE = bytes(16)
# A coded chunk up to this size is joined with its header into one write, which a spool file's buffer of the
# same size takes as a copy: a pack of 200 small chunks costs a few write calls, not 7 per chunk (3.4 ms of a
# fine-tune's first save, now 1.0). Larger parts go to the file as they are, never copied.
JOIN_BYTES = 256 * 1024
# Upper bound for one chunk's raw length; a forged length beyond it is rejected before any allocation.
MAX_CHUNK_BYTES = 1 << 30

_HEADER = struct.Struct("<4sBBHQQ16s16s")  # 56 bytes, followed by the u64 header hash
HEADER_SIZE = _HEADER.size + 8
# An entry header as a numpy dtype: a batch of headers checked in arrays (ChunkSource.check_reads).
HEADER_DTYPE = np.dtype([("magic", "S4"), ("codec", "u1"), ("elem_size", "u1"), ("age", "<u2"), ("raw_len", "<u8"),
                         ("stored_len", "<u8"), ("chunk_id", "V16"), ("base", "V16"), ("digest", "<u8")])
_ROW = struct.Struct("<16s16sQQQBBH4x")
ROW_SIZE = _ROW.size
_FOOTER = struct.Struct("<QQQHH4s")
FOOTER_SIZE = _FOOTER.size
assert HEADER_SIZE == HEADER_DTYPE.itemsize == 64 and ROW_SIZE == 64 and FOOTER_SIZE == 32


@dataclass(frozen=True, slots=True)
class PackEntry:
    """Where one chunk lives: pack name and the byte offset of its entry header."""

    chunk_id: bytes
    pack: str
    offset: int
    stored_len: int
    raw_len: int
    codec: int
    elem_size: int
    base_id: bytes | None = None
    age: int = 0

    @property
    def span(self) -> int:
        return HEADER_SIZE + self.stored_len


def pack_key(name: str) -> str:
    return f"packs/{name[:2]}/{name}"


def pack_name_from_key(key: str) -> str | None:
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "packs" and is_pack_name(parts[2]) and parts[1] == parts[2][:2]:
        return parts[2]
    return None


def list_packs(backend) -> dict[str, object]:
    """Pack name -> its ObjectInfo, from one listing of ``packs/`` (other keys there are not packs)."""
    out = {}
    for info in backend.list("packs/"):
        name = pack_name_from_key(info.key)
        if name is not None:
            out[name] = info
    return out


def pack_stamps(listed: dict[str, object]) -> dict[str, tuple[int, float]]:
    """A pack listing (:func:`list_packs`) as the index cache compares it: name -> (size, mtime)."""
    return {name: (info.size_bytes, info.mtime_s) for name, info in listed.items()}


def is_pack_name(s: str) -> bool:
    """Whether ``s`` is a pack's name: 32 lowercase hex digits (its xxh3-128)."""
    return len(s) == 32 and all(c in "0123456789abcdef" for c in s)


def _check_fields(codec: int, elem_size: int, raw_len: int, stored_len: int, where: str) -> None:
    if codec not in CODEC_NAMES:
        raise ManifestFormatError(f"{where}: unknown codec id {codec}")
    if elem_size not in VALID_ELEM_SIZES:
        raise ManifestFormatError(f"{where}: invalid element size {elem_size}")
    if raw_len > MAX_CHUNK_BYTES or stored_len > MAX_CHUNK_BYTES + (1 << 20):
        raise ManifestFormatError(f"{where}: chunk length out of bounds")


def encode_header(chunk_id: bytes, codec: int, elem_size: int, raw_len: int, stored_len: int, base_id,
                  age: int = 0) -> bytes:
    head = _HEADER.pack(ENTRY_MAGIC, codec, elem_size, age, raw_len, stored_len, chunk_id, base_id or NO_BASE)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def decode_header(buf, where: str) -> tuple[bytes, int, int, int, int, bytes | None]:
    """(chunk_id, codec, elem_size, raw_len, stored_len, base_id, age) of an entry header."""
    if len(buf) < HEADER_SIZE:
        raise ManifestFormatError(f"{where}: entry header truncated")
    head = bytes(buf[: _HEADER.size])
    (digest,) = struct.unpack_from("<Q", buf, _HEADER.size)
    if xxhash.xxh3_64_intdigest(head) != digest:
        raise ManifestFormatError(f"{where}: entry header checksum mismatch")
    magic, codec, elem_size, age, raw_len, stored_len, chunk_id, base = _HEADER.unpack(head)
    if magic != ENTRY_MAGIC:
        raise ManifestFormatError(f"{where}: bad entry magic")
    _check_fields(codec, elem_size, raw_len, stored_len, where)
    return chunk_id, codec, elem_size, raw_len, stored_len, (None if base == NO_BASE else base), age


class PackBuilder:
    """Accumulates coded chunks into one pack. Not thread-safe.

    With ``spool`` (a file path on the store's own filesystem) entries are streamed to that file and hashed
    as they come, so a pack never sits in memory and publishing it is a rename; without it they accumulate
    in memory (object-store and in-memory backends).
    """

    def __init__(self, spool: str | os.PathLike | None = None) -> None:
        self._rows: list[tuple] = []
        self._hash = xxhash.xxh3_128()
        self._spool = spool
        self._buf = bytearray()
        self._size = 0
        self._broken: BaseException | None = None
        self._file = open(spool, "wb", buffering=JOIN_BYTES) if spool is not None else None
        try:
            self._write(PACK_MAGIC)
        except BaseException:
            # Not yet known to any caller, so none could remove the file: a Ctrl-C that lands here (its
            # handler runs at the first Python call after the open) would leave it behind.
            self.discard()
            raise

    def _write(self, data) -> None:
        if self._broken is not None:
            raise self._broken  # the first failure again: never write past it
        try:
            if self._file is not None:
                try:
                    self._file.write(data)
                except OSError as e:
                    raise_if_disk_full(e, self._spool, len(data))
                    raise
            else:
                self._buf += memoryview(data)
        except BaseException as e:
            # Part of ``data`` may be in the spool file: this pack's offsets (and its name) no longer hold, so
            # no later add, seal or publish may use it (another coding thread's add would publish it).
            self._broken = e
            raise
        self._hash.update(data)
        self._size += len(data)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def size_bytes(self) -> int:
        return self._size

    def add(self, chunk_id: bytes, codec: int, elem_size: int, raw_len: int, stored, base_id=None,
            age: int = 0) -> int:
        offset = self._size
        header = encode_header(chunk_id, codec, elem_size, raw_len, len(stored), base_id, age)
        parts = getattr(stored, "parts", (stored,))
        if len(stored) <= JOIN_BYTES:
            # One hash update and one (buffered) write for a small chunk's header and parts.
            self._write(b"".join((header, *parts)))
        else:
            self._write(header)
            for part in parts:
                self._write(part)
        self._rows.append((chunk_id, base_id or NO_BASE, offset, len(stored), raw_len, codec, elem_size, age))
        return offset

    def _finish(self) -> tuple[str, list[PackEntry]]:
        table_offset = self._size
        table = b"".join(_ROW.pack(*row) for row in self._rows)
        self._write(table)
        self._write(_FOOTER.pack(
            table_offset, len(self._rows), xxhash.xxh3_64_intdigest(table), PACK_VERSION, 0, FOOTER_MAGIC))
        name = self._hash.hexdigest()
        entries = [
            PackEntry(cid, name, off, slen, rlen, codec, es, None if base == NO_BASE else base, age)
            for cid, base, off, slen, rlen, codec, es, age in self._rows
        ]
        return name, entries

    def seal(self) -> tuple[str, bytearray, list[PackEntry]]:
        """(name, pack bytes, entries) of an in-memory builder. The builder must not be used afterwards."""
        if self._file is not None:
            raise RuntimeError("seal() is for in-memory builders; use publish()")
        name, entries = self._finish()
        data, self._buf = self._buf, bytearray()
        return name, data, entries

    def publish(self, backend) -> tuple[str, int, list[PackEntry]]:
        """Finish the pack and store it under its name. Returns (name, size, entries)."""
        if self._file is None:
            name, data, entries = self.seal()
            backend.put(pack_key(name), data)
            return name, len(data), entries
        name, entries = self._finish()
        size = self._size
        f, self._file = self._file, None
        try:
            backend.put_spooled(pack_key(name), f)
        except BaseException:
            _remove_spool(f, self._spool)
            raise
        return name, size, entries

    def discard(self) -> None:
        """Drop an unpublished pack and its spool file."""
        f, self._file = self._file, None
        if f is not None:
            _remove_spool(f, self._spool)


def _remove_spool(f, path) -> None:
    try:
        f.close()
    except OSError:
        pass  # a failed flush (a full disk) still closes the file, whose bytes are thrown away anyway
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def parse_footer(tail: bytes, pack_size: int, name: str) -> tuple[int, int]:
    """(table_offset, num_entries) from the last FOOTER_SIZE bytes of a pack, bounds-checked."""
    if pack_size < len(PACK_MAGIC) + FOOTER_SIZE or len(tail) != FOOTER_SIZE:
        raise ManifestFormatError(f"pack {name}: too short ({pack_size} bytes)")
    table_offset, num, _table_hash, version, _pad, magic = _FOOTER.unpack(tail)
    if magic != FOOTER_MAGIC:
        raise ManifestFormatError(f"pack {name}: bad footer magic (truncated or not a pack)")
    if version > PACK_VERSION:
        raise ManifestFormatError(f"pack {name}: pack version {version} is newer than supported")
    if table_offset < len(PACK_MAGIC) or table_offset + num * ROW_SIZE + FOOTER_SIZE != pack_size:
        raise ManifestFormatError(f"pack {name}: table bounds do not match the pack size")
    return table_offset, num


def parse_table(table: bytes, tail: bytes, name: str) -> list[PackEntry]:
    """Entries of a pack from its table bytes and footer, with every row bounds-checked."""
    table_offset, num, table_hash, _v, _p, _m = _FOOTER.unpack(tail)
    if len(table) != num * ROW_SIZE:
        raise ManifestFormatError(f"pack {name}: table truncated")
    if xxhash.xxh3_64_intdigest(table) != table_hash:
        raise ManifestFormatError(f"pack {name}: table checksum mismatch")
    entries = []
    prev_end = len(PACK_MAGIC)
    for i in range(num):
        cid, base, off, slen, rlen, codec, es, age = _ROW.unpack_from(table, i * ROW_SIZE)
        where = f"pack {name} row {i}"
        _check_fields(codec, es, rlen, slen, where)
        if off < prev_end or off + HEADER_SIZE + slen > table_offset:
            raise ManifestFormatError(f"{where}: entry out of bounds")
        prev_end = off + HEADER_SIZE + slen
        if is_delta(codec) != (base != NO_BASE):
            raise ManifestFormatError(f"{where}: base id must be set exactly for delta chunks")
        entries.append(PackEntry(cid, name, off, slen, rlen, codec, es, None if base == NO_BASE else base, age))
    return entries


_ROW_DTYPE = np.dtype([("chunk_id", "V16"), ("base_id", "V16"), ("offset", "<u8"), ("stored_len", "<u8"),
                       ("raw_len", "<u8"), ("codec", "u1"), ("elem_size", "u1"), ("age", "<u2"), ("pad", "V4")])
assert _ROW_DTYPE.itemsize == ROW_SIZE


@dataclass(frozen=True)
class PackTable:
    """A pack's table as arrays, one position per entry (a numpy view of the table bytes): for passes over
    many packs that need no :class:`PackEntry` per entry (gc planning, verify). Field arrays are read-only."""

    name: str
    rows: np.ndarray  # structured, one row per entry, as stored

    @classmethod
    def from_entries(cls, name: str, entries: list[PackEntry]) -> "PackTable":
        """The table of ``entries`` (e.g. those :func:`walk_entries` recovered)."""
        return cls(name, np.array([(e.chunk_id, e.base_id or NO_BASE, e.offset, e.stored_len, e.raw_len, e.codec,
                                    e.elem_size, e.age, b"") for e in entries], dtype=_ROW_DTYPE))

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def chunk_ids(self) -> np.ndarray:
        """V16 ids (see :mod:`.idset`), in table order."""
        return self.rows["chunk_id"]

    @property
    def base_ids(self) -> np.ndarray:
        """V16, all zero bytes where the entry is not a delta."""
        return self.rows["base_id"]

    @property
    def has_base(self) -> np.ndarray:
        return np.isin(self.rows["codec"], DELTA_CODECS)  # the parse checked: a delta exactly when a base is set

    @property
    def offsets(self) -> np.ndarray:
        return self.rows["offset"]

    @property
    def stored_lens(self) -> np.ndarray:
        return self.rows["stored_len"]

    def entry(self, i: int) -> PackEntry:
        r = self.rows[i]
        base = r["base_id"].tobytes()
        return PackEntry(r["chunk_id"].tobytes(), self.name, int(r["offset"]), int(r["stored_len"]),
                         int(r["raw_len"]), int(r["codec"]), int(r["elem_size"]),
                         None if base == NO_BASE else base, int(r["age"]))

    def entries(self, at=None) -> list[PackEntry]:
        """The entries at positions ``at`` (all by default) as PackEntry objects."""
        return [self.entry(i) for i in (range(len(self.rows)) if at is None else at)]


def parse_table_arrays(table, tail: bytes, name: str) -> PackTable:
    """:func:`parse_table` in vectorised passes, returning arrays: the same checks, and a table that fails
    any of them raises the very error :func:`parse_table` raises (it is asked to name the first bad row)."""
    table_offset, num, table_hash, _v, _p, _m = _FOOTER.unpack(tail)
    if len(table) != num * ROW_SIZE:
        raise ManifestFormatError(f"pack {name}: table truncated")
    if xxhash.xxh3_64_intdigest(table) != table_hash:
        raise ManifestFormatError(f"pack {name}: table checksum mismatch")
    rows = np.frombuffer(table, dtype=_ROW_DTYPE)
    if not _rows_ok(rows, table_offset):
        parse_table(table, tail, name)
        raise AssertionError(f"pack {name}: vectorised and row-by-row table checks disagree")
    return PackTable(name, rows)


def _rows_ok(rows: np.ndarray, table_offset: int) -> bool:
    """Whether every row passes :func:`parse_table`'s checks (fields, bounds, order, base iff delta)."""
    codec, slen, off = rows["codec"], rows["stored_len"], rows["offset"]
    if not (np.isin(codec, list(CODEC_NAMES)).all() and np.isin(rows["elem_size"], VALID_ELEM_SIZES).all()
            and (rows["raw_len"] <= MAX_CHUNK_BYTES).all() and (slen <= MAX_CHUNK_BYTES + (1 << 20)).all()):
        return False
    end_limit = np.uint64(table_offset)
    # Written so that no sum can wrap around: an offset past the table fails before it is added to.
    if not ((off <= end_limit) & (slen + np.uint64(HEADER_SIZE) <= end_limit - np.minimum(off, end_limit))).all():
        return False
    ends = off + np.uint64(HEADER_SIZE) + slen
    if len(rows) and (off[0] < len(PACK_MAGIC) or (off[1:] < ends[:-1]).any()):
        return False
    has_base = rows["base_id"] != np.void(NO_BASE)
    return bool((np.isin(codec, DELTA_CODECS) == has_base).all())


def table_rows(entries: list[PackEntry]) -> bytes:
    """The table of the pack that holds exactly ``entries`` (in any order), as its rows are stored."""
    rows = sorted(entries, key=lambda e: e.offset)
    return b"".join(_ROW.pack(e.chunk_id, e.base_id or NO_BASE, e.offset, e.stored_len, e.raw_len, e.codec,
                              e.elem_size, e.age) for e in rows)


def entries_from_rows(rows: bytes, pack_size: int, name: str) -> list[PackEntry]:
    """The entries of pack ``name`` (``pack_size`` bytes) from table rows held elsewhere (a commit record),
    checked as :func:`parse_table` checks the pack's own, and, since a pack holds its entries back to back
    (PackBuilder), to fill it exactly: a row left out cannot pass. ManifestFormatError if they could not be
    its table."""
    num, rest = divmod(len(rows), ROW_SIZE)
    table_offset = pack_size - len(rows) - FOOTER_SIZE
    if rest or table_offset < len(PACK_MAGIC):
        raise ManifestFormatError(f"pack {name}: table rows do not fit a pack of {pack_size} bytes")
    tail = _FOOTER.pack(table_offset, num, xxhash.xxh3_64_intdigest(rows), PACK_VERSION, 0, FOOTER_MAGIC)
    entries = parse_table(rows, tail, name)
    end = len(PACK_MAGIC)
    for e in entries:
        if e.offset != end:
            break
        end = e.offset + e.span
    if end != table_offset:
        raise ManifestFormatError(f"pack {name}: table rows do not cover the pack's entries back to back")
    return entries


TAIL_GUESS_BYTES = 64 * 1024  # one ranged read fetches the footer and a table of up to ~1,000 entries


def read_pack_entries(backend, name: str, size: int | None = None) -> list[PackEntry]:
    """The table of pack ``name``: one ranged read of the pack's tail, a second when the table is larger."""
    return parse_table(*_read_table(backend, name, size), name)


def read_pack_table(backend, name: str, size: int | None = None) -> PackTable:
    """:func:`read_pack_entries` as arrays (:class:`PackTable`), with the same reads and checks."""
    return parse_table_arrays(*_read_table(backend, name, size), name)


def _read_table(backend, name: str, size: int | None) -> tuple[bytes, bytes]:
    """(table bytes, footer bytes) of pack ``name``, the footer bounds-checked."""
    key = pack_key(name)
    if size is None:
        size = backend.size(key)
    start = max(0, size - TAIL_GUESS_BYTES)
    data = backend.get_range(key, start, size - start)
    tail = data[-FOOTER_SIZE:]
    table_offset, num = parse_footer(tail, size, name)
    if table_offset >= start:
        table = data[table_offset - start: table_offset - start + num * ROW_SIZE]
    else:
        table = backend.get_range(key, table_offset, num * ROW_SIZE) if num else b""
    return table, tail


def walk_entries(data, name: str, gaps: list[tuple[int, int]] | None = None) -> list[PackEntry]:
    """Recover a pack's entries from their self-describing headers, when its table is unreadable.

    Walks header to header from the start. Past a header that does not parse or an entry that does not fit,
    it looks for the next header that checks out (each carries its own checksum), so a damaged entry costs
    only itself; ``gaps`` (a list) receives (offset, length) of each stretch between two intact entries that
    could not be walked (one damaged entry or more). What follows the last intact entry (the table and
    footer, or entries cut off) is not a gap.
    """
    buf = data if isinstance(data, (bytes, bytearray)) else bytes(data)
    view = memoryview(buf)
    out, pos, end = [], len(PACK_MAGIC), len(buf)
    if bytes(buf[:len(PACK_MAGIC)]) != PACK_MAGIC:
        return out
    lost_at = None  # where the stretch being skipped began
    while pos + HEADER_SIZE <= end:
        try:
            cid, codec, es, rlen, slen, base, age = decode_header(view[pos:pos + HEADER_SIZE], f"pack {name}")
            fits = pos + HEADER_SIZE + slen <= end
        except ManifestFormatError:
            fits = False
        if not fits:
            lost_at = pos if lost_at is None else lost_at
            pos = buf.find(ENTRY_MAGIC, pos + 1)
            if pos < 0:
                break
            continue
        if lost_at is not None and gaps is not None:
            gaps.append((lost_at, pos - lost_at))
        lost_at = None
        out.append(PackEntry(cid, name, pos, slen, rlen, codec, es, base, age))
        pos += HEADER_SIZE + slen
    return out


def pack_bytes_ok(name: str, data: bytes) -> bool:
    """Whether a pack's bytes still hash to its name."""
    return xxhash.xxh3_128_hexdigest(data) == name
