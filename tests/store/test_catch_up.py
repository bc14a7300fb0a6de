"""A cache several processes share (the ranks of one host, node-local) catches up to a commit it missed once:
one process lists the packs and indexes the new ones, the others wait for it and find the commit seen."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np

from deltackpt.store import Store
from deltackpt.store.commitlog import commit_record_key

from store_helpers import SMALL, assert_items_equal, subprocess_env

RANK = textwrap.dedent(
    """
    import sys, time
    from deltackpt.store import LocalBackend, Store

    root, cache, log, start = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])

    class Listing(LocalBackend):
        def list(self, prefix=""):
            if prefix == "packs/":
                with open(log, "a") as f:
                    f.write("list\\n")
                time.sleep(0.3)  # a slow listing (object storage): the other processes ask meanwhile
            return super().list(prefix)

    store = Store.open(Listing(root, fsync=False), cache_dir=cache)
    time.sleep(max(0.0, start - time.time()))
    index = store.index_as_of("c1")
    print(index.num_chunks(), flush=True)
    """
)


def test_processes_sharing_a_stale_cache_list_the_packs_once(tmp_path):
    root, cache = tmp_path / "store", tmp_path / "node-local-cache"
    store = Store.init(root, **SMALL)
    rng = np.random.default_rng(0)
    store.save("c0", {"x": rng.integers(0, 256, 1 << 16, dtype=np.uint8)})
    Store.open(root, cache_dir=cache).index_as_of("c0")  # the host's cache saw c0's commit...
    x1 = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    store.save("c1", {"x": x1})  # ...but not c1's, made elsewhere
    store.backend.delete(commit_record_key("c1"))  # and c1 has no commit record (an older release's): a listing
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    log = tmp_path / "listings"
    start = time.time() + 2.0  # the processes start before it and catch up together
    procs = [subprocess.Popen([sys.executable, str(script), str(root), str(cache), str(log), str(start)],
                              env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(int(out))
    assert log.read_text().count("list") == 1  # each of the four listed every pack before
    assert len(set(outs)) == 1 and outs[0] == store.index.num_chunks()  # every process sees c1's chunks
    fresh = Store.open(root, cache_dir=cache)
    assert fresh._cache_index().has_seen("c1")
    assert_items_equal({"x": x1}, fresh.load("c1"))


def test_a_cache_whose_last_commit_was_saved_again_elsewhere_catches_up(tmp_path):
    """Its last commit ``s1`` was overwritten from another host (same name, another time, other chunks): the
    cache has not seen that commit, catches up, and the next save reuses the new ``s1``'s chunks (it stored
    them all again when only the name was compared)."""
    from deltackpt.store import MemoryBackend

    from store_helpers import random_array

    rng = np.random.default_rng(1)
    a = Store.init(MemoryBackend(), cache_dir=tmp_path / "cache-a", **SMALL)
    b = Store.open(a.backend, cache_dir=tmp_path / "cache-b")
    x, y = (random_array(rng, "float32", (20_000,)) for _ in range(2))
    a.save("s1", {"x": x})
    b.save("s1", {"y": y}, overwrite=True)
    assert a.index.last_commit().name == "s1"
    assert not a.index.has_seen("s1", b.read_manifest("s1").created_ns) and a.index.has_seen("s1")
    m = a.save("s2", {"y": y})
    assert m.stats.new_chunks == 0
    assert_items_equal({"y": y}, a.load("s2"))
