"""dcp.load of a checkpoint holding delta chunks: bit-exact into contiguous destinations (decoded in place)
and into strided ones (copied), and damage in a delta's base reported with both chunk ids."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import deltackpt
from deltackpt.errors import CorruptChunkError
from deltackpt.store import Store, codec
from deltackpt.store.pack import HEADER_SIZE, pack_key

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _states():
    g = torch.Generator().manual_seed(0)
    first = {f"w{i}": torch.randn(96, 1024, generator=g) * 0.05 for i in range(4)}
    first["h"] = torch.randn(70_000, generator=g).to(torch.bfloat16)
    changed = {k: v.clone() for k, v in first.items()}
    for k in ("w0", "w2", "h"):
        changed[k] += (torch.randn(changed[k].shape, generator=g) * 1e-5).to(changed[k].dtype)
    return first, changed


@pytest.fixture
def delta_store(tmp_path):
    path = tmp_path / "store"
    Store.init(path, chunk_size_bytes=65536)
    first, changed = _states()
    dcp.save(first, storage_writer=deltackpt.DeltaStorageWriter(str(path), "c0"))
    dcp.save(changed, storage_writer=deltackpt.DeltaStorageWriter(str(path), "c1"))
    store = Store.open(str(path))
    manifest = store.read_manifest("c1")
    deltas = [(it.key, ref) for it in manifest.items for ref in it.chunks
              if codec.is_delta(store.index.lookup(ref.id).codec)]
    assert deltas, "the changed tensors should be stored as deltas"
    return str(path), store, changed, deltas


@pytest.mark.parametrize("num_threads", [1, 4])
def test_load_with_deltas_is_bit_exact(delta_store, num_threads):
    path, _store, changed, _ = delta_store
    contiguous = {k: torch.full_like(v, -1) for k, v in changed.items()}
    dcp.load(contiguous, storage_reader=deltackpt.DeltaStorageReader(path, "c1", num_threads=num_threads))
    # Strided destinations (a transposed buffer) take the read-and-copy path.
    strided = {k: (torch.zeros(v.shape[::-1], dtype=v.dtype).t() if v.dim() == 2 else torch.zeros_like(v))
               for k, v in changed.items()}
    assert not strided["w0"].is_contiguous()
    dcp.load(strided, storage_reader=deltackpt.DeltaStorageReader(path, "c1", num_threads=num_threads))
    for k, v in changed.items():
        assert torch.equal(contiguous[k], v), k
        assert torch.equal(strided[k], v), k


def test_damaged_delta_base_fails_the_load_naming_both_chunks(delta_store):
    path, store, changed, deltas = delta_store
    key, ref = deltas[0]
    entry = store.index.lookup(ref.id)
    base = store.index.lookup(entry.base_id)
    target = store.backend.root / pack_key(base.pack)
    data = bytearray(target.read_bytes())
    data[base.offset + HEADER_SIZE + base.stored_len // 2] ^= 0x10
    target.write_bytes(bytes(data))

    sd = {k: torch.zeros_like(v) for k, v in changed.items()}
    with pytest.raises((CorruptChunkError, CheckpointException)) as ei:
        dcp.load(sd, storage_reader=deltackpt.DeltaStorageReader(path, "c1"))
    err = ei.value
    if isinstance(err, CheckpointException):
        (err,) = [e for e, _tb in err.failures.values()]
    assert isinstance(err, CorruptChunkError), repr(err)
    assert err.chunk_id == ref.id.hex() and err.base_chunk_id == entry.base_id.hex()
    assert err.pack == entry.pack and err.checkpoint == "c1" and err.item == key


def test_collector_is_paused_while_reading_and_writing_data(delta_store, tmp_path, monkeypatch):
    """read_data / write_data / finish pause the cyclic GC (a full collection mid-load would scan the whole
    process) and resume it afterwards."""
    import gc

    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    path, _store, changed, _ = delta_store
    seen = []

    class Load(DefaultLoadPlanner):
        def commit_tensor(self, read_item, tensor):
            seen.append(("load", gc.isenabled()))
            super().commit_tensor(read_item, tensor)

    class Save(DefaultSavePlanner):
        def resolve_data(self, write_item):
            seen.append(("save", gc.isenabled()))
            return super().resolve_data(write_item)

    from deltackpt.store.repository import Store

    real_commit = Store.commit

    def commit(self, *a, **k):  # the coordinator's finish: every rank's items, manifest and metadata
        seen.append(("commit", gc.isenabled()))
        return real_commit(self, *a, **k)

    monkeypatch.setattr(Store, "commit", commit)
    assert gc.isenabled()
    sd = {k: torch.zeros_like(v) for k, v in changed.items()}
    dcp.load(sd, storage_reader=deltackpt.DeltaStorageReader(path, "c1"), planner=Load())
    dcp.save(changed, storage_writer=deltackpt.DeltaStorageWriter(path, "c2"), planner=Save())
    assert {k for k, _ in seen} == {"load", "save", "commit"}
    assert not any(enabled for _, enabled in seen), seen
    assert gc.isenabled()
    assert all(torch.equal(sd[k], v) for k, v in changed.items())


def test_read_jobs_are_batched_largest_first():
    from deltackpt.dcp.reader import _batches

    work = [(n, None, i) for i, n in enumerate([10, 20, 500, 30, 40, 50, 7])]
    batches = _batches(work, 60)
    assert [[j[2] for j in b] for b in batches] == [[2], [4, 5], [0, 1, 3], [6]]  # 500, 90, 60, 7 bytes
    assert sorted(j[2] for b in batches for j in b) == list(range(7)), "every job runs exactly once"
    assert _batches([], 60) == []


def test_load_of_many_small_and_some_large_tensors_is_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(3)
    sd = {f"b{i}": torch.randn(int(torch.randint(1, 5000, (1,), generator=g)), generator=g) for i in range(150)}
    sd.update({f"w{i}": torch.randn(300, 1000, generator=g) for i in range(3)})
    sd["h"] = torch.randn(999, generator=g).to(torch.bfloat16)
    Store.init(tmp_path / "s", chunk_size_bytes=65536)
    dcp.save(sd, storage_writer=deltackpt.DeltaStorageWriter(str(tmp_path / "s"), "c0"))
    out = {k: torch.full_like(v, 7) for k, v in sd.items()}
    dcp.load(out, storage_reader=deltackpt.DeltaStorageReader(str(tmp_path / "s"), "c0", num_threads=3))
    assert all(torch.equal(out[k], v) for k, v in sd.items())
