"""A safetensors file written as a stream (torch-free).

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length N, N bytes of
JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` (padded with
spaces to a multiple of 8), then the tensors' raw little-endian bytes back to back, in header order. Every
shape and dtype is known from the manifest before any data is read, so the header goes first and each
tensor follows a slab of rows at a time: memory stays near one slab, not the model.
"""

from __future__ import annotations

import json
import os
import struct
import sys

from ..store import Progress, phase
from .layout import Layout, read_rows, slabs
from .numeric import FLOATS, cast

DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
          "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint64": "U64",
          "uint32": "U32", "uint16": "U16", "complex64": "C64", "float8_e4m3fn": "F8_E4M3",
          "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
          "float8_e8m0fnu": "F8_E8M0"}
ITEMSIZE = {"float32": 4, "bfloat16": 2}
SAFETENSORS_METADATA = "safetensors_metadata"  # checkpoint metadata key: an imported file's ``__metadata__``


def header_metadata(checkpoint: str, metadata: dict) -> dict[str, str]:
    """The exported file's ``__metadata__``: what the imported file had (kept when it is str to str, as the
    format requires), ``format: pt`` unless it said otherwise, and the checkpoint's name."""
    kept = metadata.get(SAFETENSORS_METADATA)
    if not (isinstance(kept, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in kept.items())):
        kept = {}
    return {"format": "pt", **kept, "deltackpt_checkpoint": checkpoint}


def write_safetensors(path, reader, layout: Layout, names: list[str], target: str | None, report,
                      progress: Progress | None, slab_bytes: int) -> None:
    if sys.byteorder != "little":  # the stored bytes are the saving machine's; safetensors is little-endian
        raise NotImplementedError("safetensors export runs on little-endian machines only")
    plan, header, offset = [], {}, 0
    for name in names:
        t = layout.tensors.get(name)
        if t is None:
            report.skipped.append(f"{name}: not a tensor (safetensors holds tensors only)")
            continue
        if name == "__metadata__":  # the header's own key: a tensor of that name would make the file unreadable
            report.skipped.append(f"{name}: the name safetensors reserves for the header's metadata")
            continue
        if t.dtype not in DTYPES:
            report.skipped.append(f"{name}: dtype {t.dtype} has no safetensors equivalent")
            continue
        dst = target if target and t.dtype in FLOATS else t.dtype
        nbytes = t.numel * (ITEMSIZE[dst] if dst != t.dtype else t.itemsize)
        header[name] = {"dtype": DTYPES[dst], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        plan.append((t, dst))
        offset += nbytes
        report.converted += dst != t.dtype
    header["__metadata__"] = header_metadata(reader.name, reader.manifest.metadata)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "xb") as f, phase(progress, "export", offset, "B") as prog:
        f.write(struct.pack("<Q", len(head)) + head)
        for t, dst in plan:
            for r0, r1 in slabs(t, slab_bytes):
                raw = read_rows(reader, t, r0, r1)
                if dst != t.dtype:
                    raw = cast(raw, t.dtype, dst)
                f.write(raw)
                prog.advance(len(raw))
            report.num_tensors += 1
        f.flush()
        os.fsync(f.fileno())
        report.bytes_written = f.tell()
