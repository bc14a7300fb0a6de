"""Coverage-guided fuzzing of deltackpt's parsers of stored bytes with atheris (optional; not run in CI).

    pip install atheris
    python benchmarks/fuzz_atheris.py -max_total_time=300 [corpus_dir]

The first input byte picks the parser; the rest is its input. Targets: decode_manifest (raw, and resealed
with a valid checksum so the fuzzer gets past it), pack.decode_header (rehashed), pack.parse_footer +
parse_table (table hash repaired), index.decode_record, config.decode_config, codec.decode and, if torch is
installed, dcp.metadata_schema.metadata_from_bytes. Only deltackpt's own errors (and ValueError from the
codecs) are allowed; anything else is a finding.

Known bugs (see the xfail tests in tests/store/test_fuzz_parsers.py) are found within seconds: MemoryError
from a zstd frame that declares a huge content size, RecursionError from deeply nested msgpack. Set
DELTACKPT_FUZZ_SKIP_KNOWN=1 to ignore those two and look for others.
"""

from __future__ import annotations

import os
import struct
import sys

import atheris

import xxhash

try:  # import torch uninstrumented (instrumenting it takes minutes); deltackpt is what we fuzz
    import torch  # noqa: F401
except ImportError:
    pass

with atheris.instrument_imports(include=["deltackpt"]):
    from deltackpt.errors import DeltackptError
    from deltackpt.store import codec
    from deltackpt.store.config import decode_config
    from deltackpt.store.records import decode_record
    from deltackpt.store.manifest import MANIFEST_MAGIC, decode_manifest
    from deltackpt.store.pack import FOOTER_SIZE, ROW_SIZE, decode_header, parse_footer, parse_table

try:
    with atheris.instrument_imports(include=["deltackpt"]):
        from deltackpt.dcp.metadata_schema import metadata_from_bytes
except ImportError:  # no torch
    metadata_from_bytes = None

SKIP_KNOWN = (MemoryError, RecursionError) if os.environ.get("DELTACKPT_FUZZ_SKIP_KNOWN") else ()


def _seal(body: bytes) -> bytes:
    out = MANIFEST_MAGIC + b"\x01" + body
    return out + struct.pack("<Q", xxhash.xxh3_64_intdigest(out))


def _pack(data: bytes) -> None:
    if len(data) < FOOTER_SIZE:
        return
    tail = data[-FOOTER_SIZE:]
    off, num = parse_footer(tail, len(data), "fuzz")
    table = data[off:off + num * ROW_SIZE]
    tail = tail[:16] + struct.pack("<Q", xxhash.xxh3_64_intdigest(table)) + tail[24:]
    parse_table(table, tail, "fuzz")


def _header(data: bytes) -> None:
    head = data[:56].ljust(56, b"\0")
    decode_header(head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)), "fuzz")


def _codec(data: bytes) -> None:
    if len(data) < 4:
        return
    cod, es, raw_len = data[0] % 4, (1, 2, 4, 8)[data[1] % 4], int.from_bytes(data[2:4], "little") * 4
    codec.decode(cod, data[4:], raw_len, es, bytes(raw_len))


TARGETS = [
    lambda d: decode_manifest(d),
    lambda d: decode_manifest(_seal(d)),
    _header,
    _pack,
    lambda d: decode_record(b"\0" * 16, d),
    lambda d: decode_config(d),
    _codec,
]
if metadata_from_bytes is not None:
    TARGETS.append(lambda d: metadata_from_bytes(d))


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    target = data[0] % len(TARGETS)
    allowed = (DeltackptError, ValueError) if TARGETS[target] is _codec else (DeltackptError,)
    try:
        TARGETS[target](data[1:])
    except allowed:
        pass
    except SKIP_KNOWN:
        pass


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
