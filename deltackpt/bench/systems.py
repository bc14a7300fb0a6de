"""The checkpoint systems the benchmark compares, all driven through the same state dicts.

``dcp``        torch.distributed.checkpoint FileSystemWriter / FileSystemReader, one directory per checkpoint
               (the baseline every ratio is taken against).
``deltackpt``  DeltaStorageWriter / DeltaStorageReader + DeltaSavePlanner, one store per workload, default
               settings unless ``store_config`` overrides them.
``zipnn``      DCP FileSystemWriter into a staging directory, then every file of the checkpoint compressed on
               its own with ZipNN (byte mode, the workload's float dtype); load = decompress + DCP load.
``restic``     DCP FileSystemWriter into one staging directory, then ``restic backup`` of it into one
               repository (format v2, ``--compression auto`` or ``max``); load = ``restic restore`` + DCP load.

Stored bytes: the directory of checkpoints (dcp, zipnn), the store's physical bytes (packs, manifests, config;
its LMDB index cache is reported apart as ``cache_bytes``), the repository directory (restic, run with
``--no-cache``). Every method works in one process or on every rank of a gloo process group (collective
calls, rank 0 runs the single-writer steps); ``child_peak_bytes`` is the peak RSS of the external program
the last call ran, if any.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from .measure import dir_bytes, run_child

SYSTEMS = ("dcp", "deltackpt", "zipnn", "restic")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


class System:
    name = ""

    def __init__(self, root: str | os.PathLike, options: dict | None = None) -> None:
        self.root = Path(root)
        self.options = dict(options or {})
        self.child_peak_bytes = 0

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this system cannot run here, or None."""
        return None

    def setup(self) -> None:
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        _barrier()

    def save(self, state: dict, name: str) -> None:
        raise NotImplementedError

    def load(self, state: dict, name: str) -> None:
        raise NotImplementedError

    def after_load(self, name: str) -> None:
        """Remove what a load unpacked (not timed)."""

    def stored_bytes(self) -> int:
        raise NotImplementedError

    def data_paths(self, name: str) -> list[Path]:
        """What a load of checkpoint ``name`` reads (warmed into the page cache before a timed load)."""
        return [self.root / name]

    def extra(self) -> dict:
        return {}


class DcpSystem(System):
    name = "dcp"

    def save(self, state, name):
        dcp.save(state, storage_writer=FileSystemWriter(str(self.root / name)))

    def load(self, state, name):
        dcp.load(state, storage_reader=FileSystemReader(str(self.root / name)))

    def stored_bytes(self):
        return dir_bytes(self.root)


class DeltackptSystem(System):
    name = "deltackpt"

    @property
    def path(self) -> Path:
        return self.root / "store"

    def setup(self):
        from ..store import Store

        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            Store.init(self.path, **self.options.get("store_config", {}))
        _barrier()

    def save(self, state, name):
        from .. import DeltaSavePlanner, DeltaStorageWriter
        from ..store import Store

        if getattr(self, "_store", None) is None:  # one Store for the run: it keeps its keyframes for the next save
            self._store = Store.open(self.path)
        dcp.save(state, storage_writer=DeltaStorageWriter(self._store, checkpoint_id=name),
                 planner=DeltaSavePlanner())

    def load(self, state, name):
        from .. import DeltaStorageReader

        dcp.load(state, storage_reader=DeltaStorageReader(str(self.path), name))

    def stored_bytes(self):
        from ..store import Store

        return Store.open(self.path).usage().physical_bytes

    def data_paths(self, name):
        return [self.path]

    def extra(self):
        from ..store import Store

        store = Store.open(self.path)
        infos = store.list_checkpoints()
        cfg = store.config
        return {"cache_bytes": dir_bytes(self.path / "cache"),
                "logical_bytes": sum(i.logical_bytes for i in infos),
                "new_bytes_per_checkpoint": [i.stored_bytes + i.manifest_bytes for i in infos],
                "store_config": {"chunk_size_bytes": cfg.chunk_size_bytes, "zstd_level": cfg.zstd_level,
                                 "delta": cfg.delta, "keyframe_interval": cfg.keyframe_interval,
                                 "delta_min_gain": cfg.delta_min_gain, "min_gain": cfg.min_gain,
                                 "max_chain": cfg.max_chain, "chain_links": cfg.chain_links}}


class ZipnnSystem(System):
    """Each DCP file compressed on its own with ZipNN.

    Two ZipNN 0.5.x quirks are worked around: it rewrites its input buffer in place (it always gets a
    private bytearray read from the file), and a buffer whose length is not a multiple of 4 corrupts the
    heap in its C core (crashes seen with ``double free or corruption``), so every file is zero-padded to a
    multiple of 4 and its true length is kept in an 8-byte prefix of the stored file (counted as stored).
    """

    name = "zipnn"

    @classmethod
    def unavailable(cls):
        return None if importlib.util.find_spec("zipnn") else "zipnn not installed (pip install zipnn)"

    def _codec(self):
        from zipnn import ZipNN

        return ZipNN(input_format="byte", bytearray_dtype=self.options.get("dtype", "float32"))

    def _mine(self, files: list[str]) -> list[str]:
        rank, world = _rank(), _world()
        return [f for i, f in enumerate(sorted(files)) if i % world == rank]

    def save(self, state, name):
        stage, dest = self.root / "staging" / name, self.root / "ckpts" / name
        dcp.save(state, storage_writer=FileSystemWriter(str(stage)))
        if _rank() == 0:
            dest.mkdir(parents=True, exist_ok=True)
        _barrier()
        codec = self._codec()
        for fname in self._mine(os.listdir(stage)):
            with open(stage / fname, "rb") as f:
                data = bytearray(f.read())
            size = len(data)
            data += bytes(-size % 4)
            with open(dest / (fname + ".znn"), "wb") as f:
                f.write(size.to_bytes(8, "little"))
                f.write(codec.compress(data))
                os.fsync(f.fileno())
        _barrier()
        if _rank() == 0:
            shutil.rmtree(stage)

    def load(self, state, name):
        src, out = self.root / "ckpts" / name, self.root / "restore" / name
        if _rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
        _barrier()
        codec = self._codec()
        for fname in self._mine(os.listdir(src)):
            with open(src / fname, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                data = f.read()
            with open(out / fname.removesuffix(".znn"), "wb") as f:
                f.write(memoryview(codec.decompress(data))[:size])
        _barrier()
        dcp.load(state, storage_reader=FileSystemReader(str(out)))

    def after_load(self, name):
        _barrier()
        if _rank() == 0:
            shutil.rmtree(self.root / "restore" / name, ignore_errors=True)
        _barrier()

    def stored_bytes(self):
        return dir_bytes(self.root / "ckpts")

    def data_paths(self, name):
        return [self.root / "ckpts" / name]


class ResticSystem(System):
    """One restic repository per workload; every checkpoint is one snapshot of the same staging path."""

    name = "restic"

    @classmethod
    def unavailable(cls):
        return None if shutil.which("restic") else "restic not installed (apt-get install restic)"

    def __init__(self, root, options=None) -> None:
        super().__init__(root, options)
        # name -> snapshot id, kept in a file so another process (the ranks after a reshard) can restore.
        self._snap_file = self.root / "snapshots.json"
        self.snapshots: dict[str, str] = json.loads(self._snap_file.read_text()) if self._snap_file.exists() else {}

    @property
    def repo(self) -> Path:
        return self.root / "repo"

    @property
    def stage(self) -> Path:
        return self.root / "staging" / "ckpt"

    def _run(self, *args: str) -> str:
        env = {**os.environ, "RESTIC_PASSWORD": "deltackpt-bench", "RESTIC_REPOSITORY": str(self.repo)}
        out, peak = run_child(["restic", "--no-cache", *args], env=env)
        self.child_peak_bytes = max(self.child_peak_bytes, peak)
        return out

    def setup(self):
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._run("init", "--repository-version", "2")
        _barrier()

    def save(self, state, name):
        self.child_peak_bytes = 0
        if _rank() == 0 and self.stage.exists():
            shutil.rmtree(self.stage)
        _barrier()
        dcp.save(state, storage_writer=FileSystemWriter(str(self.stage)))
        _barrier()
        if _rank() == 0:
            out = self._run("backup", str(self.stage), "--json", "--host", "bench", "--tag", name,
                            "--compression", self.options.get("compression", "auto"))
            summary = [json.loads(line) for line in out.splitlines() if '"summary"' in line]
            self.snapshots[name] = summary[-1]["snapshot_id"]
            self._snap_file.write_text(json.dumps(self.snapshots))
            shutil.rmtree(self.stage)
        _barrier()

    def _restored(self, name: str) -> Path:
        return self.root / "restore" / name

    def load(self, state, name):
        self.child_peak_bytes = 0
        if _rank() == 0:
            self._run("restore", self.snapshots[name], "--target", str(self._restored(name)))
        _barrier()
        path = self._restored(name) / str(self.stage.resolve()).lstrip("/")
        dcp.load(state, storage_reader=FileSystemReader(str(path)))

    def after_load(self, name):
        _barrier()
        if _rank() == 0:
            shutil.rmtree(self._restored(name), ignore_errors=True)
        _barrier()

    def stored_bytes(self):
        return dir_bytes(self.repo)

    def data_paths(self, name):
        return [self.repo]

    def extra(self):
        return {"compression": self.options.get("compression", "auto")}


SYSTEM_CLASSES = {c.name: c for c in (DcpSystem, DeltackptSystem, ZipnnSystem, ResticSystem)}


def system_class(name: str) -> type[System]:
    """The class of system ``name``; ``deltackpt-LABEL`` is deltackpt with a StoreConfig variant."""
    base = "deltackpt" if name.startswith("deltackpt-") else name
    if base not in SYSTEM_CLASSES:
        raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
    return SYSTEM_CLASSES[base]


def make_system(name: str, root, options: dict | None = None) -> System:
    system = system_class(name)(root, options)
    system.name = name
    return system


def system_options(name: str, dtype: str, opts: dict) -> dict:
    """The constructor options of system ``name`` for a workload of ``dtype``, from the run's ``opts``."""
    if name == "deltackpt":
        return {"store_config": dict(opts.get("store_config") or {})}
    if name.startswith("deltackpt-"):
        return {"store_config": dict(opts["variants"][name.removeprefix("deltackpt-")])}
    if name == "zipnn":
        return {"dtype": dtype}
    if name == "restic":
        return {"compression": opts.get("restic_compression", "auto")}
    return {}
