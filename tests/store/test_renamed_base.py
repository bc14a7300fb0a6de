"""A fine-tune's first checkpoint against a base already in the store: the base's bytes are reused even when
the fine-tune renames its tensors (a wrapper's prefixes, LoRA's ``base_layer``) and shards them differently,
and a checkpoint that holds them as slices passes them on to the next one."""

from __future__ import annotations


import numpy as np
import pytest

from deltackpt.store import codec
from deltackpt.store.parentmap import _rename_key, renamed_from

from store_helpers import SMALL, random_array

CHUNK = SMALL["chunk_size_bytes"]


def _known(*names):
    by_key = {}
    for name in names:
        parts = name.split(".")
        by_key.setdefault(_rename_key(parts), []).append((parts, name))
    return by_key


BASE = _known("model.layers.0.q.weight", "model.layers.0.k.weight", "model.layers.1.q.weight",
              "model.layers.0.q.bias", "model.norm.weight", "model.layers.0.norm.weight")


@pytest.mark.parametrize("new, old", [
    ("model.layers.0.q.base_layer.weight", "model.layers.0.q.weight"),  # LoRA wrapper
    ("model.base_model.model.layers.1.q.weight", "model.layers.1.q.weight"),  # prefixes
    ("model._orig_mod.layers.0.k.weight", "model.layers.0.k.weight"),
    ("model.layers.0.q.base_layer.bias", "model.layers.0.q.bias"),
    ("layers.0.q.weight", "model.layers.0.q.weight"),  # a dropped prefix
])
def test_a_wrapped_name_finds_the_base_name(new, old):
    assert renamed_from(new, BASE) == old


@pytest.mark.parametrize("new", [
    "model.layers.2.q.base_layer.weight",  # another layer
    "model.layers.0.v.weight",  # another projection
    "model.layers.0.q.weight.exp_avg",  # another leaf (optimizer state)
    "model.layers.0.weight",  # ambiguous: q, k and norm weights of layer 0 all contain it
])
def test_no_or_ambiguous_match_is_no_answer(new):
    assert renamed_from(new, BASE) is None


def _save(store, name, tensors, parent=None):
    """Save ``{group: (array, [split element offsets])}``: each group as the shards the splits cut it into."""
    w = store.writer(parent=store.read_manifest(parent) if parent else None)
    for group, (arr, splits) in tensors.items():
        flat = arr.reshape(-1)
        es = arr.dtype.itemsize
        bounds = [0, *splits, flat.size]
        for lo, hi in zip(bounds, bounds[1:]):
            w.add_array(f"{group}@{lo}", np.ascontiguousarray(flat[lo:hi]), dtype=arr.dtype.str, elem_size=es,
                        shape=(hi - lo,), group=group, global_offset=lo * es)
    s = w.finish()
    return store.commit(name, s.items, entries=s.entries, packs=s.packs, parent=parent)


def _assert_loads(store, name, tensors):
    got = store.load(name)
    for group, (arr, splits) in tensors.items():
        parts = [got[k] for k in sorted((k for k in got if k.startswith(group + "@")),
                                        key=lambda k: int(k.rsplit("@", 1)[1]))]
        np.testing.assert_array_equal(np.concatenate(parts), arr.reshape(-1))


def test_renamed_and_resharded_fine_tune_stores_none_of_the_base(store, rng):
    big = random_array(rng, "float32", (10 * CHUNK // 4 + 37,))
    small = random_array(rng, "float32", (CHUNK // 8,))  # half a chunk: every shard of it is a partial chunk
    store_base = {"model.blocks.0.fc.weight": (big, []), "model.blocks.0.fc.bias": (small, [])}
    _save(store, "base", store_base)
    # The fine-tune: LoRA-wrapped names, 3 ranks' shards, both off the chunk grid; plus a new adapter, whose
    # name also contains the base weight's (a wrong guess: its bytes differ, so it is stored).
    adapter = random_array(rng, "float32", (64,))
    ft = {"model.blocks.0.fc.base_layer.weight": (big, [big.size // 3, 2 * big.size // 3]),
          "model.blocks.0.fc.base_layer.bias": (small, [small.size // 3 + 1, 2 * small.size // 3]),
          "model.blocks.0.fc.lora_a.weight": (adapter, [])}
    m1 = _save(store, "ft1", ft, parent="base")
    assert m1.stats.new_chunks == 1  # the adapter only
    assert m1.stats.stored_bytes < adapter.nbytes + 256
    _assert_loads(store, "ft1", ft)
    # The next checkpoint, on the same layout, finds the base's bytes as slices in its parent.
    m2 = _save(store, "ft2", ft, parent="ft1")
    assert m2.stats.new_chunks == 0 and m2.stats.stored_bytes == 0
    _assert_loads(store, "ft2", ft)


def test_a_parent_holding_slices_passes_them_on_unchanged(store, rng):
    # Same names, resharded once: the second save on that layout must not store the straddling halves again.
    arr = random_array(rng, "float32", (8 * CHUNK // 4,))
    _save(store, "whole", {"t": (arr, [])})
    split = [3 * CHUNK // 4 + 100]  # inside chunk 3
    m1 = _save(store, "r1", {"t": (arr, split)}, parent="whole")
    assert m1.stats.new_chunks == 0
    assert {c.skip for it in m1.items for c in it.chunks} == {0, 400}
    m2 = _save(store, "r2", {"t": (arr, split)}, parent="r1")
    assert m2.stats.new_chunks == 0 and m2.stats.stored_bytes == 0
    changed = arr.copy()
    changed[3 * CHUNK // 4] += 1.0  # in shard 0's half of chunk 3
    m3 = _save(store, "r3", {"t": (changed, split)}, parent="r2")
    assert m3.stats.new_chunks == 1  # that half alone; shard 1's half is still a slice
    _assert_loads(store, "r2", {"t": (arr, split)})
    _assert_loads(store, "r3", {"t": (changed, split)})


def test_full_fine_tune_under_new_names_is_delta_coded_against_the_base(make_store, rng):
    store = make_store(chunk_size_bytes=16384)
    w = (rng.standard_normal(8 * 16384 // 4) * 0.05).astype(np.float32)
    _save(store, "base", {"model.layers.0.q.weight": (w, [])})
    tuned = w.copy()
    tuned[::97] += np.float32(1e-4)  # a fine-tune's small changes, spread over every chunk
    before = sum(codec.is_delta(e.codec) for e in store.index.iter_entries())
    _save(store, "ft1", {"model.base_model.layers.0.q.weight": (tuned, [])}, parent="base")
    after = sum(codec.is_delta(e.codec) for e in store.index.iter_entries())
    assert after - before == 8  # every chunk a delta (XOR or zigzag) against the base's
    _assert_loads(store, "ft1", {"model.base_model.layers.0.q.weight": (tuned, [])})
