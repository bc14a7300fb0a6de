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
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
import numpy as np
import xxhash
import zstandard

from .. import kernels
from ..errors import CorruptManifestError, InvalidNameError, UnsupportedFormatError
from . import idset
from .codec import VALID_ELEM_SIZES
from .pack import MAX_CHUNK_BYTES
from .pausegc import paused_gc

MANIFEST_MAGIC = b"DCMF"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 31
# A reference's length and skip at most, a chunk's bytes: a forged length fails as the manifest decodes (a load
# allocated 1 TiB for one). native/refs.c (DC_MAX_REF_BYTES) refuses the same, so every reader agrees.
MAX_REF_BYTES = MAX_CHUNK_BYTES
LATEST = "latest"
_NAME_RE = re.compile(r"(?!.*\.tmp-)[A-Za-z0-9_][A-Za-z0-9._+=@-]{0,127}")  # ".tmp-" marks temp files


class ChunkRef(msgspec.Struct, array_like=True, frozen=True):
    # Checked as a manifest decodes (in msgspec's C code: a loop over a 160k-chunk manifest's refs took 40 ms).
    id: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    length: Annotated[int, msgspec.Meta(ge=0, le=MAX_REF_BYTES)]
    skip: Annotated[int, msgspec.Meta(ge=0, le=MAX_REF_BYTES)] = 0


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
            "starting with a letter, digit or _ (so no '/' and no leading '.'; no '.tmp-')"
        )
    return name


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` (of an object under ``manifests/``) can be a checkpoint's: other files there (an
    editor's backup, ``.DS_Store``) are no checkpoints, and every listing leaves them out."""
    return name != LATEST and _NAME_RE.fullmatch(name) is not None


def manifest_key(name: str) -> str:
    return f"manifests/{validate_name(name)}"


# Level 3 with a 64 KiB window: a reader that streams the body (refstream.py) holds the window, not the body
# (a level-3 frame's window is the whole body up to 2 MiB); the ids that fill most of a body never repeat.
_COMPRESSION = zstandard.ZstdCompressionParameters.from_level(3, window_log=16)


def encode_manifest(m: Manifest) -> bytes:
    body = msgspec.msgpack.encode(m)
    out = MANIFEST_MAGIC + bytes([MANIFEST_VERSION]) + zstandard.ZstdCompressor(
        compression_params=_COMPRESSION).compress(body)
    return out + struct.pack("<Q", xxhash.xxh3_64_intdigest(out))


def decode_manifest(data: bytes, where: str = "manifest", *, checkpoint: str | None = None) -> Manifest:
    """Parse and validate a stored manifest; any damage raises CorruptManifestError naming ``checkpoint``."""
    return manifest_from_body(manifest_body(data, where, checkpoint=checkpoint), where, checkpoint=checkpoint)


def manifest_from_body(body: bytes, where: str = "manifest", *, checkpoint: str | None = None) -> Manifest:
    """:func:`decode_manifest` of the body :func:`manifest_body` took out of a stored manifest."""
    corrupt = _corrupt(where, checkpoint)
    m = _decode(body, Manifest, corrupt)
    # Each ref's fields were checked by the schema.
    problem = _manifest_problem(m, (sum(map(_LENGTH, it.chunks)) for it in m.items))
    if problem:
        raise corrupt(problem)
    return m


class ManifestRefs(NamedTuple):
    """The chunk refs of a manifest in arrays: what verify and gc need of a checkpoint, read without an object
    per ref or per item's ref list (a 1M-chunk manifest decoded whole costs ~150 B of Python objects a ref)."""

    name: str
    ids: np.ndarray  # V16: every ref's chunk id, item after item, in manifest order
    item_end: np.ndarray  # int64 per item: its refs are ids[item_end[i - 1]:item_end[i]]
    ends: np.ndarray | None = None  # uint32 per ref, when asked for: the chunk bytes it needs (skip + length)


def decode_manifest_refs(data: bytes, where: str = "manifest", *, checkpoint: str | None = None) -> ManifestRefs:
    """:func:`decode_manifest`'s checks, all of them, but only the chunk refs kept, in arrays."""
    return refs_from_body(manifest_body(data, where, checkpoint=checkpoint), where, checkpoint=checkpoint)


def refs_from_body(body: bytes, where: str = "manifest", *, checkpoint: str | None = None,
                   with_ends: bool = False) -> ManifestRefs:
    """:func:`decode_manifest_refs` of the body :func:`manifest_body` took out of a stored manifest; ``with_ends``:
    each ref's end (skip + length) kept too."""
    corrupt = _corrupt(where, checkpoint)
    m = _decode(body, RefsManifest, corrupt)
    # Room for the ids at the fewest bytes a ref takes (20), written in place by the C reader: no join.
    ids = np.empty(len(body) // 20, dtype=idset.ID)
    extents = np.empty(ids.size, dtype=np.uint32) if with_ends else None
    native, ends, totals, at = kernels.chunk_refs, [], [], 0
    for it in m.items:
        got = native(it.chunks, ids, 16 * at, extents) if native is not None else None
        n, total = got if got is not None else _read_refs(it, ids, at, corrupt, extents)
        at += n
        ends.append(at)
        totals.append(total)
    problem = _manifest_problem(m, totals)
    if problem:
        raise corrupt(problem)
    name = m.name
    del m  # the items' raw refs (views of the body)
    ids.resize(at, refcheck=False)  # in place: no view of it was kept; an owning array (idset.Collector grows it)
    if extents is not None:
        extents.resize(at, refcheck=False)
    return ManifestRefs(name, ids, np.array(ends, dtype=np.int64), extents)


def _read_refs(item, out: np.ndarray, at: int, corrupt, extents: np.ndarray | None = None) -> tuple[int, int]:
    """(number of refs, sum of their lengths) of ``item`` (a RefsItem), their ids written to ``out[at:]`` (and
    their ends, skip + length, to ``extents[at:]`` when given), decoded and validated by msgspec against
    ChunkRef: refs the C reader left (not in the canonical form)."""
    try:
        refs = _REFS_DECODER.decode(item.chunks)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
        raise corrupt(f"item {item.key!r}: chunks: {e}") from None
    out[at:at + len(refs)] = idset.from_ids([ref.id for ref in refs])  # fits: a ref takes 20 bytes or more
    if extents is not None:
        extents[at:at + len(refs)] = [ref.skip + ref.length for ref in refs]
    return len(refs), sum(map(_LENGTH, refs))


def _corrupt(where: str, checkpoint: str | None):
    return lambda msg: CorruptManifestError(f"{where}: {msg}", checkpoint=checkpoint)


def manifest_body(data: bytes, where: str = "manifest", *, checkpoint: str | None = None) -> bytes:
    """The msgpack body of a stored manifest, its envelope (magic, version, checksum, zstd frame) checked: a
    caller that drops ``data`` then holds the manifest once, not twice, while it is decoded."""
    corrupt = _corrupt(where, checkpoint)
    if len(data) < 13 or data[:4] != MANIFEST_MAGIC:
        raise corrupt("not a deltackpt manifest (bad magic)")
    # A newer manifest layout comes with a newer store format (the config's gate refuses the store first), so
    # a version byte above ours whose checksum fails is damage (one flipped bit), not a newer manifest.
    (digest,) = struct.unpack("<Q", data[-8:])
    if xxhash.xxh3_64_intdigest(data[:-8]) != digest:
        raise corrupt("checksum mismatch (damaged or truncated)")
    if data[4] > MANIFEST_VERSION:
        raise UnsupportedFormatError(f"{where}: manifest version {data[4]} is newer than supported")
    if data[4] < 1:
        raise corrupt(f"invalid manifest version {data[4]}")
    frame = data[5:-8]
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise corrupt(f"damaged manifest ({e})") from None
    if not 0 <= declared <= MAX_MANIFEST_BYTES:
        raise corrupt(f"implausible manifest size {declared}")
    try:
        if declared <= 1024 * len(frame) + (1 << 20):
            return zstandard.ZstdDecompressor().decompress(frame, max_output_size=MAX_MANIFEST_BYTES)
        # zstd allocates the declared size up front, and a forged header must not make us allocate gigabytes:
        # a body that compressed this well (metadata of a million equal values) is decoded a piece at a time,
        # memory growing only with what the frame really holds.
        return _decoded_in_pieces(frame, declared, corrupt)
    except zstandard.ZstdError as e:
        raise corrupt(f"damaged manifest ({e})") from None


def _decoded_in_pieces(frame: bytes, declared: int, corrupt) -> bytes:
    """The frame's bytes once a pass that keeps none of them found it holds exactly what its header says."""
    held = 0
    with zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=False) as reader:
        while held <= declared:
            piece = reader.read(16 << 20)
            if not piece:
                break
            held += len(piece)
    if held != declared:
        raise corrupt(f"manifest frame holds {held} bytes, its header says {declared}")
    return zstandard.ZstdDecompressor().decompress(frame, max_output_size=declared)


def _decode(body: bytes, schema, corrupt):
    try:
        with paused_gc():  # an object or more per item, none in a cycle: collections would rescan them all
            return msgspec.msgpack.decode(body, type=schema)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
        raise corrupt(str(e)) from None


def _variant(cls, field: str, typ):
    """``cls`` with ``field`` decoded as ``typ`` and every other field, and the config, as they are: one schema
    for both readings."""
    fields = []
    for f in msgspec.structs.fields(cls):
        t = typ if f.name == field else f.type
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, t, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, t, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, t))
    cfg = cls.__struct_config__
    return msgspec.defstruct(f"_Refs{cls.__name__}", fields, kw_only=True, array_like=cfg.array_like,
                             forbid_unknown_fields=cfg.forbid_unknown_fields, omit_defaults=cfg.omit_defaults)


RefsItem = _variant(Item, "chunks", msgspec.Raw)  # an item's refs left as msgpack, read by _read_refs
RefsManifest = _variant(Manifest, "items", list[RefsItem])
_REFS_DECODER = msgspec.msgpack.Decoder(list[ChunkRef])


def _manifest_problem(m: Manifest, totals) -> str | None:
    """What is invalid in a decoded manifest (``totals``: the sum of each item's ref lengths), or None."""
    try:
        validate_name(m.name)
    except InvalidNameError as e:
        return str(e)
    if m.format_version != MANIFEST_VERSION:  # the envelope's version byte gates a newer layout: this is damage
        return f"body format_version {m.format_version}, envelope {MANIFEST_VERSION}"
    keys = set()
    for it, total in zip(m.items, totals):
        problem = item_problem(it, total)
        if problem:
            return problem
        if it.key in keys:  # the writer refuses it; a load would take one of the two silently
            return f"item {it.key!r} appears twice"
        keys.add(it.key)
    return None


def item_problem(it: Item, total: int) -> str | None:
    """What is invalid in a decoded item whose refs' lengths sum to ``total``, or None."""
    at = f"item {it.key!r}"
    if it.elem_size not in VALID_ELEM_SIZES:
        return f"{at}: invalid element size {it.elem_size}"
    if it.nbytes < 0 or it.global_offset < 0 or min(it.shape, default=0) < 0:
        return f"{at}: negative size or offset"
    if total != it.nbytes:
        return f"{at}: chunk lengths sum to {total}, expected {it.nbytes}"
    return None
