"""The vectorised pack table parse (parse_table_arrays / read_pack_table, used by gc and verify) agrees with
parse_table row for row on random tables, and rejects exactly the damaged tables parse_table rejects, with
the same error."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given

from deltackpt.errors import ManifestFormatError
from deltackpt.store import MemoryBackend, codec
from deltackpt.store.pack import (
    FOOTER_SIZE,
    MAX_CHUNK_BYTES,
    ROW_SIZE,
    PackBuilder,
    PackTable,
    pack_key,
    parse_footer,
    parse_table,
    parse_table_arrays,
    read_pack_entries,
    read_pack_table,
)
from fuzz_helpers import FUZZ, mutate, mutations

pytestmark = pytest.mark.timeout(120)
_CODECS = (codec.RAW, codec.ZSTD, codec.DELTA, codec.ZDELTA)


def _random_pack(rng, n: int) -> tuple[str, bytes]:
    b = PackBuilder()
    for _ in range(n):
        cod = int(rng.choice(_CODECS))
        base = rng.bytes(16) if codec.is_delta(cod) else None
        b.add(rng.bytes(16), cod, int(rng.choice(codec.VALID_ELEM_SIZES)), int(rng.integers(0, 1 << 20)),
              rng.bytes(int(rng.integers(0, 200))), base, int(rng.integers(0, 1 << 16)) if base else 0)
    name, data, _ = b.seal()
    return name, bytes(data)


def _split(data: bytes, name: str) -> tuple[bytes, bytes]:
    """(table, footer) of a pack whose footer is intact."""
    tail = data[-FOOTER_SIZE:]
    off, num = parse_footer(tail, len(data), name)
    return data[off:off + num * ROW_SIZE], tail


def _outcome(fn, table, tail, name):
    """The entries ``fn`` parses, or the message of the ManifestFormatError it raises."""
    try:
        out = fn(table, tail, name)
    except ManifestFormatError as e:
        return str(e)
    return out.entries() if isinstance(out, PackTable) else out


def _same(table, tail, name="p" * 32):
    want = _outcome(parse_table, table, tail, name)
    assert _outcome(parse_table_arrays, table, tail, name) == want
    return want


def test_random_tables_parse_alike(rng):
    for n in [0, 1, 2, 7, 40, 300]:
        name, data = _random_pack(rng, n)
        table, tail = _split(data, name)
        entries = _same(table, tail, name)
        assert isinstance(entries, list) and len(entries) == n
        arrays = parse_table_arrays(table, tail, name)
        assert arrays.chunk_ids.tobytes() == b"".join(e.chunk_id for e in entries)
        assert arrays.has_base.tolist() == [e.base_id is not None for e in entries]
        assert arrays.base_ids[arrays.has_base].tobytes() == b"".join(e.base_id for e in entries if e.base_id)
        assert arrays.offsets.tolist() == [e.offset for e in entries]
        assert arrays.stored_lens.tolist() == [e.stored_len for e in entries]
        assert PackTable.from_entries(name, entries).entries() == entries
        be = MemoryBackend()
        be.put(pack_key(name), data)
        assert read_pack_table(be, name).entries() == read_pack_entries(be, name) == entries


_FIELD = struct.Struct("<16s16sQQQBBH4x")
_BAD_VALUES = {  # field number in a row -> values worth trying there
    1: [bytes(16), b"\x01" * 16],
    2: [0, 7, 8, 9, 2**32, 2**63, 2**64 - 1, 2**64 - 64],
    3: [0, 1, MAX_CHUNK_BYTES + (1 << 20), MAX_CHUNK_BYTES + (1 << 20) + 1, 2**63, 2**64 - 1],
    4: [0, MAX_CHUNK_BYTES, MAX_CHUNK_BYTES + 1, 2**64 - 1],
    5: [0, 1, 2, 3, 4, 77, 255],
    6: [0, 1, 2, 3, 4, 8, 16, 255],
}


def _with_hash(table: bytes, tail: bytes) -> bytes:
    """``tail`` with its table hash recomputed for ``table``, so that the row checks decide."""
    off, num, _h, ver, pad, magic = struct.unpack("<QQQHH4s", tail)
    return struct.pack("<QQQHH4s", off, num, xxhash.xxh3_64_intdigest(table), ver, pad, magic)


def test_damaged_rows_are_rejected_alike(rng):
    """Every field of a row set to edge values (bounds, overflow, order, codec, base iff delta), the table
    hash repaired: both parsers reject the same tables with the same message and accept the same others."""
    rejected = accepted = 0
    for trial in range(60):
        name, data = _random_pack(rng, int(rng.integers(1, 12)))
        table, tail = _split(data, name)
        rows = [list(_FIELD.unpack_from(table, i * ROW_SIZE)) for i in range(len(table) // ROW_SIZE)]
        for field, values in _BAD_VALUES.items():
            for value in values:
                forged = [r[:] for r in rows]
                forged[int(rng.integers(0, len(rows)))][field] = value
                new = b"".join(_FIELD.pack(*r) for r in forged)
                outcome = _same(new, _with_hash(new, tail), name)
                rejected += isinstance(outcome, str)
                accepted += isinstance(outcome, list)
        if len(rows) > 1:  # rows out of order
            new = b"".join(_FIELD.pack(*r) for r in rows[::-1])
            assert isinstance(_same(new, _with_hash(new, tail), name), str)
    assert rejected > 1000 and accepted > 100


def test_damaged_footers_are_rejected_alike(rng):
    name, data = _random_pack(rng, 5)
    table, tail = _split(data, name)
    off, num, h, ver, pad, magic = struct.unpack("<QQQHH4s", tail)
    for forged_tail in [struct.pack("<QQQHH4s", off, num + 1, h, ver, pad, magic),  # table truncated
                        struct.pack("<QQQHH4s", off, 2**60, h, ver, pad, magic),
                        struct.pack("<QQQHH4s", off, num, h ^ 1, ver, pad, magic),  # checksum
                        struct.pack("<QQQHH4s", 9, num, h, ver, pad, magic)]:  # entries past the table
        assert isinstance(_same(table, forged_tail, name), str)
    assert isinstance(_same(table[:-1], tail, name), str)
    # A table offset past the pack is parse_footer's to refuse; the table parsers both accept it alike.
    assert isinstance(_same(table, struct.pack("<QQQHH4s", 2**64 - 1, num, h, ver, pad, magic), name), list)


@FUZZ
@given(mutations)
def test_mutated_tables_parse_alike(ops):
    rng = np.random.default_rng(len(ops))
    name, data = _random_pack(rng, 6)
    table, tail = _split(data, name)
    new = mutate(table, ops)
    _same(new, _with_hash(new, tail), name)
