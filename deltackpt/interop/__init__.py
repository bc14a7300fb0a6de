"""Interop: checkpoints leaving the store (export), entering it (import), and compared (diff).

Terms
-----
layout
    A checkpoint's tensors as its manifest lays them out (:mod:`.layout`): per tensor its dtype, global shape
    and *boxes*, the saved shards (DCP chunks) with their offsets in the global tensor and the item holding
    their bytes; plus its byte items (pickled non-tensor values).
consolidate
    Read rows of a global tensor from the chunks of whichever boxes overlap them (:func:`.layout.read_rows`),
    with no process group: the manifest knows every shard's place.
export
    :func:`export`: a checkpoint as a plain DCP directory (``dcp``), one ``torch.save`` file (``torch``) or a
    safetensors file (``safetensors``); built under a temporary name and renamed into place.
import
    :func:`import_checkpoint` / :func:`import_all`: a stock DCP directory (its sharding kept, nothing in it
    unpickled beyond DCP's metadata classes) or a ``torch.save`` file (``weights_only=True``) into the store,
    deduplicated against what it holds.
diff
    :func:`diff`: per item what changed between two checkpoints, chunk by chunk; equal chunks are not read.

``layout``, ``numeric``, ``safetensors``, ``diff``, ``weightsonly`` (what a ``torch.load(weights_only=True)`` error
means: a refused global, or a damaged file) and the ``safetensors`` path of ``export`` are torch-free;
``torchexport``, ``dcpsource`` and ``importer`` import torch. Names load on first use; the functions
``export`` and ``diff`` are ``deltackpt.export`` / ``deltackpt.diff`` (here those names are the modules).
"""

from __future__ import annotations

from importlib import import_module

_LAZY = {
    "ExportReport": ".export", "FORMATS": ".export",
    "import_checkpoint": ".importer", "import_all": ".importer", "ImportReport": ".importer",
    "DiffReport": ".diff", "ItemDiff": ".diff",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deltackpt.interop' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value
