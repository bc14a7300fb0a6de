"""``import_checkpoint``: a stock DCP checkpoint directory or a ``torch.save`` file into the store.

A DCP directory keeps its sharding: each saved chunk (a ``.distcp`` slice) becomes the item a native save
of that chunk would have written (same key, same placement in its global tensor), so the checkpoint loads
through ``DeltaStorageReader`` like a native one, resharded, and its chunks dedup and delta against what the
store holds (importing the step directories of one run stores them incrementally). Nothing from the source
is executed: ``.metadata`` is unpickled with an allow-list of DCP's own metadata classes, tensors with
``torch.load(weights_only=True)``, and pickled non-tensor values are stored as the bytes they are.
A ``torch.save`` file is loaded with ``weights_only=True`` (memory-mapped) and saved through ``dcp.save``.

Every check that can fail on the source (its metadata, the presence and size of each slice) runs before
anything is written; a payload found bad while writing aborts the save: nothing is committed (packs already
published are unreferenced, for gc).
"""

from __future__ import annotations

import io
import pickle
import re
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from ..dcp import LAYER_KEY, save
from ..dcp.metadata_schema import encode_metadata
from ..dcp.placement import add_shard, item_key, unsupported_layout
from ..dcp.planner import first_line
from ..dcp.writer import open_store
from ..errors import CheckpointExistsError, InvalidNameError, SourceFormatError, UnsafeSourceError
from ..store import SHARED, Progress, Store, phase, validate_name
from .dcpsource import DcpSource, read_dcp_dir
from .safetensors import SAFETENSORS_METADATA
from .weightsonly import describe_load_error, is_unsafe, refusal_reason

MAX_DEPTH = 100  # containers nested deeper in an imported state dict are refused (real ones nest < 10)


@dataclass
class ImportReport:
    name: str
    source: str
    source_bytes: int  # the files the checkpoint is made of
    logical_bytes: int
    stored_bytes: int  # what the store grew by: new packs and the manifest
    skipped: bool = False  # --all: not imported; ``note`` says why
    seconds: float = 0.0
    note: str = ""  # why it was skipped: "exists" (the store has this name), or what is wrong with the name

    @property
    def ratio(self) -> float:
        return self.source_bytes / self.stored_bytes if self.stored_bytes else float("inf")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = None if self.ratio == float("inf") else self.ratio
        return d


def import_checkpoint(store, src, name: str | None = None, *, progress: Progress | None = None,
                      storage_options: dict | None = None) -> ImportReport:
    """Import ``src`` (a DCP checkpoint directory or a ``torch.save`` file) as checkpoint ``name`` (default:
    the directory's name, the file's name less its suffix) of ``store`` (created if absent)."""
    src = Path(src)
    name = validate_name(name) if name is not None else _name_of(src)
    source = _read_source(src)  # every check on the source, before the store is touched
    store = open_store(store, storage_options)
    if store.exists(name):
        raise CheckpointExistsError(name, hint="import it under another name (--name, name=) or forget it first")
    return _import(store, source, name, {"imported_from": str(src)}, progress)


def _name_of(src: Path) -> str:
    """The checkpoint name a source gives itself: a directory's name, a file's name less its suffix."""
    name = src.name if src.is_dir() else src.stem
    try:
        return validate_name(name)
    except InvalidNameError as e:
        raise InvalidNameError(f"{e}; {src.name!r} cannot name the checkpoint: give it a name (--name NAME on "
                               "the command line, name= in Python)") from None


def import_all(store, directory, *, progress: Progress | None = None, storage_options: dict | None = None
               ) -> list[ImportReport]:
    """Import every DCP checkpoint directory directly under ``directory`` in step order (the last number in
    each name; names without one last, by name). Names already in the store are skipped (so an interrupted
    run can be resumed). Every source is read and checked before the first is imported.

    A link to a directory that is imported anyway (``latest -> step-200``) is skipped, and so is a directory
    whose name cannot be a checkpoint's (``latest``, ``step 100``): each has a report with ``skipped`` and a
    ``note`` saying why (import such a one alone, with a name: ``import_checkpoint(store, d, name=...)``)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SourceFormatError(f"{directory} is not a directory")
    found = [d for d in directory.iterdir() if d.is_dir() and (d / ".metadata").is_file()]
    if not found:
        raise SourceFormatError(f"no DCP checkpoint directories (with a .metadata file) under {directory}")
    passed, dirs, chosen = [], [], {}
    problem = {d: _name_problem(d.name) for d in found}
    # One directory reached by several names (a link to it): its own name first, then valid names, by name.
    for d in sorted(found, key=lambda d: (d.is_symlink(), problem[d] is not None, d.name)):
        real = d.resolve()
        if real in chosen:
            passed.append(ImportReport(d.name, str(d), 0, 0, 0, skipped=True,
                                       note=f"a link to {chosen[real].name}, imported under that name"))
        elif problem[d] is not None:
            passed.append(ImportReport(d.name, str(d), 0, 0, 0, skipped=True,
                                       note=f"{problem[d]}; import it alone with --name NAME"))
        else:
            chosen[real] = d
            dirs.append(d)
    dirs.sort(key=lambda d: (step_of(d.name) is None, step_of(d.name) or 0, d.name))
    sources = [read_dcp_dir(d) for d in dirs]
    if not dirs:
        raise SourceFormatError(f"no DCP checkpoint directory under {directory} has a name a checkpoint can have: "
                                + "; ".join(f"{r.name}: {r.note}" for r in passed))
    store = open_store(store, storage_options)
    reports = []
    for d, source in zip(dirs, sources):
        if store.exists(d.name):
            reports.append(ImportReport(d.name, str(d), source.nbytes, 0, 0, skipped=True, note="exists"))
            continue
        meta = {"imported_from": str(d)}
        if step_of(d.name) is not None:
            meta["step"] = step_of(d.name)
        reports.append(_import(store, source, d.name, meta, progress))
    return reports + passed


def _name_problem(name: str) -> str | None:
    try:
        validate_name(name)
    except InvalidNameError as e:
        return str(e)
    return None


def step_of(name: str) -> int | None:
    """The step a checkpoint directory's name carries: its last number (``step-100``, ``global_step100``)."""
    numbers = re.findall(r"\d+", name)
    return int(numbers[-1]) if numbers else None


@dataclass
class _TorchFile:
    path: Path
    state_dict: dict
    nbytes: int
    header_metadata: dict[str, str] | None = None  # a safetensors file's ``__metadata__``, kept for export


def _read_source(src: Path):
    if src.is_dir():
        return read_dcp_dir(src)
    if not src.is_file():
        raise SourceFormatError(f"{src} does not exist")
    sd = _load_torch_file(src)
    return _TorchFile(src, sd, src.stat().st_size, _safetensors_metadata(src) if _is_safetensors(src) else None)


def _is_safetensors(path: Path) -> bool:
    """A safetensors file by its layout (a little-endian header length, then a JSON object), not its name."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return 8 + int.from_bytes(head[:8], "little") <= path.stat().st_size


def _load_torch_file(path: Path) -> dict:
    """The state dict in a ``torch.save`` file, loaded with ``weights_only=True`` only (memory-mapped when
    the file is in the zip format), or in a safetensors file (no pickle in the format)."""
    if _is_safetensors(path):
        return _load_safetensors(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04" and magic[:1] != b"\x80":  # torch.save's zip format, or a legacy pickle
        raise SourceFormatError(f"{path} is neither a DCP checkpoint directory nor a torch.save or safetensors "
                                "file")
    try:
        if path.suffix == ".safetensors":  # torch.load would hand such a name to the safetensors reader
            with open(path, "rb") as f:
                sd = torch.load(f, map_location="cpu", weights_only=True)
        else:
            try:
                sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                sd = torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
    except MemoryError:
        raise
    except OSError as e:
        raise SourceFormatError(f"{path} cannot be read ({first_line(e)})") from None
    except Exception as e:  # noqa: BLE001 - whatever a damaged file makes torch.load raise is a damaged source
        raise _load_error(str(path), e, "it is not a readable torch.save file (damaged or truncated?)") from None
    if not isinstance(sd, dict) or not sd:
        raise SourceFormatError(f"{path} holds a {type(sd).__name__}{' (empty)' if sd == {} else ''}, not a "
                                "state dict")
    _check_layouts(path, sd)
    try:
        flatten_state_dict(sd)  # DCP's keys: two values under one (``{"w.x": ..}`` and ``{"w": {"x": ..}}``)
    except ValueError as e:
        raise SourceFormatError(f"{path}: {e} (DCP names nested values by their dotted path)") from None
    return sd


def _load_error(where: str, e: Exception, damaged: str) -> SourceFormatError:
    """The error for ``torch.load(weights_only=True)`` failing with ``e``: UnsafeSourceError when it refused
    a global, class or function the pickle asks for; otherwise the file is damaged (torch reports an
    unparsable stream as an UnpicklingError too), a SourceFormatError saying ``damaged``."""
    reason = refusal_reason(e) if isinstance(e, pickle.UnpicklingError) else None
    if reason is not None and is_unsafe(reason):
        return UnsafeSourceError(f"{where}: refused, it needs unpickling beyond plain data ({reason}); "
                                 "nothing in it was run")
    return SourceFormatError(f"{where}: {damaged}: {describe_load_error(e)}")


def _check_layouts(path: Path, sd: dict) -> None:
    """Every tensor's bytes can stand for it (not a meta, sparse or quantized tensor: see
    ``unsupported_layout``), and the containers form a tree no deeper than MAX_DEPTH: a state dict that
    contains itself (a pickle can say so, and weights_only loads it) or nests deeper is refused, naming the key.
    A container found again under another key (shared, not an ancestor) is checked once; one shared so often
    that its keys multiply (a few bytes of pickle can name 2**60 paths) is refused before DCP walks them."""
    ancestors: set[int] = set()
    paths: dict[int, int] = {}  # container id -> the number of values under it, counted once per container
    edges = 0

    def visit(obj, key: str, depth: int) -> int:
        nonlocal edges
        if isinstance(obj, torch.Tensor):
            why = unsupported_layout(obj)
            if why is not None:
                raise SourceFormatError(f"{path}: {key or 'the value'}: {why}")
            return 1
        if isinstance(obj, dict):
            items = list(obj.items())
        elif isinstance(obj, (list, tuple)):
            items = list(enumerate(obj))
        else:
            return 1
        if id(obj) in ancestors:
            raise SourceFormatError(f"{path}: the value at {key!r} is a container it is inside of (the state dict "
                                    "contains itself); a checkpoint is a tree of values")
        if id(obj) in paths:
            return paths[id(obj)]
        if depth >= MAX_DEPTH:
            raise SourceFormatError(f"{path}: {key} is nested more than {MAX_DEPTH} containers deep")
        ancestors.add(id(obj))
        edges += len(items)
        n = sum(visit(v, f"{key}.{k}" if key else str(k), depth + 1) for k, v in items)
        ancestors.discard(id(obj))
        paths[id(obj)] = max(n, 1)
        return paths[id(obj)]

    total = visit(sd, "", 0)
    if total > 4 * edges + (1 << 20):
        raise SourceFormatError(f"{path}: its containers are shared so often that it names {total} values in "
                                f"{edges} container entries (a checkpoint is a tree of values)")


def _load_safetensors(path: Path) -> dict:
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError:
        raise SourceFormatError(f"{path} is a safetensors file: reading it needs the safetensors package; "
                                "pip install safetensors") from None

    try:
        sd = load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise SourceFormatError(f"{path} is not a valid safetensors file ({first_line(e)})") from None
    if not sd:
        raise SourceFormatError(f"{path} holds no tensors")
    return sd


def _safetensors_metadata(path: Path) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file (str to str, as the format says), None when it has none."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        found = f.metadata()
    return dict(found) if found else None


def _import(store: Store, source, name: str, meta: dict, progress: Progress | None) -> ImportReport:
    started = time.monotonic()
    if isinstance(source, _TorchFile):
        if source.header_metadata:
            meta = {**meta, SAFETENSORS_METADATA: source.header_metadata}
        save(source.state_dict, store, name, metadata=meta, no_dist=True)
    else:
        with store.lock(SHARED) as lock:
            _import_dcp(store, source, name, meta, lock, progress)
    info = store.summarize(store.read_manifest(name))
    return ImportReport(name, str(source.path), source.nbytes, info.logical_bytes, info.added_bytes,
                        seconds=time.monotonic() - started)


def _import_dcp(store: Store, source: DcpSource, name: str, meta: dict, lock, progress) -> None:
    store.index.sync()  # under the lock: a gc elsewhere may have deleted packs
    writer = store.writer(parent=store.latest_manifest())
    md = source.metadata
    keys = {}
    try:
        with phase(progress, f"import {name}", source.nbytes, "B") as prog, source.open_files() as files:
            for index, info in md.storage_data.items():
                key = keys[index] = item_key(index)
                data = files.read(info)
                smd = md.state_dict_metadata[index.fqn]
                if not isinstance(smd, TensorStorageMetadata):
                    writer.add_bytes(key, data)
                else:
                    _add_tensor(writer, source, index, key, smd, data)
                prog.advance(len(data))
        summary = writer.finish()
        stored = Metadata(state_dict_metadata=md.state_dict_metadata, planner_data=md.planner_data,
                          storage_data=keys, storage_meta=StorageMeta(checkpoint_id=name, save_id=uuid.uuid4().hex),
                          version=md.version or "1.0.0")
        store.commit(name, summary.items, entries=summary.entries, packs=summary.packs, metadata=meta,
                     layer_data={LAYER_KEY: encode_metadata(stored)}, lock=lock)
    except BaseException:
        writer.abort()  # its spool files (packs already published are left to gc)
        raise


def _add_tensor(writer, source: DcpSource, index, key: str, smd: TensorStorageMetadata, data: bytes) -> None:
    where = f"{source.path}: {index.fqn} at offset {list(index.offset)}"
    try:
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a damaged payload makes torch.load raise is a damaged source
        raise _load_error(where, e, "its slice is not a torch.save payload (damaged?)") from None
    sizes = source.chunk_sizes(index)
    if not isinstance(value, torch.Tensor) or value.dtype != smd.properties.dtype or tuple(value.shape) != sizes:
        got = f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise SourceFormatError(f"{where}: holds {got}, the metadata says {smd.properties.dtype} {list(sizes)}")
    why = unsupported_layout(value)
    if why is not None:
        raise SourceFormatError(f"{where}: {why}")
    add_shard(writer, key, index.fqn, value, index.offset, sizes, smd.size)

