"""DeltaStorageWriter / DeltaStorageReader through DCP in one process, without a process group.

Covers: a module + Adam state round trip (bit-exact, and training continues identically), non-tensor values,
unusual dtypes and layouts, the ``checkpoint_id=`` (reset) path, missing names, ``latest``, older
checkpoints after newer saves, duplicate names, the store argument kinds, and pickling of the adapters.
"""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import deltackpt
from deltackpt import CheckpointExistsError, CheckpointNotFoundError, StoreNotFoundError
from deltackpt.store import MemoryBackend, Store
from dist import assert_tree_equal, full_tree

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(300),
    # DCP warns that it runs without a process group; that is the point of this module.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

VOCAB, DIM = 50, 64


class TinyNet(nn.Module):
    def __init__(self, d: int = DIM, vocab: int = VOCAB):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.block(h))


def make(seed: int, lr: float = 1e-2):
    torch.manual_seed(seed)
    model = TinyNet()
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def train_step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (8, 6), generator=g)
    y = torch.randint(0, VOCAB, (8, 6), generator=g)
    loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def state_of(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def load_into(model, opt, reader) -> None:
    sd = state_of(model, opt)
    dcp.load(sd, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def placeholder(tree):
    """Same structure; tensors zeroed (same dtype, shape and strides), other leaves None."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: placeholder(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [placeholder(v) for v in tree]
    return None


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "store"
    Store.init(path, chunk_size_bytes=65536)
    return str(path)


# --------------------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------------------
def test_module_and_adam_roundtrip_bit_exact(store_path):
    model, opt = make(seed=0)
    train_step(model, opt, seed=1)
    ref = full_tree(state_of(model, opt))
    assert set(ref["optim"]["state"]["head.weight"]) == {"step", "exp_avg", "exp_avg_sq"}

    md = dcp.save(state_of(model, opt), storage_writer=deltackpt.DeltaStorageWriter(store_path, checkpoint_id="step-1"))
    assert isinstance(md, Metadata)

    model2, opt2 = make(seed=123)
    fresh = full_tree(state_of(model2, opt2))
    with pytest.raises(AssertionError):
        assert_tree_equal(fresh["model"], ref["model"])  # the comparison below is not vacuous

    load_into(model2, opt2, deltackpt.DeltaStorageReader(store_path, "step-1"))
    assert assert_tree_equal(full_tree(state_of(model2, opt2)), ref) >= 3 * 8
    # The optimizer really resumed: one more identical step keeps both models bit-identical.
    train_step(model, opt, seed=2)
    train_step(model2, opt2, seed=2)
    assert_tree_equal(full_tree(state_of(model2, opt2)), full_tree(state_of(model, opt)))


def test_non_tensor_values_and_dtypes_roundtrip(store_path):
    torch.manual_seed(0)
    big = torch.randn(100, 16)
    sd = {
        "epoch": 3,
        "name": "run-\u03b1",
        "lr": 0.125,
        "flag": True,
        "none": None,
        "nested": {"a": {"b": [1, 2, {"c": "d"}]}, "tup": (1, "x", 2.5), "ints": [4, 5, 6], "empty": {}},
        "bf16": torch.randn(33, 17).bfloat16(),
        "f16": torch.randn(7, 9).half(),
        "f64": torch.randn(5, 3, dtype=torch.float64),
        "i64": torch.randint(-(2**62), 2**62, (257,), dtype=torch.int64),
        "i32": torch.randint(-(2**31), 2**31 - 1, (31,), dtype=torch.int32),
        "u8": torch.randint(0, 256, (1000,), dtype=torch.uint8),
        "i8": torch.randint(-128, 128, (13,), dtype=torch.int8),
        "bool": torch.rand(99) > 0.5,
        "scalar": torch.tensor(3.25),
        "scalar_i64": torch.tensor(-(2**40), dtype=torch.int64),
        "scalar_bf16": torch.tensor(1.5, dtype=torch.bfloat16),
        "f8": torch.randn(19).to(torch.float8_e4m3fn),  # another dtype numpy lacks
        "empty": torch.empty(0, 5),
        "noncontig": torch.randn(40, 30).t(),
        "view": big[10:20],  # a view into a larger storage: only the view is saved
        "special": torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-45, 3.4e38]),
        "tensors": [torch.randn(3), torch.arange(4)],
        "c64": torch.randn(11, dtype=torch.complex64),
        "conj": torch.randn(6, dtype=torch.complex64).conj(),  # a lazy view: its memory is not its values
    }
    ref = full_tree(sd)
    deltackpt.save(sd, store_path, "mixed")

    dest = placeholder(sd)
    assert dest["noncontig"].stride() == sd["noncontig"].stride()  # loads into a non-contiguous tensor too
    assert deltackpt.load(dest, store_path, "mixed") == "mixed"
    assert_tree_equal(full_tree(dest), ref)
    assert type(dest["nested"]["tup"]) is tuple and dest["name"] == "run-\u03b1"
    assert torch.equal(dest["special"].view(torch.int32), ref["special"].view(torch.int32))  # -0.0, NaN bits

    # The logical size counts each tensor's own bytes, not the storage it is a view of.
    m = Store.open(store_path).read_manifest("mixed")
    tensor_bytes = sum(t.numel() * t.element_size() for t in _tensors(ref))
    assert tensor_bytes <= m.stats.logical_bytes < tensor_bytes + 64 * 1024, (m.stats, tensor_bytes)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def test_checkpoint_id_through_dcp_reset(store_path):
    """dcp.save(..., checkpoint_id=X) calls writer.reset(X); one writer and one reader serve several names."""
    writer = deltackpt.DeltaStorageWriter(store_path)
    refs = {}
    for i, name in enumerate(["c-1", "c-2", "c-3"]):
        torch.manual_seed(i)
        sd = {"w": torch.randn(64, 64), "step": i}
        refs[name] = full_tree(sd)
        dcp.save(sd, storage_writer=writer, checkpoint_id=name)
    assert [c.name for c in Store.open(store_path).list_checkpoints()] == ["c-1", "c-2", "c-3"]
    reader = deltackpt.DeltaStorageReader(store_path)  # resolves "latest" = c-3; reset() re-resolves
    for name in ["c-2", "c-1", "c-3"]:
        dest = {"w": torch.zeros(64, 64), "step": None}
        dcp.load(dest, storage_reader=reader, checkpoint_id=name)
        assert_tree_equal(dest, refs[name])


def test_missing_checkpoint_raises_not_found(store_path, tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        deltackpt.DeltaStorageReader(store_path)  # "latest" of an empty store
    deltackpt.save({"w": torch.ones(3)}, store_path, "real")
    with pytest.raises(CheckpointNotFoundError):
        deltackpt.DeltaStorageReader(store_path, "nope")
    with pytest.raises(CheckpointNotFoundError):
        deltackpt.load({"w": torch.zeros(3)}, store_path, "nope")
    with pytest.raises((CheckpointNotFoundError, CheckpointException)) as ei:
        dcp.load({"w": torch.zeros(3)}, storage_reader=deltackpt.DeltaStorageReader(store_path), checkpoint_id="nope")
    _assert_caused_by(ei.value, CheckpointNotFoundError)
    # A path that holds no store is not silently turned into one by a reader.
    with pytest.raises(StoreNotFoundError):
        deltackpt.DeltaStorageReader(str(tmp_path / "no-store-here"))


def _assert_caused_by(exc: BaseException, kind: type) -> None:
    if isinstance(exc, CheckpointException):
        causes = [e for e, _tb in exc.failures.values()]
        assert causes and all(isinstance(e, kind) for e in causes), exc.failures
    else:
        assert isinstance(exc, kind), repr(exc)


def test_latest_and_older_checkpoints_after_newer_saves(store_path):
    model, opt = make(seed=0)
    refs = {}
    for step in range(1, 4):
        train_step(model, opt, seed=step)
        name = f"step-{step}"
        refs[name] = full_tree(state_of(model, opt))
        md = deltackpt.save(state_of(model, opt), store_path, name, metadata={"step": step})
        assert isinstance(md, Metadata)
    store = Store.open(store_path)
    assert [c.name for c in store.list_checkpoints()] == ["step-1", "step-2", "step-3"]
    assert store.read_manifest("step-2").metadata == {"step": 2}

    m2, o2 = make(seed=99)
    assert deltackpt.load(state_of(m2, o2), store_path) == "step-3"  # default: latest
    load_into(m2, o2, deltackpt.DeltaStorageReader(store_path))  # reader default: latest
    assert_tree_equal(full_tree(state_of(m2, o2)), refs["step-3"])
    load_into(m2, o2, deltackpt.DeltaStorageReader(store_path, "latest"))
    assert_tree_equal(full_tree(state_of(m2, o2)), refs["step-3"])
    for name in ["step-1", "step-2"]:
        m, o = make(seed=7)
        load_into(m, o, deltackpt.DeltaStorageReader(store_path, name))
        assert_tree_equal(full_tree(state_of(m, o)), refs[name])
    with pytest.raises(AssertionError):
        assert_tree_equal(refs["step-1"]["model"], refs["step-2"]["model"])


def test_duplicate_name_fails_and_keeps_old_checkpoint(store_path):
    old = {"w": torch.arange(1000, dtype=torch.float32), "tag": "old"}
    new = {"w": -torch.arange(1000, dtype=torch.float32), "tag": "new"}
    dcp.save(old, storage_writer=deltackpt.DeltaStorageWriter(store_path, "dup"))
    with pytest.raises((CheckpointExistsError, CheckpointException)) as ei:
        dcp.save(new, storage_writer=deltackpt.DeltaStorageWriter(store_path, "dup"))
    _assert_caused_by(ei.value, CheckpointExistsError)
    with pytest.raises((CheckpointExistsError, CheckpointException)):
        deltackpt.save(new, store_path, "dup")
    with pytest.raises((CheckpointExistsError, CheckpointException)):
        dcp.save(new, storage_writer=deltackpt.DeltaStorageWriter(store_path), checkpoint_id="dup")
    dest = {"w": torch.zeros(1000), "tag": None}
    deltackpt.load(dest, store_path, "dup")
    assert_tree_equal(dest, full_tree(old))
    assert [c.name for c in Store.open(store_path).list_checkpoints()] == ["dup"]

    # overwrite=True replaces it.
    dcp.save(new, storage_writer=deltackpt.DeltaStorageWriter(store_path, "dup", overwrite=True))
    deltackpt.load(dest, store_path, "dup")
    assert_tree_equal(dest, full_tree(new))
    assert [c.name for c in Store.open(store_path).list_checkpoints()] == ["dup"]


def test_store_argument_kinds(tmp_path):
    sd = {"w": torch.randn(300, 50), "n": 5}
    ref = full_tree(sd)
    # A missing directory becomes a store.
    path = tmp_path / "created"
    deltackpt.save(sd, path, "a")
    assert [c.name for c in Store.open(path).list_checkpoints()] == ["a"]
    # A Store object.
    store = Store.init(tmp_path / "s2", chunk_size_bytes=65536)
    dcp.save(sd, storage_writer=deltackpt.DeltaStorageWriter(store, "b"))
    dest = placeholder(sd)
    dcp.load(dest, storage_reader=deltackpt.DeltaStorageReader(store, "b"))
    assert_tree_equal(dest, ref)
    # A Backend (in memory).
    backend = MemoryBackend()
    dcp.save(sd, storage_writer=deltackpt.DeltaStorageWriter(backend, "c"))
    dest = placeholder(sd)
    dcp.load(dest, storage_reader=deltackpt.DeltaStorageReader(backend, "c"))
    assert_tree_equal(dest, ref)


# --------------------------------------------------------------------------------------------------------
# pickling (dcp.async_save with PROCESS pickles the writer on every call)
# --------------------------------------------------------------------------------------------------------
def test_writer_and_reader_pickle(store_path):
    w = deltackpt.DeltaStorageWriter(store_path, "x", overwrite=True, metadata={"k": 1})
    w2 = pickle.loads(pickle.dumps(w))
    assert w2.checkpoint_id == "x"
    sd = {"w": torch.randn(200, 100), "s": "hello"}
    dcp.save(sd, storage_writer=w2)

    # A writer that has been used (its store is open, maybe an index handle) still pickles, and works again.
    dcp.save(sd, storage_writer=w)
    w3 = pickle.loads(pickle.dumps(w))
    dcp.save({"w": torch.ones(3)}, storage_writer=w3, checkpoint_id="y")

    r = deltackpt.DeltaStorageReader(store_path, "x")
    r2 = pickle.loads(pickle.dumps(r))
    dest = {"w": torch.zeros(200, 100), "s": None}
    dcp.load(dest, storage_reader=r2)
    assert_tree_equal(dest, full_tree(sd))
    dcp.load(dest, storage_reader=r)  # a used reader pickles too
    r3 = pickle.loads(pickle.dumps(r))
    dest3 = {"w": torch.zeros(3)}
    dcp.load(dest3, storage_reader=r3, checkpoint_id="y")
    assert torch.equal(dest3["w"], torch.ones(3))


# --------------------------------------------------------------------------------------------------------
# one rank: the parent's map stays whole in the process
# --------------------------------------------------------------------------------------------------------
def _fine_tune_of(base: dict) -> dict:
    """The base renamed (a ``model.`` prefix), ``w`` changed by one ulp in a few elements, and an adapter."""
    w = base["w"].clone()
    w.view(-1).view(torch.int32)[::4096] += 1  # in every 64 KiB chunk
    return {"model.w": w, "model.b": base["b"].clone(), "lora": torch.randn(8, 256)}


def _delta_coded(store: Store, name: str, key: str) -> bool:
    from deltackpt.store.codec import DELTA_CODECS

    item = next(it for it in store.read_manifest(name).items if it.key == key)
    return all(store.index.lookup(ref.id).codec in DELTA_CODECS for ref in item.chunks)


def test_one_rank_save_uses_the_whole_parent_map_without_encoding_it(store_path, monkeypatch):
    """A one-rank save keeps the coordinator's parent map (no encoded part in the plan) and still finds the
    base under the renamed keys: the changed tensor is a delta of the base's chunks, the rest is reused."""
    torch.manual_seed(0)
    base = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    store = Store.open(store_path)
    dcp.save(base, storage_writer=deltackpt.DeltaStorageWriter(store, "base"), planner=deltackpt.DeltaSavePlanner())

    def no_encoding(self, ranges):
        raise AssertionError("a one-rank save encoded a part of its parent's map")

    monkeypatch.setattr(deltackpt.store.ParentMap, "encode_part", no_encoding)
    ft = _fine_tune_of(base)
    dcp.save(ft, storage_writer=deltackpt.DeltaStorageWriter(store, "ft"), planner=deltackpt.DeltaSavePlanner())
    assert _delta_coded(store, "ft", "model.w@0,0")
    m = store.read_manifest("ft")
    assert m.stats.stored_bytes < ft["model.w"].nbytes // 4  # deltas and an adapter, not the base again
    assert_tree_equal(ft, _loaded(store, "ft", ft))


def test_one_rank_plan_written_by_another_writer_reads_the_parent(store_path):
    """A one-rank plan that another writer object planned (so it has no parent map of its own) reads the
    parent's manifest itself: the changed tensor is still a delta."""

    torch.manual_seed(1)
    base = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    store = Store.open(store_path)
    dcp.save(base, storage_writer=deltackpt.DeltaStorageWriter(store, "base"), planner=deltackpt.DeltaSavePlanner())
    ft = _fine_tune_of(base)
    planner = deltackpt.DeltaSavePlanner()
    planner.set_up_planner(ft, is_coordinator=True)
    coordinator, rank = deltackpt.DeltaStorageWriter(store, "ft"), deltackpt.DeltaStorageWriter(store, "ft")
    coordinator.set_up_storage_writer(True)
    rank.set_up_storage_writer(False)
    plans, md = planner.create_global_plan([coordinator.prepare_local_plan(planner.create_local_plan())])
    plan = planner.finish_plan(coordinator.prepare_global_plan(plans)[0])
    results = rank.write_data(plan, planner).value()
    coordinator.finish(md, [results])
    assert _delta_coded(store, "ft", "model.w@0,0")
    assert_tree_equal(ft, _loaded(store, "ft", ft))


def _loaded(store: Store, name: str, like: dict) -> dict:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, storage_reader=deltackpt.DeltaStorageReader(store, name))
    return out


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_a_sparse_tensor_is_refused_naming_it(store_path, layout):
    value = torch.eye(3).to_sparse() if layout == "sparse_coo" else torch.eye(3).to_sparse_csr()
    with pytest.raises(TypeError, match=f"'sp.*a {layout} tensor has no plain bytes"):
        deltackpt.save({"sp": value, "w": torch.ones(2)}, store_path, "a")
    assert not Store.open(store_path).exists("a")


def test_a_quantized_tensor_is_refused_naming_it(store_path):
    """Its bytes alone (the int8 values) would restore without its scale and zero point."""
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="'q@0'.*quantized tensor's bytes lose its scale"):
        deltackpt.save({"q": q, "w": torch.ones(2)}, store_path, "a")
    assert not Store.open(store_path).exists("a")


RAN: list = []


def _ran():
    RAN.append(1)
    return "ran"


class _Code:
    """Unpickles as a call: proof of execution if it ever runs."""

    def __reduce__(self):
        return (_ran, ())


def test_load_unpickles_plain_data_only_unless_the_caller_trusts_the_store(store_path):
    """DCP's own load planner unpickles values with weights_only=False: a checkpoint imported or copied in
    from elsewhere could run code in every process that restores it."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from deltackpt.errors import UnsafeSourceError

    import io

    deltackpt.save({"w": torch.ones(3), "code": _Code(), "plain": {"lr": 0.5, "names": ["a"]},
                    "blob": io.BytesIO(b"raw bytes")}, store_path, "c")
    RAN.clear()
    with pytest.raises(UnsafeSourceError, match="'code' needs unpickling beyond plain data"):
        deltackpt.load({"w": torch.zeros(3), "code": None}, store_path, "c")
    assert RAN == []
    target = {"w": torch.zeros(3), "plain": {"lr": 0.0, "names": None}, "blob": io.BytesIO()}
    deltackpt.load(target, store_path, "c")
    assert target["plain"] == {"lr": 0.5, "names": ["a"]} and torch.equal(target["w"], torch.ones(3))
    assert target["blob"].getvalue() == b"raw bytes"  # DCP pickles a BytesIO value: plain bytes, allowed
    target = {"code": None}
    deltackpt.load(target, store_path, "c", planner=DefaultLoadPlanner())  # the caller's explicit trust
    assert target["code"] == "ran" and RAN == [1]


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_load_into_a_conjugate_or_negative_view_writes_its_values(store_path, view):
    """Such a view is contiguous, but its memory does not hold its values: raw bytes into it failed (torch
    refuses the uint8 view) where DCP's own reader loads through copy_."""
    src = {"c": torch.tensor([1 + 2j, 3 - 4j, 5 + 6j], dtype=torch.complex64)}
    deltackpt.save(src, store_path, "c")
    zeros = torch.zeros(3, dtype=torch.complex64)
    target = {"c": zeros.conj() if view == "conj" else torch._neg_view(zeros)}
    deltackpt.load(target, store_path, "c")
    assert torch.equal(target["c"].resolve_conj().resolve_neg(), src["c"])


def test_a_save_is_made_after_the_newest_checkpoint_whatever_this_hosts_clock_says(tmp_path, monkeypatch):
    """The newest checkpoint was made by a host whose clock ran 2 minutes ahead: a DCP save here still sorts
    after it (resume and retention follow that order)."""
    import time as real_time
    import types

    import numpy as np

    from deltackpt import DeltaSavePlanner, DeltaStorageWriter
    from deltackpt.store import commit as commit_mod

    store = Store.init(tmp_path / "s")
    monkeypatch.setattr(commit_mod, "time", types.SimpleNamespace(time_ns=lambda: real_time.time_ns() + 120 * 10**9))
    store.save("ahead", {"w": np.zeros(10, np.float32)})
    monkeypatch.undo()
    dcp.save({"w": torch.ones(10)}, storage_writer=DeltaStorageWriter(str(tmp_path / "s"), "here"),
             planner=DeltaSavePlanner())
    infos = Store.open(tmp_path / "s").list_checkpoints()
    assert [i.name for i in infos] == ["ahead", "here"] and infos[1].created_ns > infos[0].created_ns


@pytest.fixture
def _dcp_plan_cache():
    from torch.distributed.checkpoint.planner import SavePlanner

    caches = (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
              SavePlanner._cached_metadata, SavePlanner._cached_final_save_plan)
    for c in caches:
        c.clear()
    yield
    for c in caches:
        c.clear()


def test_plan_caching_is_refused_with_a_clear_error_never_a_stale_parent(tmp_path, _dcp_plan_cache):
    """DCP's enable_plan_caching sends empty plans from the second save on, and each rank would reuse the first
    save's final plan (its parent, head and time floor); the second save crashed with an AttributeError."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from deltackpt import DeltaSavePlanner, DeltaStorageWriter

    with pytest.raises(ValueError, match="enable_plan_caching"):
        DeltaSavePlanner(enable_plan_caching=True)
    path = str(tmp_path / "s")
    w = torch.randn(64, 64)
    dcp.save({"w": w}, storage_writer=DeltaStorageWriter(path, "s0"),
             planner=DefaultSavePlanner(enable_plan_caching=True))
    with pytest.raises(CheckpointException, match="enable_plan_caching"):
        dcp.save({"w": w + 1}, storage_writer=DeltaStorageWriter(path, "s1"),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
    assert [i.name for i in Store.open(path).list_checkpoints()] == ["s0"]
