"""repair: make a store usable again after damage to its ``config`` or to a pack's table. Deletes no data.

- ``config`` missing or unreadable: recreated from what the store holds. The store id comes from the
  manifests' ``store_id``; the array chunk size from the lengths of the manifests' array chunk refs (a whole
  grid cell is exactly one chunk size); it lists every feature this code reads, and every other field takes
  its default. A damaged config is kept as
  ``config.damaged-<time>``. A config from a newer deltackpt (UnsupportedFormatError) is never replaced.
- A pack whose table or footer is unreadable: its entries are found from their self-describing headers,
  each one decoded and checked against its id, and the good ones are copied byte for byte into a new pack
  (named, like every pack, by the hash of its bytes: with every entry intact that is the original pack, whose
  name it takes back). The damaged bytes are kept as ``packs/<xx>/<name>.damaged``, a name the index, gc and
  verify do not treat as a pack.
- The index cache is rebuilt from the packs.

Repair runs under the store's exclusive lock, like gc: no save commits against packs it moves.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from ..errors import CorruptChunkError, ManifestFormatError, MissingChunkError
from .config import (CONFIG_KEY, NEW_STORE_MAX_CHAIN, SUPPORTED_FEATURES, StoreConfig, data_features,
                     decode_config, encode_config)
from .repack import repack_packs
from .index import GC_EPOCH_KEY
from .location import holds_store_data, not_a_store_error, open_backend
from .lock import EXCLUSIVE, StoreLock
from .manifest import Manifest, decode_manifest
from .pack import MAX_CHUNK_BYTES, pack_name_from_key, read_pack_entries, walk_entries
from .progress import Progress, phase
from .source import ChunkSource
from .repository import Store

DAMAGED_SUFFIX = ".damaged"


@dataclass
class RepairReport:
    """What :func:`repair_store` did. ``ok``: nothing is left that repair could not recover."""

    store_id: str
    chunk_size_bytes: int
    config_recreated: bool = False
    config_backup: str | None = None  # key of the damaged config, kept
    chunk_size_inferred: bool = False  # False: the manifests did not show it, the default was used
    rebuilt_packs: dict[str, list[str]] = field(default_factory=dict)  # damaged pack -> new pack(s)
    recovered_chunks: int = 0
    # Entries of damaged packs lost (kept in .damaged): each that did not decode, and one for each stretch no
    # header of which checked out (one entry or more: a lower bound).
    dropped_entries: int = 0
    unrecoverable_packs: list[str] = field(default_factory=list)  # damaged packs with no intact entry
    packs_indexed: int = 0

    @property
    def ok(self) -> bool:
        return not self.unrecoverable_packs and not self.dropped_entries

    def as_dict(self) -> dict:
        return {**self.__dict__, "ok": self.ok}


def repair_store(location, progress: Progress | None = None) -> RepairReport:
    """Repair the store at ``location`` (a path or a Backend); see the module docstring. ``progress`` hears
    of each pack table checked, then of the index rebuild."""
    backend = open_backend(location)
    if _read_config(backend) is None and not holds_store_data(backend):
        raise not_a_store_error(backend)  # nothing says this is a store: write nothing here, not even a lock
    with StoreLock(backend, EXCLUSIVE):
        report = _repair_config(backend)
        store = Store.open(backend)
        _rebuild_damaged_packs(store, report, progress)
        report.packs_indexed = store.rebuild_index(progress=progress)[0]
    return report


def _read_config(backend) -> StoreConfig | None:
    """The store's config, or None when it is missing or damaged (a newer format raises, never replaced)."""
    try:
        return decode_config(backend.get(CONFIG_KEY))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ManifestFormatError):
        return None


def _repair_config(backend) -> RepairReport:
    cfg = _read_config(backend)
    if cfg is not None:
        return RepairReport(store_id=cfg.store_id, chunk_size_bytes=cfg.chunk_size_bytes)
    try:
        data = backend.get(CONFIG_KEY)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        data = None
    manifests = list(_readable_manifests(backend))
    ids = Counter(m.store_id for m in manifests if re.fullmatch(r"[0-9a-f]{32}", m.store_id))
    store_id = ids.most_common(1)[0][0] if ids else uuid.uuid4().hex
    chunk = infer_chunk_size(manifests)
    defaults = StoreConfig()
    # Every encoding this code reads: the lost config may have listed any of them (a chained store
    # recreated without "delta-chains" would read its chains as damage); new writes chain as a new store's.
    cfg = StoreConfig(store_id=store_id, chunk_size_bytes=chunk or defaults.chunk_size_bytes,
                      pack_target_bytes=max(defaults.pack_target_bytes, chunk or 0), max_chain=NEW_STORE_MAX_CHAIN,
                      features=data_features(SUPPORTED_FEATURES)).validate()
    report = RepairReport(store_id=store_id, chunk_size_bytes=cfg.chunk_size_bytes, config_recreated=True,
                          chunk_size_inferred=chunk is not None)
    if data is not None:
        report.config_backup = f"{CONFIG_KEY}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
        backend.put(report.config_backup, data)
    backend.put(CONFIG_KEY, encode_config(cfg))
    return report


def _readable_manifests(backend):
    for info in backend.list("manifests/"):
        name = info.key[len("manifests/"):]
        if "/" in name:
            continue
        try:
            yield decode_manifest(backend.get(info.key), f"manifest {name!r}")
        except (ManifestFormatError, FileNotFoundError):
            continue  # verify reports it; repair needs only the readable ones


def infer_chunk_size(manifests: list[Manifest]) -> int | None:
    """The array chunk size the manifests' chunks were cut with, or None when no ref shows it.

    Array items are cut on a grid of ``chunk_size_bytes`` in their group's byte space, so a ref between two
    others of its item, or the first of an item starting at offset 0 with more after it, is one whole grid
    cell. The most common such length wins (a resharded save's slices of parent chunks are rarer), and no
    array ref may be longer than it.
    """
    cells: Counter[int] = Counter()
    longest = 0
    for m in manifests:
        for item in m.items:
            if item.kind != "array":
                continue
            refs = item.chunks
            longest = max([longest, *(r.length for r in refs)])
            for i, r in enumerate(refs):
                inner = 0 < i < len(refs) - 1 or (i == 0 and len(refs) > 1 and item.global_offset == 0)
                if inner and r.skip == 0:
                    cells[r.length] += 1
    if not cells:
        return None
    size = cells.most_common(1)[0][0]
    if size < 4096 or size % 8 or size > MAX_CHUNK_BYTES or longest > size:
        return None
    return size


def _rebuild_damaged_packs(store: Store, report: RepairReport, progress: Progress | None) -> None:
    backend = store.backend
    source = ChunkSource(store, cache_bytes=0)
    listed = list(backend.list("packs/"))
    with phase(progress, "repair packs", len(listed), "pack") as bar:
        for info in listed:
            bar.advance(1)
            name = pack_name_from_key(info.key)
            if name is None:
                continue
            try:
                read_pack_entries(backend, name, info.size_bytes)
                continue
            except ManifestFormatError:
                pass
            data = backend.get(info.key)
            good, gaps = [], []
            entries = walk_entries(data, name, gaps)
            report.dropped_entries += len(gaps)  # a stretch no header of which checked out: one entry or more
            for entry in entries:
                try:
                    source.decode_entry(entry)
                    good.append(entry)
                except (CorruptChunkError, MissingChunkError, ManifestFormatError):
                    report.dropped_entries += 1
            if not good:
                report.unrecoverable_packs.append(name)
                continue
            # Set aside first, never deleted: it may hold bytes past the damage that a person can still recover.
            backend.put(info.key + DAMAGED_SUFFIX, data)
            _moved, names, _damaged = repack_packs(store, {name: good})
            if name not in names:  # (every entry intact: the rebuilt pack is the original, under its own name)
                # A new gc epoch first, as gc's: caches elsewhere (and commit records' tables) locate in it.
                backend.put(GC_EPOCH_KEY, uuid.uuid4().hex.encode())
                backend.delete(info.key)
            report.rebuilt_packs[name] = sorted(names)
            report.recovered_chunks += len(good)
