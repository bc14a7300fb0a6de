"""Export to the torch formats: a plain DCP directory and a ``torch.save`` file.

``dcp``: what a single-process ``FileSystemWriter`` writes (``__0_0.distcp`` plus a pickled ``.metadata``
of DCP's own classes), with each tensor consolidated and written in chunks of rows (each a ``torch.save``
of one slab, as FileSystemWriter writes a chunk), so DCP's resharding loads it on any world size and the
export holds one slab at a time. Non-tensor values are copied as the bytes DCP saved, never unpickled.

``torch``: ``dcp_to_torch_save``'s structure (DCP's ``_EmptyStateDictLoadPlanner`` rebuilds the nested
state dict from the checkpoint's metadata), loaded through ``DeltaStorageReader``; the written file is read
back with ``torch.load(weights_only=True, mmap=True)`` before it is published, so what comes out always
loads that way.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid

import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ..dcp import LAYER_KEY, DeltaStorageReader, quiet_single_process, typed_call
from ..dcp.metadata_schema import decode_metadata
from ..dcp.planner import PlainBytes
from ..errors import ManifestFormatError, UnsafeSourceError
from ..store import Progress, phase
from .layout import Layout, read_rows, slabs
from .numeric import FLOATS
from .weightsonly import refusal_reason

DATA_FILE = "__0_0.distcp"  # FileSystemWriter's name for rank 0's first file


def canonical_nan(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (just cast, so its own) with every NaN the quiet NaN safetensors exports write too
    (float32 0x7FC00000, bfloat16 0x7FC0): a cast keeps no payload, and torch's and numpy's differ."""
    if tensor.is_floating_point():
        tensor[tensor.isnan()] = float("nan")
    return tensor


def _dcp_metadata(reader) -> Metadata:
    data = reader.manifest.layer_data.get(LAYER_KEY)
    if data is None:
        raise ManifestFormatError(f"checkpoint {reader.name!r} was not written through DCP; export it as "
                                  "safetensors")
    return decode_metadata(data)


def write_dcp(tmp, out, reader, layout: Layout, names: list[str], target: str | None, report,
              progress: Progress | None, slab_bytes: int) -> None:
    md = _dcp_metadata(reader)
    wanted = set(names)
    sdm, storage = {}, {}
    total = sum(layout.tensors[n].nbytes for n in names if n in layout.tensors)
    with open(os.path.join(tmp, DATA_FILE), "xb") as f, phase(progress, "export", total, "B") as prog:
        for fqn, smd in md.state_dict_metadata.items():
            if fqn not in wanted:
                continue
            if isinstance(smd, BytesStorageMetadata):
                offset = f.tell()
                data = reader.read(layout.byte_items[fqn].key)
                f.write(data)
                storage[MetadataIndex(fqn)] = _StorageInfo(DATA_FILE, offset, len(data))
                sdm[fqn] = smd
                report.num_values += 1
                continue
            sdm[fqn] = _write_tensor(f, reader, layout.tensors[fqn], smd, target, storage, prog, slab_bytes)
            report.num_tensors += 1
            report.converted += sdm[fqn].properties.dtype != smd.properties.dtype
        f.flush()
        os.fsync(f.fileno())
        report.bytes_written = f.tell()
    planner_data = None if md.planner_data is None else {k: v for k, v in md.planner_data.items() if k in sdm}
    metadata = Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=str(out), save_id=uuid.uuid4().hex),
                        version="1.0.0")
    with open(os.path.join(tmp, ".metadata"), "xb") as f:
        pickle.dump(metadata, f)  # DCP's own format: FileSystemReader unpickles it
        f.flush()
        os.fsync(f.fileno())
        report.bytes_written += f.tell()


def _write_tensor(f, reader, t, smd: TensorStorageMetadata, target, storage, prog, slab_bytes
                  ) -> TensorStorageMetadata:
    """Write tensor ``t`` as chunks of rows; its metadata with those chunks (and the cast dtype)."""
    src = getattr(torch, t.dtype)
    dst = getattr(torch, target) if target and t.dtype in FLOATS else src
    if smd.properties.dtype != src or tuple(smd.size) != t.shape:
        raise ManifestFormatError(f"{t.name!r}: DCP metadata says {smd.properties.dtype} {list(smd.size)}, "
                                  f"its shards {t.dtype} {list(t.shape)}")
    chunks = []
    for r0, r1 in slabs(t, slab_bytes) or [(0, t.shape[0] if t.shape else 1)]:
        rows = (r1 - r0, *t.shape[1:]) if t.shape else ()
        if t.numel:
            tensor = torch.from_numpy(read_rows(reader, t, r0, r1)).view(src).reshape(rows)
        else:
            tensor = torch.empty(rows, dtype=src)  # no bytes to view
        if dst != src:
            tensor = canonical_nan(tensor.to(dst))
        offsets = torch.Size((r0,) + (0,) * (len(t.shape) - 1) if t.shape else ())
        offset = f.tell()
        torch.save(tensor, f)
        storage[MetadataIndex(t.name, offsets)] = _StorageInfo(DATA_FILE, offset, f.tell() - offset)
        chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(rows)))
        prog.advance((r1 - r0) * t.row_bytes if t.shape else t.itemsize)
    props = dataclasses.replace(smd.properties, dtype=dst)
    return TensorStorageMetadata(properties=props, size=smd.size, chunks=chunks)


class _SelectedKeys(PlainBytes, _EmptyStateDictLoadPlanner):
    """DCP's planner for loading into an empty state dict (what dcp_to_torch_save uses), for exactly the
    flattened keys chosen (its own ``keys`` filter needs planner data for every key); values unpickled as
    plain data only, as the exported file is checked for."""

    refusal_hint = "export it as dcp instead"

    def _should_include_key(self, key: str, metadata: Metadata) -> bool:
        return key in self.keys


def write_torch(tmp, store, layout: Layout, names: list[str], target: str | None, report,
                progress: Progress | None) -> None:
    sd: dict = {}
    total = sum(layout.tensors[n].nbytes for n in names if n in layout.tensors)
    with phase(progress, "load", total, "B") as prog:
        # DCP's loader itself, as dcp_to_torch_save calls it: dcp.load fills only keys the given dict has.
        reader = DeltaStorageReader(store, report.checkpoint)
        with quiet_single_process():
            typed_call(lambda: _load_state_dict(sd, storage_reader=reader, planner=_SelectedKeys(keys=set(names)),
                                                no_dist=True))
        prog.advance(total)
    if target:
        dst = getattr(torch, target)
        report.converted = _cast_tree(sd, dst)
    report.num_tensors = sum(n in layout.tensors for n in names)
    report.num_values = len(names) - report.num_tensors
    refused = _refused_values(sd)
    if refused:  # before anything is written: the file could not be loaded the way it promises
        shown = ", ".join(f"{key} ({kind})" for key, kind in refused[:5]) + (", ..." if len(refused) > 5 else "")
        raise UnsafeSourceError(f"checkpoint {report.checkpoint!r} holds values torch.load(weights_only=True) "
                                f"refuses: {shown}; export it as dcp instead (it keeps them as saved), or leave "
                                "them out with --only")
    with phase(progress, "write", total, "B") as prog, open(tmp, "xb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
        report.bytes_written = f.tell()
        prog.advance(total)
    del sd
    try:
        torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:  # (what _refused_values missed: the file is checked as a whole too)
        raise UnsafeSourceError(f"checkpoint {report.checkpoint!r} holds values torch.load(weights_only=True) "
                                f"refuses ({refusal_reason(e)}); export it as dcp instead") from None


_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.Tensor)


def _refused_values(obj, key: str = "") -> list[tuple[str, str]]:
    """(dotted key, type) of each value in a loaded state dict that ``torch.load(weights_only=True)`` would
    refuse once ``torch.save`` pickled it (an ``io.BytesIO``: DCP saves its bytes, torch.save the object);
    each value not plain data is tried on its own, so the refusal names it."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        if isinstance(obj, _PLAIN):
            return []
        buf = io.BytesIO()
        try:
            torch.save(obj, buf)
            buf.seek(0)
            torch.load(buf, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - whatever the reason, the exported file would not load it
            kind = type(obj).__qualname__
            module = type(obj).__module__
            return [(key or "the value", kind if module == "builtins" else f"{module}.{kind}")]
        return []
    return [found for k, v in items for found in _refused_values(v, f"{key}.{k}" if key else str(k))]


def _cast_tree(obj, dst: torch.dtype) -> int:
    """Cast the float tensors of a nested state dict to ``dst`` in place, as the other formats do (``FLOATS``:
    float16, bfloat16, float32, float64; quantised float8 stays as it is); how many were cast."""
    n = 0
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in list(items):
        if isinstance(value, torch.Tensor):
            if str(value.dtype).removeprefix("torch.") in FLOATS and value.dtype != dst:
                obj[key] = canonical_nan(value.to(dst))
                n += 1
        elif type(value) is tuple:  # (DCP keeps a tuple whole, as one value): made again with its casts
            inner = list(value)
            cast = _cast_tree(inner, dst)
            if cast:
                obj[key] = tuple(inner)
                n += cast
        else:
            n += _cast_tree(value, dst)
    return n
