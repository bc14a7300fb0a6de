"""A rank of a DCP save pays for its own items only: the coordinator reads the parent manifest once and
sends each rank the parent refs its items overlap; no rank reads the manifest, and what a rank reads from
the store and looks up in the index does not grow with the number of ranks. Simulated ranks in one process
(tests/dcp/simranks.py) run the real DeltaStorageWriter code path, each with its own counting backend."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from deltackpt.store import LocalBackend, Store
from deltackpt.store.index import ChunkIndex

from simranks import make_state, perturb, simulate_save

CHUNK = 8192
STATE_BYTES = 4 << 20  # 16 tensors of 256 KiB: 512 chunks, a few per rank at 64 ranks


class CountingBackend(LocalBackend):
    """A local backend that counts what it is asked to read: calls per key prefix and bytes."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.reads: Counter = Counter()
        self.read_bytes = 0

    def _count(self, key: str, n: int) -> None:
        self.reads[key.split("/", 1)[0]] += 1
        self.read_bytes += n

    def get(self, key):
        data = super().get(key)
        self._count(key, len(data))
        return data

    def get_range(self, key, offset, length):
        data = super().get_range(key, offset, length)
        self._count(key, len(data))
        return data

    def get_range_into(self, key, offset, buffers):
        n = super().get_range_into(key, offset, buffers)
        self._count(key, n)
        return n


@pytest.fixture
def lookups(monkeypatch):
    """Chunk ids looked up in the index, per ChunkIndex object (each simulated rank's store has its own)."""
    counts: Counter = Counter()
    real_lookup, real_many, real_records = ChunkIndex.lookup, ChunkIndex.lookup_many, ChunkIndex.lookup_records

    def lookup(self, cid):
        counts[id(self)] += 1
        return real_lookup(self, cid)

    def lookup_many(self, ids):
        ids = list(ids)
        counts[id(self)] += len(ids)
        return real_many(self, ids)

    def lookup_records(self, ids):
        ids = list(ids)
        counts[id(self)] += len(ids)
        return real_records(self, ids)

    monkeypatch.setattr(ChunkIndex, "lookup", lookup)
    monkeypatch.setattr(ChunkIndex, "lookup_many", lookup_many)
    monkeypatch.setattr(ChunkIndex, "lookup_records", lookup_records)
    return counts


def _ranks(path, n: int) -> list[Store]:
    Store.init(path, chunk_size_bytes=CHUNK, exist_ok=True)
    return [Store.open(CountingBackend(path)) for _ in range(n)]


def _second_save(tmp_path, ranks: int, lookups: Counter, fraction: float = 0.01):
    """Save a state, then the state with ``fraction`` of its rows changed, over ``ranks`` simulated ranks; the
    stores (counting what the second save read) and the second state."""
    state0 = make_state(STATE_BYTES, rows=512)
    stores = _ranks(tmp_path / f"r{ranks}", ranks)
    simulate_save(stores, "s0", state0)
    for s in stores:
        s.backend.reads.clear()
        s.backend.read_bytes = 0
    lookups.clear()
    state1 = perturb(state0, fraction) if fraction else state0
    simulate_save(stores, "s1", state1)
    return stores, state1


def test_no_rank_but_the_coordinator_reads_the_parent_manifest(tmp_path, lookups):
    stores, state1 = _second_save(tmp_path, 8, lookups)
    assert stores[0].backend.reads["manifests"] == 1  # the parent, once, while planning
    assert [s.backend.reads["manifests"] for s in stores[1:]] == [0] * 7
    # The save is still incremental (the ranks diffed against the parent the coordinator sent them) and
    # loads back bit-exact.
    m = stores[0].read_manifest("s1")
    assert m.parent == "s0" and 0 < m.stats.new_chunks <= m.stats.num_chunks // 4
    loaded = stores[0].load("s1")
    assert len(loaded) == 8 * len(state1)
    for key, shard in loaded.items():
        fqn, offsets = key.split("@")
        row = int(offsets.split(",")[0])
        assert shard.tobytes() == state1[fqn][row:row + shard.shape[0]].numpy().tobytes()


def test_what_a_rank_reads_does_not_grow_with_the_number_of_ranks(tmp_path, lookups):
    read = {}
    for ranks in (8, 64):
        stores, _ = _second_save(tmp_path, ranks, lookups)
        read[ranks] = max(s.backend.read_bytes for s in stores[1:])
    # A rank's share of the state shrinks 8x, and so must what it reads (each rank read the whole parent
    # manifest before, which grows with the number of items).
    assert read[64] <= read[8]


def test_each_chunk_is_looked_up_once_per_save(tmp_path, lookups):
    stores, _ = _second_save(tmp_path, 8, lookups, fraction=0.0)
    own = STATE_BYTES // CHUNK // 8
    # Every rank looks its own chunks up once, while writing; the coordinator's commit trusts those look-ups
    # and checks only that the packs they found still exist (it looked every chunk up again before).
    assert [lookups[id(s.index)] for s in stores] == [own] * 8
    assert stores[0].read_manifest("s1").stats.new_chunks == 0


def test_save_phases_are_logged(tmp_path, lookups, caplog):
    with caplog.at_level(logging.DEBUG, logger="deltackpt.dcp"):
        _second_save(tmp_path, 4, lookups)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "deltackpt.dcp")
    assert "save s1: plan " in text and "parent s0" in text
    assert text.count("save s1: rank ") == 4 and " write " in text
    assert "save s1: commit " in text


def test_the_commit_reads_no_pack_table_back(tmp_path, lookups):
    """Each rank sends its packs' entries with its write results: the coordinator indexes every rank's packs
    without reading a table back (on object storage, one request per pack: thousands per save at scale)."""
    stores, state1 = _second_save(tmp_path, 8, lookups, fraction=0.05)
    m = stores[0].read_manifest("s1")
    assert m.stats.new_chunks > 0
    assert all(s.backend.reads["packs"] == 0 for s in stores[1:])  # no rank reads a pack (bases: cached)
    assert stores[0].backend.reads["packs"] == 0
    fresh = Store.open(LocalBackend(tmp_path / "r8"), cache_dir=tmp_path / "fresh-cache")  # index from the packs
    for key, shard in fresh.load("s1").items():
        fqn, offsets = key.split("@")
        row = int(offsets.split(",")[0])
        assert shard.tobytes() == state1[fqn][row:row + shard.shape[0]].numpy().tobytes()


def test_entries_sent_by_ranks_are_parsed_strictly():
    from deltackpt.errors import ManifestFormatError
    from deltackpt.store import decode_entries, encode_entries
    from deltackpt.store.pack import PackEntry

    e = PackEntry(b"\1" * 16, "ab" * 16, 0, 100, 200, 1, 4, None, 0)
    assert decode_entries(encode_entries([e, e])) == [e, e]
    with pytest.raises(ManifestFormatError):
        decode_entries(encode_entries([e])[:-1])
    bad = bytearray(encode_entries([e]))
    bad[16 + 56] = 99  # an unknown codec
    with pytest.raises(ManifestFormatError):
        decode_entries(bytes(bad))


class ListingBackend(CountingBackend):
    def list(self, prefix=""):
        self.reads["list:" + prefix.split("/", 1)[0]] += 1
        return super().list(prefix)


def test_a_rank_whose_cache_indexed_the_parent_lists_no_packs(tmp_path, lookups):
    """A rank opening its index for a save (a new Store, as DeltaStorageWriter(path) does each save) lists
    every pack only when its cache has not itself indexed the parent's commit: with one cache per host the
    coordinator's commit keeps it current (ranks x packs listed per save before)."""
    path = tmp_path / "s"
    Store.init(path, chunk_size_bytes=CHUNK)
    state0 = make_state(STATE_BYTES, rows=512)
    simulate_save([Store.open(LocalBackend(path)) for _ in range(8)], "s0", state0)
    shared = [Store.open(ListingBackend(path)) for _ in range(8)]
    elsewhere = Store.open(ListingBackend(path), cache_dir=tmp_path / "other-host")  # a node-local cache
    state1 = perturb(state0, 0.01)
    simulate_save(shared[:7] + [elsewhere], "s1", state1)
    assert [s.backend.reads["list:packs"] for s in shared[1:7]] == [0] * 6  # the coordinator may list, once
    assert elsewhere.backend.reads["list:packs"] == 1  # a cache that never saw s0's commit catches up
    m = shared[0].read_manifest("s1")
    assert 0 < m.stats.new_chunks <= m.stats.num_chunks // 4  # every rank, the stale one too, deduplicated


def _eight_ranks(path, backend_cls, tmp_path) -> list[Store]:
    """Seven ranks sharing the store's own index cache and one on another host (its own cache)."""
    stores = [Store.open(backend_cls(path)) for _ in range(7)]
    return stores + [Store.open(backend_cls(path), cache_dir=tmp_path / "other-host")]


def test_a_node_local_cache_catches_up_before_every_save(tmp_path, lookups):
    """A rank on another host (its own index cache) that holds its Store across saves learns of the packs
    committed since its last save: a chunk it wrote in s1 is not stored again in s2."""
    path = tmp_path / "s"
    Store.init(path, chunk_size_bytes=CHUNK)
    stores = _eight_ranks(path, LocalBackend, tmp_path)
    state0 = make_state(STATE_BYTES, rows=512)
    simulate_save(stores, "s0", state0)
    state1 = perturb(state0, 0.05)
    simulate_save(stores, "s1", state1)
    assert stores[0].read_manifest("s1").stats.new_chunks > 0
    simulate_save(stores, "s2", state1)  # nothing changed
    assert stores[0].read_manifest("s2").stats.new_chunks == 0


def test_a_rank_on_another_host_catches_up_from_the_commit_record(tmp_path, lookups):
    """A rank whose cache is its own (another host) and missed the coordinator's last commit reads that
    commit's record, not a listing of every pack (a request per 1,000 packs on object storage, at every save
    on every host but the coordinator's), and still stores nothing the other ranks wrote before."""
    path = tmp_path / "s"
    Store.init(path, chunk_size_bytes=CHUNK)
    stores = [Store.open(ListingBackend(path)) for _ in range(7)]
    stores.append(Store.open(ListingBackend(path), cache_dir=tmp_path / "other-host"))
    state = make_state(STATE_BYTES, rows=512)
    simulate_save(stores, "s0", state)
    simulate_save(stores, "s1", perturb(state, 0.05))  # the other host's cache saw no commit yet: it lists
    other = stores[-1].backend
    assert other.reads["list:packs"] == 1
    for name, fraction in (("s2", 0.05), ("s3", 0.0)):
        state = perturb(state, fraction) if fraction else state
        reads, pack_reads = other.reads["commits"], other.reads["packs"]
        simulate_save(stores, name, state)
        assert other.reads["list:packs"] == 1 and other.reads["commits"] == reads + 1
    assert other.reads["packs"] == pack_reads  # nothing changed in s3: the new packs' tables were in the record
    assert stores[0].read_manifest("s3").stats.new_chunks == 0


def test_a_first_save_lists_no_packs(tmp_path, lookups):
    """A first save (a store without checkpoints) has nothing to deduplicate against, and the packs other
    ranks are writing meanwhile are never needed: no rank lists the store's packs (in one process, ranks one
    after another, rank r listed and indexed the r packs written before it: O(ranks^2) per first save)."""
    path = tmp_path / "s"
    Store.init(path, chunk_size_bytes=CHUNK)
    stores = _eight_ranks(path, ListingBackend, tmp_path)
    state0 = make_state(STATE_BYTES, rows=512)
    simulate_save(stores, "s0", state0)
    assert [s.backend.reads["list:packs"] for s in stores] == [0] * 8
    fresh = Store.open(LocalBackend(path), cache_dir=tmp_path / "fresh-cache")  # index from the packs
    for key, shard in fresh.load("s0").items():
        fqn, offsets = key.split("@")
        row = int(offsets.split(",")[0])
        assert shard.tobytes() == state0[fqn][row:row + shard.shape[0]].numpy().tobytes()


def test_ranks_catch_up_to_the_newest_checkpoint_even_when_it_is_overwritten(tmp_path, lookups):
    """The commit every rank's cache catches up to is the store's newest, not the save's parent: overwriting
    the only checkpoint (no parent), a rank with a cache that never saw it still deduplicates against it."""
    path = tmp_path / "s"
    Store.init(path, chunk_size_bytes=CHUNK)
    state0 = make_state(STATE_BYTES, rows=512)
    simulate_save([Store.open(LocalBackend(path)) for _ in range(8)], "s0", state0)
    stores = _eight_ranks(path, ListingBackend, tmp_path)
    simulate_save(stores, "s0", state0, overwrite=True)
    m = stores[0].read_manifest("s0")
    assert m.parent is None and m.stats.new_chunks == 0
    assert [s.backend.reads["list:packs"] for s in stores] == [0] * 7 + [1]
