"""`deltackpt repair`: the command a user is told to run when a store's config is lost."""

from __future__ import annotations

import json
import os

import numpy as np

from deltackpt.cli import main
from deltackpt.store import LocalBackend, Store


def _store(tmp_path):
    root = tmp_path / "s"
    store = Store.init(LocalBackend(root, fsync=False), chunk_size_bytes=64 * 1024)
    data = np.arange(100_000, dtype=np.float32)
    store.save("a", {"x": data})
    return root, store.config, data


def test_lost_config_error_names_repair_then_repair_fixes_it(tmp_path, capsys):
    root, cfg, data = _store(tmp_path)
    os.unlink(root / "config")
    assert main(["ls", str(root)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"deltackpt repair {root}" in err

    assert main(["repair", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["config_recreated"] and out["store_id"] == cfg.store_id
    assert out["chunk_size_bytes"] == 64 * 1024 and out["chunk_size_inferred"]

    assert main(["verify", str(root), "--level", "2"]) == 0
    np.testing.assert_array_equal(Store.open(root).load("a")["x"], data)


def test_repair_text_output_and_healthy_store(tmp_path, capsys):
    root, _cfg, _data = _store(tmp_path)
    (root / "config").write_bytes(b"not json")
    assert main(["repair", str(root)]) == 0
    out = capsys.readouterr().out
    assert "config recreated" in out and "config.damaged-" in out
    assert main(["repair", str(root)]) == 0
    assert capsys.readouterr().out.startswith("nothing to repair")


def test_repair_of_a_non_store_is_a_deltackpt_error(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    assert main(["repair", str(tmp_path / "d")]) == 3
    assert "not a deltackpt store" in capsys.readouterr().err
    assert list((tmp_path / "d").iterdir()) == []
