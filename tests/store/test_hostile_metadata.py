"""Stored metadata that is well formed but wrong, or newer, or nested past the stack: readers give typed errors
or verify findings, never silent wrong data, and gc never deletes what a surviving manifest references."""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import pytest
import xxhash

from deltackpt import kernels
from deltackpt.errors import CorruptManifestError, ManifestFormatError, UnsupportedFormatError
from deltackpt.store import Store, refstream
from deltackpt.store.gc import plan_gc
from deltackpt.store.manifest import MANIFEST_MAGIC, decode_manifest, encode_manifest, manifest_key
from deltackpt.store.pack import PackBuilder, list_packs, read_pack_entries
from deltackpt.store.retention import read_tags
from deltackpt.store.tier import read_tier
from deltackpt.store.verify import ProblemKind, verify_store


def _rewrite(store, name: str, change) -> None:
    """Checkpoint ``name``'s manifest replaced by ``change(manifest)``, with a valid envelope and checksum."""
    m = decode_manifest(store.backend.get(manifest_key(name)))
    store.backend.put(manifest_key(name), encode_manifest(change(m)))


@pytest.mark.parametrize("items", [3, 6000])  # a small manifest is read whole; a large one streamed
def test_an_item_key_listed_twice_is_a_damaged_manifest(make_store, rng, items, monkeypatch):
    store = make_store("local", "loc")
    store.save("c", {f"a{i}": rng.integers(0, 255, 4096, dtype=np.uint8) for i in range(items)})
    store.save("d", {"x": np.arange(10)})

    def twice(m):
        first = m.items[0]
        other = msgspec.structs.replace(m.items[-1], key=first.key)  # another item's chunks under a used key
        return msgspec.structs.replace(m, items=[*m.items, other])

    _rewrite(store, "c", twice)
    streamed = []
    real = refstream.stream_manifest_ids
    monkeypatch.setattr("deltackpt.store.catalog.stream_manifest_ids",
                        lambda *a: streamed.append(real(*a)) or streamed[-1])
    with pytest.raises(CorruptManifestError, match="appears twice"):
        Store.open(store.backend.root).load("c")
    report = verify_store(store, level=2)
    assert [(p.kind, p.checkpoints) for p in report.problems] == [(ProblemKind.MANIFEST, ["c"])]
    assert "appears twice" in report.problems[0].detail
    assert report.orphan_packs == []  # c's packs are not "unused": c could not be read
    if items > 3:
        assert None in streamed  # the stream refused it (the general read then named the damage)


def test_a_ref_past_its_chunks_end_blames_the_manifest_not_the_chunk(make_store, rng):
    store = make_store("local", "loc")
    store.save("c", {"w": rng.integers(0, 255, 3 * 4096, dtype=np.uint8)})
    ref0 = None

    def shifted(m):
        nonlocal ref0
        it = m.items[0]
        ref0 = it.chunks[0]
        bad = msgspec.structs.replace(ref0, length=100, skip=ref0.length - 50)
        rest = msgspec.structs.replace(it.chunks[1], length=it.chunks[1].length + ref0.length - 100)
        return msgspec.structs.replace(m, items=[msgspec.structs.replace(it, chunks=[bad, rest, *it.chunks[2:]])])

    _rewrite(store, "c", shifted)
    with pytest.raises(CorruptManifestError, match=f"of chunk {ref0.id.hex()}, which holds {ref0.length}"):
        store.load("c")


def test_gc_keeps_every_link_of_a_chain_deeper_than_any_reader_follows(make_store):
    """A chain past MAX_CHAIN is damage (verify says so), but its links are referenced: gc deletes none."""
    store = make_store("local", "loc")
    store.save("c", {"x": np.arange(10)})
    ids = [bytes([i + 1]) * 16 for i in range(70)]
    pb = PackBuilder()
    for i in range(69):
        pb.add(ids[i], 2, 1, 16, b"y" * 10, base_id=ids[i + 1])  # 69 deltas ...
    pb.add(ids[69], 0, 1, 16, b"z" * 16)  # ... down to a keyframe
    pack, _size, _ = pb.publish(store.backend)

    def deep(m):
        chunk = msgspec.structs.replace(m.items[0].chunks[0], id=ids[0], length=16, skip=0)
        item = msgspec.structs.replace(m.items[0], key="x", kind="bytes", nbytes=16, chunks=[chunk], dtype="",
                                       elem_size=1, shape=[])
        return msgspec.structs.replace(m, name="deep", items=[item], parent=None)

    m = decode_manifest(store.backend.get(manifest_key("c")))
    store.backend.put(manifest_key("deep"), encode_manifest(deep(m)))
    store = Store.open(store.backend.root)
    report = verify_store(store, level=0)
    assert any(p.kind == ProblemKind.BAD_BASE and "deep" in p.checkpoints for p in report.problems)
    plan_gc(store, grace_s=0).execute()
    held = {e.chunk_id for name in list_packs(store.backend) for e in read_pack_entries(store.backend, name)}
    assert set(ids) <= held


def test_metadata_nested_past_the_stack_reads_as_damaged(make_store, tmp_path):
    store = make_store("local", "loc")
    store.save("c", {"x": np.arange(10)})
    deep = b"[" * 100_000 + b"]" * 100_000
    store.backend.put("tags/c", deep)
    assert read_tags(store, "c") == ["(damaged)"]
    store.backend.put("tier", deep)
    assert read_tier(store) is None
    store.backend.put("locks/shared-x", deep)
    store.save("d", {"x": np.arange(11)})  # the garbage lock is neither fatal nor a conflict
    store.backend.put("config", deep)
    with pytest.raises(Exception) as ei:
        Store.open(store.backend.root)
    assert type(ei.value).__name__ == "ManifestFormatError" and "not valid JSON" in str(ei.value)


def test_a_manifest_from_a_newer_writer_is_newer_not_damage(make_store):
    store = make_store("local", "loc")
    for name in ("c1", "c2"):
        store.save(name, {"x": np.arange(10)})
    future = MANIFEST_MAGIC + bytes([9]) + b"some future layout" + bytes(64)
    store.backend.put(manifest_key("c1"), future + struct.pack("<Q", xxhash.xxh3_64_intdigest(future)))
    store = Store.open(store.backend.root)
    assert [i.name for i in store.list_checkpoints()] == ["c2"]  # one newer manifest hides nothing else
    with pytest.raises(UnsupportedFormatError):  # placed by its write time: the newest, and not readable here
        store.resolve("latest")
    assert store.resolve("latest", fallback=True) == "c2"  # a resume takes the newest it can read
    with pytest.raises(UnsupportedFormatError):
        verify_store(store, level=0)
    with pytest.raises(UnsupportedFormatError):
        plan_gc(store, grace_s=0)


def test_an_object_dtype_in_a_manifest_is_damage_not_a_numpy_type_error(make_store):
    store = make_store("local", "loc")
    store.save("c", {"x": np.arange(4, dtype=np.int64)})
    _rewrite(store, "c", lambda m: msgspec.structs.replace(
        m, items=[msgspec.structs.replace(m.items[0], dtype="|O")]))
    with pytest.raises(CorruptManifestError, match="Python objects"):
        store.load("c")


def _split_first_ref(m, overrun: int):
    """``m`` with its first item's first ref cut in two reads of its chunk: the first ``overrun`` bytes past
    the chunk's end (none: within it), the item's bytes still summing to its size."""
    it = m.items[0]
    ref = it.chunks[0]
    tail = msgspec.structs.replace(ref, length=100, skip=ref.length - 100 + overrun)
    head = msgspec.structs.replace(ref, length=ref.length - 100, skip=0)
    return msgspec.structs.replace(m, items=[msgspec.structs.replace(it, chunks=[tail, head, *it.chunks[1:]]),
                                             *m.items[1:]])


@pytest.mark.parametrize("kernels_used", ["native", "python"])
@pytest.mark.parametrize("items", [3, 6000])  # a small manifest is read whole; a large one streamed
def test_verify_reports_a_ref_past_its_chunks_end_as_a_damaged_manifest(make_store, rng, items, kernels_used,
                                                                       monkeypatch):
    if kernels_used == "python":  # the refs read by msgspec, no stream: the same finding
        monkeypatch.setattr("deltackpt.kernels.chunk_refs", None)
        monkeypatch.setattr("deltackpt.kernels.walk_refs", None)
    store = make_store("local", "loc")
    data = {f"a{i}": rng.integers(0, 255, 4096, dtype=np.uint8) for i in range(items)}
    store.save("c", data)
    store.save("d", {"x": np.arange(10)})
    store.save("e", {**data, "a0": rng.integers(0, 255, 4096, dtype=np.uint8)})  # shares all but a0 with c
    _rewrite(store, "e", lambda m: _split_first_ref(m, 0))  # two refs within one chunk: sound
    streamed = []
    real = refstream.stream_manifest_ids
    monkeypatch.setattr("deltackpt.store.catalog.stream_manifest_ids",
                        lambda *a: streamed.append(real(*a)) or streamed[-1])
    np.testing.assert_array_equal(Store.open(store.backend.root).load("e")["a1"], data["a1"])
    for level in (0, 1, 2):
        assert verify_store(store, level=level).clean, level
    _rewrite(store, "c", lambda m: _split_first_ref(m, 50))
    cid = decode_manifest(store.backend.get(manifest_key("c"))).items[0].chunks[0].id
    with pytest.raises(CorruptManifestError, match="which holds"):
        Store.open(store.backend.root).load("c")
    for level in (0, 1, 2):
        report = verify_store(store, level=level)
        assert [(p.kind, p.checkpoints, p.items) for p in report.problems] == [
            (ProblemKind.MANIFEST, ["c"], ["c:a0"])], level
        assert f"item 'a0': a chunk ref reads bytes up to 4146 of chunk {cid.hex()} of 4096 bytes" \
            == report.problems[0].detail
        assert not report.clean and report.damaged_checkpoints == ["c"]
        assert verify_store(store, level=level, checkpoints=["d", "e"]).clean
    assert any(isinstance(s, tuple) for s in streamed) == (items > 3 and kernels.walk_refs is not None)


def test_cli_verify_fails_on_a_ref_past_its_chunks_end(make_store, rng, capsys):
    from deltackpt.cli import main

    store = make_store("local", "loc")
    store.save("c", {"w": rng.integers(0, 255, 3 * 4096, dtype=np.uint8)})
    assert main(["verify", str(store.backend.root), "--level", "0"]) == 0
    _rewrite(store, "c", lambda m: _split_first_ref(m, 1))
    capsys.readouterr()
    for level in ("0", "2"):
        assert main(["verify", str(store.backend.root), "--level", level]) == 1
        out = capsys.readouterr().out
        assert "manifest: item 'w': a chunk ref reads bytes up to 4097 of chunk" in out
        assert out.splitlines()[-1] == "1 problem(s); damaged: c"


def test_a_ref_past_its_chunks_end_is_found_when_the_cache_lost_the_chunk(make_store, rng, monkeypatch):
    """Level 0 locates the chunks again after it repairs the cache (the memory of the refs' ends then holds
    the base nodes): a chunk first found in no record is compared with its size when found the second time."""
    from deltackpt.store import verifystructure

    store = make_store("local", "loc")
    store.save("c", {"w": rng.integers(0, 255, 3 * 4096, dtype=np.uint8)})
    _rewrite(store, "c", lambda m: _split_first_ref(m, 7))
    cid = decode_manifest(store.backend.get(manifest_key("c"))).items[0].chunks[0].id
    chunks, _, _ = store.index._dbs()
    with store.index.env.begin(write=True, db=chunks) as txn:
        assert txn.delete(cid)
    located = []
    real = verifystructure._locate_users
    monkeypatch.setattr(verifystructure, "_locate_users", lambda *a: located.append(1) or real(*a))
    report = verify_store(Store.open(store.backend.root), level=0)
    assert len(located) == 2  # before and after the cache was repaired
    assert [(p.kind, p.checkpoints) for p in report.problems] == [(ProblemKind.MANIFEST, ["c"])]
    assert "reads bytes up to 4103 of chunk" in report.problems[0].detail


def _forge_manifest(store, name, change) -> int:
    from deltackpt.store.manifest import decode_manifest, encode_manifest, manifest_key

    m = decode_manifest(store.backend.get(manifest_key(name)))
    change(m)
    raw = encode_manifest(m)
    decode_manifest(raw)  # the forged manifest passes the manifest's own checks
    store.backend.put(manifest_key(name), raw)
    return len(raw)


def test_a_forged_sub_array_dtype_is_a_typed_error(tmp_path):
    store = Store.init(tmp_path / "s")
    store.save("c", {"x": np.arange(1024, dtype=np.int32)})

    def change(m):
        m.items[0].dtype = "(99999999999,99999999999)i4"  # numpy: ValueError, not TypeError

    _forge_manifest(store, "c", change)
    with pytest.raises(CorruptManifestError, match="invalid dtype"):
        Store.open(tmp_path / "s").load("c")


def test_a_small_manifest_claiming_a_terabyte_item_is_a_typed_error(tmp_path):
    from deltackpt.store.manifest import ChunkRef

    store = Store.init(tmp_path / "s")
    store.save("c", {"x": np.arange(1024, dtype=np.int32)})

    def change(m):
        it = m.items[0]
        it.chunks = [ChunkRef(it.chunks[0].id, 1 << 30, 0)] * 1024  # each ref within MAX_REF_BYTES
        it.nbytes = 1024 << 30
        it.shape = [(1024 << 30) // 4]

    assert _forge_manifest(store, "c", change) < 1000
    with pytest.raises(CorruptManifestError, match="which holds 4096"):
        Store.open(tmp_path / "s").load("c")


@pytest.mark.parametrize("version", [99, -1])
def test_a_manifest_body_of_another_format_version_is_refused(version):
    from deltackpt.store.manifest import Manifest, Stats, decode_manifest, encode_manifest

    raw = encode_manifest(Manifest(name="c", store_id="0" * 32, created_ns=1, items=[], stats=Stats(),
                                   format_version=version))
    with pytest.raises(ManifestFormatError, match="format_version"):
        decode_manifest(raw)


def test_a_cache_summary_whose_key_is_not_utf8_is_ignored(tmp_path):
    store = Store.init(tmp_path / "s")
    store.save("c", {"x": np.arange(10)})
    index = store._cache_index()
    with index.env.begin(write=True, db=index._db[b"ckpts"]) as txn:
        txn.put(b"\xff\xfe", b"junk")
    assert [i.name for i in Store.open(tmp_path / "s").list_checkpoints()] == ["c"]
