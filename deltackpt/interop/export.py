"""``export``: a checkpoint of the store as a plain DCP directory, one ``torch.save`` file or a safetensors file.

The target is built under a temporary name next to it and renamed into place at the end, so a failed or
interrupted export leaves nothing at the target; an existing target is refused (TargetExistsError), never
overwritten. Tensors are consolidated from the chunks of their shards (any sharding the checkpoint was saved
with): ``safetensors`` and ``dcp`` stream them a slab of rows at a time, so memory stays near
``slab_bytes`` (at most the largest tensor) whatever the model's size; ``torch`` holds the exported state
dict once, as ``torch.save`` needs it whole. Only ``dcp`` and ``torch`` import torch.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ManifestFormatError, TargetExistsError
from ..store import LocalFiles, Progress, Store
from .layout import DCP_LAYER, SLAB_BYTES, read_layout, select
from .numeric import cast_target

FORMATS = ("dcp", "torch", "safetensors")


@dataclass
class ExportReport:
    checkpoint: str
    format: str
    out: str
    num_tensors: int = 0
    num_values: int = 0  # non-tensor values (dcp, torch)
    bytes_written: int = 0
    converted: int = 0  # tensors cast to ``dtype``
    skipped: list[str] = field(default_factory=list)  # "name: why" for what the format cannot hold
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def export(store, checkpoint: str, out, *, format: str = "dcp", only=None, dtype: str | None = None,
           progress: Progress | None = None, slab_bytes: int = SLAB_BYTES,
           storage_options: dict | None = None) -> ExportReport:
    """Write checkpoint ``checkpoint`` (a name or ``latest``) of ``store`` (a path, URL or Store) to ``out``.

    ``format``: ``dcp`` (a directory stock ``FileSystemReader`` loads, on any world size), ``torch`` (one
    ``torch.save`` file, the structure ``dcp_to_torch_save`` gives, loadable with ``weights_only=True``) or
    ``safetensors`` (tensors only, named by their flattened keys). ``only``: key prefixes to keep (e.g.
    ``"model."``). ``dtype``: ``bf16`` or ``fp32`` casts every float16, bfloat16, float32 and float64
    tensor (float8 stays as it is; ``dcp`` copies a value DCP pickled, a tuple of tensors say, as it is).
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    target = cast_target(dtype)
    if slab_bytes < 1:
        raise ValueError(f"slab_bytes must be positive, got {slab_bytes}")
    out = Path(out)
    store = store if isinstance(store, Store) else Store.open(store, storage_options=storage_options)
    _check_outside(out, store)
    _check_target(out)
    manifest = store.read_manifest(store.resolve(checkpoint))
    if format != "safetensors" and DCP_LAYER not in manifest.layer_data:
        raise ManifestFormatError(f"checkpoint {manifest.name!r} was not saved through DCP (Store.save, say): "
                                  f"--format {format} needs DCP's metadata; export it as safetensors")
    layout = read_layout(manifest)
    names = select([*layout.tensors, *layout.byte_items], only)
    if only and not names:
        raise ValueError(f"no key of checkpoint {manifest.name!r} starts with {', '.join(_prefixes(only))}")
    report = ExportReport(checkpoint=manifest.name, format=format, out=str(out))
    started = time.monotonic()
    with store.open_checkpoint(manifest.name) as reader, _publishing(out, directory=format == "dcp") as tmp:
        if format == "safetensors":
            from .safetensors import write_safetensors

            write_safetensors(tmp, reader, layout, names, target, report, progress, slab_bytes)
        elif format == "dcp":
            from .torchexport import write_dcp

            write_dcp(tmp, out, reader, layout, names, target, report, progress, slab_bytes)
        else:
            from .torchexport import write_torch

            write_torch(tmp, store, layout, names, target, report, progress)
    report.seconds = time.monotonic() - started
    return report


def _prefixes(only) -> list[str]:
    return [only] if isinstance(only, str) else list(only)


def _check_outside(out: Path, store: Store) -> None:
    """The target is not in a local store's directory, at any depth. The store owns that directory: its
    folders (some created only when first needed, as ``tags/``), its top-level objects (``config``, ``tier``,
    ``gc-epoch``, ...) and the temporary files it cleans up; an export among them could be taken for store data
    (and damage it) or be deleted by the store, now or in a later version. Anywhere outside it is fine."""
    root = store.backend.local_path() if isinstance(store.backend, LocalFiles) else None
    if root is None:
        return
    target = out.parent.resolve() / out.name  # (out itself may be a link: the name it makes is in out.parent)
    if target == root.resolve() or target.is_relative_to(root.resolve()):
        raise ValueError(f"export target {out} is inside the store {root}: the store owns everything in its "
                         "directory; write the export outside it")


def _check_target(out: Path) -> None:
    if os.path.lexists(out):
        raise _exists(out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"export target's directory {out.parent} does not exist")


_RENAME_NOREPLACE = 1  # linux/fs.h
_AT_FDCWD = -100


def _rename_noreplace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out`` unless ``out`` exists, in one step where the system can: a target that
    appeared while the export was written (another export, a user's file, an empty folder, which a plain
    rename replaces) is kept and the export refused. Linux's ``renameat2(RENAME_NOREPLACE)`` does it
    atomically; where it is missing or the file system refuses the flag, a look then a rename."""
    fn = getattr(_libc(), "renameat2", None)
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(out), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise _exists(out)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(out))
    _check_target(out)  # appeared while we wrote: keep the other one
    os.rename(tmp, out)


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # no C library to load: the look-then-rename path
        return None


def _exists(out: Path) -> TargetExistsError:
    return TargetExistsError(f"export target {out} already exists; exports never overwrite (remove it or "
                             "choose another path)")


@contextmanager
def _publishing(out: Path, *, directory: bool):
    """A temporary path next to ``out`` to build the export in, renamed to ``out`` when the block succeeds
    and removed when it fails."""
    stem = os.fsencode(out.name)[:200].decode(errors="ignore")  # a name near the 255-byte limit has room too
    tmp = out.with_name(f".{stem}.tmp-{uuid.uuid4().hex[:12]}")
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        _rename_noreplace(tmp, out)
        fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename is durable once the directory is
        finally:
            os.close(fd)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.lexists(tmp):
            tmp.unlink()
        raise
