"""The format gate: a reader refuses a store that uses a feature it lacks, and never reports it as damage."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deltackpt import cli
from deltackpt.errors import UnsupportedFormatError
from deltackpt.store import Store
from deltackpt.store import config as config_mod
from deltackpt.store.config import NEW_STORE_MAX_CHAIN, WRITER_FEATURES, decode_config


def _data(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(50_000).astype(np.float32), "b": b"x" * 1000}


def _config(path) -> dict:
    return json.loads((path / "config").read_bytes())


def test_new_store_lists_the_writer_features(tmp_path):
    Store.init(tmp_path / "s")
    cfg = _config(tmp_path / "s")
    assert cfg["format_version"] == 2
    assert cfg["features"] == sorted(WRITER_FEATURES + ("delta-chains",))  # new stores chain deltas
    assert cfg["max_chain"] == NEW_STORE_MAX_CHAIN


def test_unknown_feature_is_refused_by_name(tmp_path):
    s = Store.init(tmp_path / "s")
    s.save("a", _data(0))
    cfg = _config(tmp_path / "s")
    cfg["features"] = sorted(cfg["features"] + ["chained-deltas-v9"])
    (tmp_path / "s" / "config").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedFormatError, match="chained-deltas-v9"):
        Store.open(tmp_path / "s")


def test_older_reader_lacking_a_feature_refuses_instead_of_reporting_damage(tmp_path, monkeypatch, capsys):
    s = Store.init(tmp_path / "s")
    s.save("a", _data(0))
    s.save("b", {"w": _data(0)["w"] * 0, "b": b"x" * 1000})  # zero planes: the sparse feature in use
    # A reader built before zero-sparse planes: it knows only the plane container.
    monkeypatch.setattr(config_mod, "SUPPORTED_FEATURES", {"plane-container": "..."})
    with pytest.raises(UnsupportedFormatError, match="zero-sparse-planes"):
        Store.open(tmp_path / "s")
    code = cli.main(["verify", str(tmp_path / "s"), "--level", "2"])
    err = capsys.readouterr().err
    assert code == 3, "refused (deltackpt error), not 'problems found'"
    assert "zero-sparse-planes" in err and "upgrade" in err


def test_version_1_store_gains_features_on_first_write(tmp_path):
    # A store as the previous release wrote it: format 1, no features field.
    s = Store.init(tmp_path / "s", features=(), format_version=1, max_chain=1)
    raw = _config(tmp_path / "s")
    assert raw["format_version"] == 1 and "features" not in raw
    reopened = Store.open(tmp_path / "s")
    assert reopened.config.features == ()
    reopened.save("a", _data(1))  # this code's writer records what it may write before writing it
    raw = _config(tmp_path / "s")
    assert raw["format_version"] == 2 and raw["features"] == sorted(WRITER_FEATURES)
    assert raw["store_id"] == s.config.store_id
    np.testing.assert_array_equal(Store.open(tmp_path / "s").load("a")["w"], _data(1)["w"])


def test_version_1_reader_refuses_an_upgraded_config(tmp_path, monkeypatch):
    Store.init(tmp_path / "s")
    # The previous release: FORMAT_VERSION 1, so it refuses on the version before looking at any field.
    monkeypatch.setattr(config_mod, "FORMAT_VERSION", 1)
    with pytest.raises(UnsupportedFormatError, match="newer"):
        decode_config((tmp_path / "s" / "config").read_bytes())


@pytest.mark.parametrize("features", [["zero-sparse-planes", "plane-container"], ["a", "a"], "plane-container"])
def test_malformed_feature_lists_are_format_errors(tmp_path, features):
    from deltackpt.errors import ManifestFormatError
    Store.init(tmp_path / "s")
    cfg = _config(tmp_path / "s")
    cfg["features"] = features
    (tmp_path / "s" / "config").write_text(json.dumps(cfg))
    with pytest.raises((ManifestFormatError, UnsupportedFormatError)):
        Store.open(tmp_path / "s")



def _ulp_moves(seed: int) -> tuple[np.ndarray, np.ndarray]:
    w = (np.random.default_rng(seed).standard_normal(50_000) * 0.05).astype(np.float32)
    return w, (w.view(np.uint32) + np.uint32(1)).view(np.float32)  # one unit in the last place: a zdelta


def _zdelta_store(location) -> Store:
    from deltackpt.store import codec

    s = Store.init(location, chunk_size_bytes=16384, features=("plane-container", "zero-sparse-planes"))
    w0, w1 = _ulp_moves(2)
    s.save("a", {"w": w0})
    s.save("b", {"w": w1})
    assert codec.ZDELTA in {s.index.lookup(r.id).codec for r in s.read_manifest("b").item_map()["w"].chunks}
    return s


def test_reader_without_zigzag_delta_refuses_a_store_that_may_hold_zdelta_chunks(tmp_path, monkeypatch):
    _zdelta_store(tmp_path / "s")
    # A 0.2 reader from before the zigzag difference: the plane container and zero-sparse planes only.
    monkeypatch.setattr(config_mod, "SUPPORTED_FEATURES",
                        {k: v for k, v in config_mod.SUPPORTED_FEATURES.items() if k != "zigzag-delta"})
    with pytest.raises(UnsupportedFormatError, match="zigzag-delta"):
        Store.open(tmp_path / "s")


def test_store_without_zigzag_delta_gains_it_before_the_first_pack_is_written():
    """A store created by a writer that predates the feature lists it in its config before this code writes
    any pack, so no reader lacking it ever meets a zdelta chunk."""
    from deltackpt.store import MemoryBackend

    backend = MemoryBackend()
    puts = []
    real_put = backend.put
    backend.put = lambda key, data, *a, **k: (puts.append(key), real_put(key, data, *a, **k))[1]
    store = _zdelta_store(backend)
    first_pack = next(i for i, key in enumerate(puts) if key.startswith("packs/"))
    assert "config" in puts[1:first_pack]  # puts[0]: the config Store.init wrote, without the feature
    assert "zigzag-delta" in store.config.features
    assert "zigzag-delta" in json.loads(backend.get("config"))["features"]
    np.testing.assert_array_equal(Store.open(backend).load("b")["w"], _ulp_moves(2)[1])


def test_two_processes_adding_features_at_once_keep_both(tmp_path):
    """ensure_features reads, adds and writes the config with no compare-and-swap: a save's writer upgrading a
    store written by 0.1 while a copy into it adds ``delta-chains`` lost one of the two. It now reads again
    after its write until the stored config lists its features (features are only ever added)."""
    import threading

    import msgspec

    from deltackpt.store.config import CHAINS_FEATURE, CONFIG_KEY, encode_config, new_config
    from deltackpt.store.localbackend import LocalBackend

    root = tmp_path / "s"
    cfg = msgspec.structs.replace(new_config(max_chain=1, features=()), format_version=1)
    LocalBackend(root).put(CONFIG_KEY, encode_config(cfg))
    saver, copier = Store.open(root), Store.open(root)
    both_read = threading.Barrier(2)
    for store in (saver, copier):
        def get(key, real_get=store.backend.get, first=[True]):
            data = real_get(key)
            if key == CONFIG_KEY and first[0]:
                first[0] = False
                both_read.wait(5)  # both have read the old config before either writes
            return data
        store.backend.get = get
    threads = [threading.Thread(target=saver.ensure_features),
               threading.Thread(target=lambda: copier.ensure_features([CHAINS_FEATURE]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    features = set(Store.open(root).config.features)
    assert CHAINS_FEATURE in features and set(WRITER_FEATURES) <= features
