"""A stock DCP checkpoint directory (what ``FileSystemWriter`` writes), read without running its pickles.

DCP pickles its ``.metadata``; unpickling a file from elsewhere could run any code. :class:`_MetadataUnpickler`
resolves only the globals DCP's metadata is made of (its dataclasses, ``torch.Size``, dtypes, layouts, the
memory-format enum, ``_StorageInfo``, paths) and refuses every other one with :class:`UnsafeSourceError`.
The metadata is then checked against the strict schema the store keeps it in, and every slice it names must
lie inside a plain file of the directory, so a truncated ``.distcp`` is reported before anything is written.
"""

from __future__ import annotations

import math
import os
import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ..dcp.metadata_schema import metadata_to_record
from ..errors import SourceFormatError, UnsafeSourceError

_METADATA_CLASSES = {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING"}
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": _METADATA_CLASSES,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # torch.layout's pickle: a lookup by name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}
MAX_METADATA_BYTES = 1 << 30


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeSourceError(f"refused to unpickle {module}.{name}: DCP metadata holds no such object; "
                                "nothing in the file was run")


@dataclass
class DcpSource:
    path: Path
    metadata: Metadata
    files: dict[str, int]  # relative path -> size, of .metadata and every file a slice is in

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())

    def chunk_sizes(self, index: MetadataIndex) -> tuple[int, ...]:
        """The sizes of the saved chunk at ``index`` (a tensor's)."""
        smd = self.metadata.state_dict_metadata[index.fqn]
        for chunk in smd.chunks:
            if tuple(chunk.offsets) == tuple(index.offset):
                return tuple(chunk.sizes)
        raise SourceFormatError(f"{self.path}: no chunk of {index.fqn} at offset {list(index.offset)}")

    @contextmanager
    def open_files(self):
        files = _Files(self.path)
        try:
            yield files
        finally:
            files.close()


class _Files:
    """Open data files of a source, read by (relative path, offset, length)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.open: dict[str, object] = {}

    def read(self, info) -> bytes:
        f = self.open.get(info.relative_path)
        if f is None:
            f = self.open[info.relative_path] = open(self.root / info.relative_path, "rb")
        f.seek(info.offset)
        data = f.read(info.length)
        if len(data) != info.length:
            raise SourceFormatError(f"{self.root / info.relative_path} is truncated (changed while importing?)")
        return data

    def close(self) -> None:
        for f in self.open.values():
            f.close()


def read_dcp_dir(path) -> DcpSource:
    """Read and check a stock DCP checkpoint directory's metadata; SourceFormatError if it is not one."""
    path = Path(path)
    meta_path = path / ".metadata"
    if not path.is_dir() or not meta_path.is_file():
        why = "does not exist" if not path.exists() else "has no .metadata file"
        raise SourceFormatError(f"{path} is not a DCP checkpoint directory ({why})")
    size = meta_path.stat().st_size
    if size > MAX_METADATA_BYTES:
        raise SourceFormatError(f"{meta_path}: implausibly large DCP metadata ({size} bytes)")
    with open(meta_path, "rb") as f:
        try:
            md = _MetadataUnpickler(f).load()
        except UnsafeSourceError as e:
            raise UnsafeSourceError(f"{meta_path}: {e}") from None
        except Exception as e:  # noqa: BLE001 - any malformed pickle is a malformed source
            raise SourceFormatError(f"{meta_path} is not DCP metadata ({type(e).__name__}: {e!s:.200})") from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise SourceFormatError(f"{meta_path} is not DCP metadata written by FileSystemWriter")
    files = {".metadata": size}
    slices = {}
    for index, info in md.storage_data.items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(index, MetadataIndex) or not isinstance(rel, str) or not _plain_name(rel):
            raise SourceFormatError(f"{meta_path}: storage entry {index!r} does not name a file of the directory")
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and not isinstance(transforms, (list, tuple)):
            raise SourceFormatError(f"{meta_path}: storage entry of {index.fqn} has bad transform_descriptors")
        if transforms:
            raise SourceFormatError(f"{path}: {index.fqn} is stored with stream transforms "
                                    f"{list(transforms)}, which import does not support")
        if rel not in files:
            data = path / rel
            if not data.is_file():
                raise SourceFormatError(f"{path}: {rel} is missing")
            files[rel] = data.stat().st_size
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise SourceFormatError(f"{meta_path}: storage entry of {index.fqn} has a bad offset or length")
        if info.offset + info.length > files[rel]:
            raise SourceFormatError(f"{path / rel} is truncated: {files[rel]} bytes, the metadata needs "
                                    f"{info.offset + info.length} for {index.fqn}")
        slices[index] = info
    _check_metadata(meta_path, md, slices)
    return DcpSource(path, md, files)


def _plain_name(rel: str) -> bool:
    return rel not in ("", ".", "..") and os.path.basename(rel) == rel and "\\" not in rel


def _check_tiling(meta_path: Path, fqn: str, size: list[int], chunks) -> None:
    """The chunks of a tensor tile it: each inside its size, none overlapping another, covering it all."""
    boxes = []
    for c in chunks:
        o, n = list(c.offsets), list(c.sizes)
        if len(o) != len(size) or len(n) != len(size) or any(a < 0 or b < 0 or a + b > g
                                                               for a, b, g in zip(o, n, size)):
            raise SourceFormatError(f"{meta_path}: a chunk of {fqn} at offset {o}, size {n} is not inside its "
                                    f"size {size}")
        if math.prod(n):
            boxes.append((o, n))
    if sum(math.prod(n) for _o, n in boxes) != math.prod(size):
        raise SourceFormatError(f"{meta_path}: the chunks of {fqn} do not tile its size {size} (their sizes add "
                                f"up to {sum(math.prod(n) for _o, n in boxes)} elements)")
    if len(boxes) > 1:  # inside and adding up: an overlap would leave a hole
        overlap = _overlapping(boxes, len(size))
        if overlap is not None:
            raise SourceFormatError(f"{meta_path}: chunks of {fqn} at offsets {overlap[0]} and {overlap[1]} overlap")
    # Every dimension's chunks reach its size: for a tensor with elements the checks above imply it, for an
    # empty one ([0, 4] described by a [0, 1] chunk) nothing else would, and the shape would come out wrong.
    reach = [max((o[d] + n[d] for o, n in ((c.offsets, c.sizes) for c in chunks)), default=-1)
             for d in range(len(size))]
    if not chunks or reach != size:
        raise SourceFormatError(f"{meta_path}: the chunks of {fqn} do not tile its size {size} ("
                                + (f"they reach {reach})" if chunks else "it has no chunks)"))


def _overlapping(boxes: list[tuple[list[int], list[int]]], ndim: int):
    """Two of ``boxes`` ((offsets, sizes), none empty) that overlap, or None. A sharding is a grid, or close
    to one: the boxes are marked on the grid their own edges cut (a cell per box when they tile), so the cost
    is linear in the boxes; a cut too fine for that (edges that line up nowhere) is swept instead."""
    cuts = [np.unique([x for o, n in boxes for x in (o[d], o[d] + n[d])]) for d in range(ndim)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells <= 8 * len(boxes) + 4096:
        owner = np.full([len(c) - 1 for c in cuts], -1, dtype=np.int64)
        for i, (o, n) in enumerate(boxes):
            block = tuple(slice(np.searchsorted(c, a), np.searchsorted(c, a + k)) for c, a, k in zip(cuts, o, n))
            taken = owner[block]
            if (taken >= 0).any():
                return boxes[int(taken[taken >= 0].flat[0])][0], o
            owner[block] = i
        return None
    dim = max(range(ndim), key=lambda d: len(cuts[d]))
    active: list[tuple[list[int], list[int]]] = []
    for o, n in sorted(boxes, key=lambda b: b[0][dim]):
        active = [(ao, an) for ao, an in active if ao[dim] + an[dim] > o[dim]]
        for ao, an in active:
            if all(a < b + m and b < a + k for a, k, b, m in zip(o, n, ao, an)):
                return ao, o
        active.append((o, n))
    return None


def _check_metadata(meta_path: Path, md: Metadata, slices: dict) -> None:
    """The schema's checks on the metadata's types, plus: every chunk of every tensor has a slice."""
    try:
        metadata_to_record(Metadata(state_dict_metadata=md.state_dict_metadata, planner_data=md.planner_data,
                                    storage_data=None, storage_meta=None, version=md.version))
    except (TypeError, ValueError, AttributeError) as e:
        raise SourceFormatError(f"{meta_path}: invalid DCP metadata ({e})") from None
    for fqn, smd in md.state_dict_metadata.items():
        chunks = smd.chunks if isinstance(smd, TensorStorageMetadata) else [None]
        for chunk in chunks:
            index = MetadataIndex(fqn, None if chunk is None else chunk.offsets)
            if index not in slices:
                raise SourceFormatError(f"{meta_path}: no data for {fqn}"
                                        + ("" if chunk is None else f" at offset {list(chunk.offsets)}"))
        if isinstance(smd, TensorStorageMetadata):
            _check_tiling(meta_path, fqn, list(smd.size), chunks)
    offsets = {fqn: {tuple(c.offsets) for c in smd.chunks} for fqn, smd in md.state_dict_metadata.items()
               if isinstance(smd, TensorStorageMetadata)}
    for index in slices:
        smd = md.state_dict_metadata.get(index.fqn)
        if smd is None:
            raise SourceFormatError(f"{meta_path}: data for {index.fqn}, which the metadata does not describe")
        # Only the slices the metadata describes: a value and a tensor chunk (at one of its chunks' offsets).
        # Another (a value's bytes at a tensor's offset) would be one item read two ways, by load and export.
        if isinstance(smd, TensorStorageMetadata):
            known = index.offset is not None and tuple(index.offset) in offsets[index.fqn]
        else:
            known = index.offset is None
        if not known:
            raise SourceFormatError(f"{meta_path}: data for {index.fqn} at offset "
                                    f"{None if index.offset is None else list(index.offset)}, which the metadata "
                                    "does not describe")
