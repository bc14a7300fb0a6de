"""repair: a lost or damaged config and a damaged pack table are repaired from what the store holds."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from deltackpt.errors import ManifestFormatError, StoreExistsError, StoreNotFoundError, UnsupportedFormatError
from deltackpt.store import LocalBackend, Store
from deltackpt.store import codec
from deltackpt.store.config import StoreConfig
from deltackpt.store.manifest import ChunkRef, Item, Manifest, Stats
from deltackpt.store.pack import FOOTER_SIZE, HEADER_SIZE, pack_key, read_pack_entries, walk_entries
from deltackpt.store.repair import infer_chunk_size, repair_store
from deltackpt.store.verify import verify_store

from store_helpers import assert_items_equal

CHUNK = 64 * 1024


@pytest.fixture
def populated(tmp_path, rng):
    """A local store with a non-default chunk size and three related checkpoints (keyframes and deltas)."""
    root = tmp_path / "s"
    store = Store.init(LocalBackend(root, fsync=False), chunk_size_bytes=CHUNK, pack_target_bytes=256 * 1024)
    w = rng.standard_normal(200_000).astype(np.float32)
    saved = {}
    for step in range(3):
        w = w.copy()
        w[rng.integers(0, w.size, 2000)] += np.float32(0.01)
        items = {"w": w, "b": rng.standard_normal(100).astype(np.float64), "meta": f"step {step}".encode() * 100}
        store.save(f"step-{step}", items, metadata={"step": step})
        saved[f"step-{step}"] = items
    return root, store.config, saved


def assert_store_whole(root, saved) -> None:
    store = Store.open(root)
    for name, items in saved.items():
        assert_items_equal(items, store.load(name))
    report = verify_store(store, level=2)
    assert report.ok and report.orphan_packs == [], report.as_dict()


def test_missing_config_is_recreated(populated):
    root, cfg, saved = populated
    os.unlink(root / "config")
    with pytest.raises(StoreNotFoundError, match="deltackpt repair"):
        Store.open(root)
    with pytest.raises(StoreExistsError, match="deltackpt repair"):  # a save must not start a new store
        Store.open_or_init(root)
    with pytest.raises(StoreExistsError, match="deltackpt repair"):
        Store.init(root)
    assert not (root / "config").exists()

    report = repair_store(root)
    assert report.config_recreated and report.config_backup is None and report.ok
    assert report.store_id == cfg.store_id
    assert report.chunk_size_inferred and report.chunk_size_bytes == CHUNK
    new = Store.open(root).config
    assert new.store_id == cfg.store_id and new.chunk_size_bytes == CHUNK
    assert new.pack_target_bytes == StoreConfig().pack_target_bytes  # not in any manifest: the default
    # The saves chained deltas (a new store's max_chain): without "delta-chains" they would read as damage.
    assert "delta-chains" in new.features and cfg.max_chain > 1
    assert_store_whole(root, saved)


def test_recreated_config_keeps_a_chained_store_readable(tmp_path, rng):
    root = tmp_path / "s"
    store = Store.init(LocalBackend(root, fsync=False), chunk_size_bytes=CHUNK, max_chain=4)
    w = rng.standard_normal(200_000).astype(np.float32)
    saved = {}
    for step in range(4):
        w = w.copy()
        w[rng.integers(0, w.size, 200)] += np.float32(0.01)
        store.save(f"step-{step}", {"w": w})
        saved[f"step-{step}"] = {"w": w}
    entries = {e.chunk_id: e for e in store.index.iter_entries()}
    assert any(e.base_id in entries and codec.is_delta(entries[e.base_id].codec) for e in entries.values()
               if codec.is_delta(e.codec)), "expected a delta whose base is a delta"
    os.unlink(root / "config")
    assert repair_store(root).config_recreated
    assert "delta-chains" in Store.open(root).config.features  # without it the chains read as damage
    assert_store_whole(root, saved)


@pytest.mark.parametrize("garbage", [b"\x00\xff garbage", b'{"format_version": 1, "store_id": 7}', b""])
def test_damaged_config_is_recreated_and_kept(populated, garbage):
    root, cfg, saved = populated
    (root / "config").write_bytes(garbage)
    with pytest.raises(ManifestFormatError, match="deltackpt repair"):
        Store.open(root)
    report = repair_store(root)
    assert report.config_recreated and report.store_id == cfg.store_id and report.chunk_size_bytes == CHUNK
    assert (root / report.config_backup).read_bytes() == garbage  # repair deletes nothing
    assert_store_whole(root, saved)
    # the store keeps working: a new save deduplicates against the old chunks
    items = dict(saved["step-2"])
    m = Store.open(root).save("after", items)
    assert m.stats.new_chunks == 0


def _pack_of(store, name="step-0"):
    m = store.read_manifest(name)
    item = next(it for it in m.items if it.key == "w")
    return store.index.lookup(item.chunks[0].id).pack


def _victim_pack(root):
    """(store, the pack holding w's first chunk, its path, its bytes as a bytearray to damage)."""
    store = Store.open(root)
    victim = _pack_of(store)
    path = root / pack_key(victim)
    return store, victim, path, bytearray(path.read_bytes())


def test_damaged_pack_table_is_rebuilt(populated):
    root, _cfg, saved = populated
    _store, victim, path, data = _victim_pack(root)
    table_offset = struct.unpack_from("<Q", data, len(data) - FOOTER_SIZE)[0]
    data[table_offset + 3] ^= 0x40  # a byte of the table's first row
    path.write_bytes(bytes(data))
    assert not verify_store(Store.open(root), level=1).ok

    report = repair_store(root)
    assert list(report.rebuilt_packs) == [victim] and report.ok and not report.config_recreated
    assert report.recovered_chunks > 0 and report.dropped_entries == 0
    assert (root / (pack_key(victim) + ".damaged")).read_bytes() == bytes(data)  # kept, not deleted
    # every entry was intact, so the rebuilt pack is byte for byte the original, under its own name
    assert report.rebuilt_packs[victim] == [victim]
    assert verify_store(Store.open(root), level=1).ok
    assert_store_whole(root, saved)


def test_truncated_pack_keeps_the_entries_before_the_cut(populated):
    root, _cfg, saved = populated
    store = Store.open(root)
    victim = _pack_of(store)
    path = root / pack_key(victim)
    data = path.read_bytes()
    table_offset = struct.unpack_from("<Q", data, len(data) - FOOTER_SIZE)[0]
    path.write_bytes(data[:table_offset])  # table and footer gone, every entry intact
    report = repair_store(root)
    assert list(report.rebuilt_packs) == [victim] and report.ok
    assert report.rebuilt_packs[victim] == [victim]  # the lost table and footer are rebuilt as they were
    assert (root / pack_key(victim)).read_bytes() == data
    assert_store_whole(root, saved)


def test_damaged_entry_is_dropped_and_reported(populated):
    root, _cfg, _saved = populated
    store = Store.open(root)
    victim = _pack_of(store)
    path = root / pack_key(victim)
    data = bytearray(path.read_bytes())
    data[-FOOTER_SIZE] ^= 1  # the footer: the table is unreadable
    data[8 + HEADER_SIZE + 5] ^= 1  # the first entry's payload
    path.write_bytes(bytes(data))
    report = repair_store(root)
    assert not report.ok and report.dropped_entries >= 1 and list(report.rebuilt_packs) == [victim]
    assert (root / (pack_key(victim) + ".damaged")).exists()
    problems = verify_store(Store.open(root), level=2)
    assert "step-0" in problems.damaged_checkpoints  # verify says what the lost chunk affects


def test_entries_past_a_damaged_header_are_recovered_and_the_loss_reported(populated):
    root, _cfg, _saved = populated
    store, victim, path, data = _victim_pack(root)
    entries = sorted(read_pack_entries(store.backend, victim), key=lambda e: e.offset)
    assert len(entries) >= 3
    data[-FOOTER_SIZE] ^= 1  # the table is unreadable
    data[entries[1].offset + 10] ^= 1  # and the second entry's header
    path.write_bytes(bytes(data))
    report = repair_store(root)
    assert not report.ok and report.dropped_entries == 1
    assert report.recovered_chunks == len(entries) - 1  # every entry but the damaged one, also those after it
    index = Store.open(root).index
    assert all(index.lookup(e.chunk_id) is not None for e in entries if e is not entries[1])
    assert index.lookup(entries[1].chunk_id) is None
    gaps = []
    assert [e.offset for e in walk_entries(bytes(data), victim, gaps)] == [e.offset for e in entries
                                                                           if e is not entries[1]]
    assert gaps == [(entries[1].offset, entries[2].offset - entries[1].offset)]


def test_healthy_store_is_left_alone(populated):
    root, _cfg, saved = populated
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and "cache" not in p.parts}
    report = repair_store(root)
    assert report.ok and not report.config_recreated and not report.rebuilt_packs
    after = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and "cache" not in p.parts}
    assert after == before
    assert_store_whole(root, saved)


def test_not_a_store_is_refused_and_untouched(tmp_path):
    d = tmp_path / "project"
    d.mkdir()
    (d / "config").write_text("a: 1\n")
    (d / "manifests").mkdir()
    with pytest.raises(StoreNotFoundError, match="not a deltackpt store"):
        repair_store(d)
    with pytest.raises(StoreNotFoundError, match="not a deltackpt store"):
        repair_store(tmp_path / "missing")
    assert sorted(p.name for p in d.iterdir()) == ["config", "manifests"]
    assert not (tmp_path / "missing").exists()


def test_newer_config_is_never_replaced(populated):
    root, _cfg, _saved = populated
    cfg = json.loads((root / "config").read_bytes())
    cfg["format_version"] = 99
    (root / "config").write_text(json.dumps(cfg))
    before = (root / "config").read_bytes()
    with pytest.raises(UnsupportedFormatError):
        repair_store(root)
    assert (root / "config").read_bytes() == before


def _item(refs, offset=0, kind="array"):
    return Item(key="k", kind=kind, nbytes=sum(r.length for r in refs), chunks=refs, global_offset=offset)


def _manifest(items):
    return Manifest(name="m", store_id="0" * 32, created_ns=0, items=items, stats=Stats())


def test_infer_chunk_size():
    c = lambda n, skip=0: ChunkRef(bytes(16), n, skip)  # noqa: E731
    cell = 1 << 20
    assert infer_chunk_size([_manifest([_item([c(cell), c(100)])])]) == cell  # from offset 0: a whole cell
    assert infer_chunk_size([_manifest([_item([c(5000), c(cell), c(7)], offset=cell - 5000)])]) == cell
    assert infer_chunk_size([_manifest([_item([c(5000), c(300)], offset=cell - 5000)])]) is None  # no cell
    assert infer_chunk_size([_manifest([_item([c(100)])])]) is None  # one chunk says nothing
    assert infer_chunk_size([_manifest([_item([c(9000), c(9000), c(9000)], kind="bytes")])]) is None
    assert infer_chunk_size([]) is None
