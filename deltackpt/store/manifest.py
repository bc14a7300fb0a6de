"""Manifests: one immutable object per checkpoint, the only commit point.

A checkpoint exists if and only if ``manifests/<name>`` exists. The object is ``b"DCMF"``, a format
version byte, a zstd frame of msgpack decoded against the strict schema below (no object deserialization), and the
xxh3-64 of everything before it (8 bytes, little-endian), so any damage is detected before parsing.

An *item* is one named array or byte string (for DCP: one saved tensor shard or one pickled value). Its raw
bytes are the concatenation of its chunk refs; a ref is ``(chunk id, length, skip)``: ``length`` bytes taken
from the chunk's raw bytes starting at ``skip``. ``group`` and ``global_offset`` place an array item in the
flattened byte space of a larger array (a shard in its global tensor) so chunk boundaries, dedup and delta
bases line up across shardings.
"""

from __future__ import annotations

import re
import struct
from operator import attrgetter
from typing import Annotated, Any, Literal

import msgspec
import xxhash
import zstandard

from ..errors import CorruptManifestError, InvalidNameError, UnsupportedFormatError
from .codec import VALID_ELEM_SIZES

MANIFEST_MAGIC = b"DCMF"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 31
LATEST = "latest"
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=@-]{0,127}")


class ChunkRef(msgspec.Struct, array_like=True, frozen=True):
    # Checked as a manifest decodes (in msgspec's C code: a loop over a 160k-chunk manifest's refs took 40 ms).
    id: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    length: Annotated[int, msgspec.Meta(ge=0)]
    skip: Annotated[int, msgspec.Meta(ge=0)] = 0


_LENGTH = attrgetter("length")


class Item(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    key: str
    kind: Literal["array", "bytes"]
    nbytes: int
    chunks: list[ChunkRef]
    dtype: str = "uint8"
    elem_size: int = 1
    shape: list[int] = []
    group: str = ""
    global_offset: int = 0

    @property
    def group_name(self) -> str:
        return self.group or self.key


class Stats(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    logical_bytes: int = 0
    stored_bytes: int = 0  # bytes this checkpoint added to packs (coded, incl. entry headers)
    num_chunks: int = 0
    new_chunks: int = 0


class Manifest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    store_id: str
    created_ns: int
    items: list[Item]
    stats: Stats
    parent: str | None = None
    metadata: dict[str, Any] = {}
    layer_data: dict[str, Any] = {}
    format_version: int = MANIFEST_VERSION

    def item_map(self) -> dict[str, Item]:
        return {it.key: it for it in self.items}


def validate_name(name: str) -> str:
    """Checkpoint names: 1-128 of ``[A-Za-z0-9._+=@-]``, not starting with '.', '-', not 'latest'."""
    if not isinstance(name, str):
        raise InvalidNameError(f"checkpoint name must be a string, got {type(name).__name__}")
    if name == LATEST:
        raise InvalidNameError(f"{LATEST!r} is reserved: it always means the newest checkpoint")
    if not _NAME_RE.fullmatch(name):
        raise InvalidNameError(
            f"invalid checkpoint name {name!r}: use 1-128 letters, digits and . _ + = @ -, "
            "starting with a letter, digit or _ (no '/' or '..')"
        )
    return name


def manifest_key(name: str) -> str:
    return f"manifests/{validate_name(name)}"


def encode_manifest(m: Manifest) -> bytes:
    body = msgspec.msgpack.encode(m)
    out = MANIFEST_MAGIC + bytes([MANIFEST_VERSION]) + zstandard.ZstdCompressor(level=3).compress(body)
    return out + struct.pack("<Q", xxhash.xxh3_64_intdigest(out))


def decode_manifest(data: bytes, where: str = "manifest", *, checkpoint: str | None = None) -> Manifest:
    """Parse and validate a stored manifest; any damage raises CorruptManifestError naming ``checkpoint``."""

    def corrupt(msg: str) -> CorruptManifestError:
        return CorruptManifestError(f"{where}: {msg}", checkpoint=checkpoint)

    if len(data) < 13 or data[:4] != MANIFEST_MAGIC:
        raise corrupt("not a deltackpt manifest (bad magic)")
    # The version comes first: a newer format may lay out the rest (checksum included) differently.
    if data[4] > MANIFEST_VERSION:
        raise UnsupportedFormatError(f"{where}: manifest version {data[4]} is newer than supported")
    (digest,) = struct.unpack("<Q", data[-8:])
    if xxhash.xxh3_64_intdigest(data[:-8]) != digest:
        raise corrupt("checksum mismatch (damaged or truncated)")
    if data[4] < 1:
        raise corrupt(f"invalid manifest version {data[4]}")
    frame = data[5:-8]
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise corrupt(f"damaged manifest ({e})") from None
    if not (0 <= declared <= MAX_MANIFEST_BYTES) or declared > 1024 * len(frame) + (1 << 20):
        # zstd allocates the declared size up front; a forged header must not make us allocate gigabytes
        raise corrupt(f"implausible manifest size {declared}")
    try:
        body = zstandard.ZstdDecompressor().decompress(frame, max_output_size=MAX_MANIFEST_BYTES)
    except zstandard.ZstdError as e:
        raise corrupt(f"damaged manifest ({e})") from None
    try:
        m = msgspec.msgpack.decode(body, type=Manifest)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
        raise corrupt(str(e)) from None
    problem = _manifest_problem(m)
    if problem:
        raise corrupt(problem)
    return m


def _manifest_problem(m: Manifest) -> str | None:
    """What is invalid in a decoded manifest, or None."""
    try:
        validate_name(m.name)
    except InvalidNameError as e:
        return str(e)
    for it in m.items:
        at = f"item {it.key!r}"
        if it.elem_size not in VALID_ELEM_SIZES:
            return f"{at}: invalid element size {it.elem_size}"
        if it.nbytes < 0 or it.global_offset < 0 or any(d < 0 for d in it.shape):
            return f"{at}: negative size or offset"
        total = sum(map(_LENGTH, it.chunks))  # each ref's fields were checked by the schema
        if total != it.nbytes:
            return f"{at}: chunk lengths sum to {total}, expected {it.nbytes}"
    return None
