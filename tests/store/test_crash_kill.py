"""SIGKILL in the middle of a save: the store stays openable and shows only committed checkpoints."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from deltackpt.store import Store
from deltackpt.store.pack import pack_bytes_ok, read_pack_entries

from store_helpers import REPO_ROOT, assert_items_equal, pack_names, random_array, subprocess_env

ELEMS = 16 * 1024 * 1024  # 64 MiB of float32 per checkpoint

CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from deltackpt.store import Store

    store = Store.open(sys.argv[1])
    i = 0
    while True:
        x = np.random.default_rng(1000 + i).standard_normal({elems}, dtype=np.float32)
        print("start", i, flush=True)
        store.save(f"big-{{i}}", {{"w": x}})
        print("committed", i, flush=True)
        i += 1
    """
).format(elems=ELEMS)


def _big(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).standard_normal(ELEMS, dtype=np.float32)


@pytest.mark.parametrize("delay", [0.0, 0.15, 0.6])
def test_sigkill_during_save(tmp_path, rng, delay):
    root = tmp_path / "store"
    store = Store.init(root, chunk_size_bytes=64 * 1024, pack_target_bytes=256 * 1024)
    base = {"w": random_array(rng, "float32", (100_000,)), "meta": b"base checkpoint"}
    store.save("base", base)
    base_packs = pack_names(store)

    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], cwd=REPO_ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while pack_names(store) == base_packs:  # wait for the first pack of the new save
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"child exited early ({proc.returncode}): {err.decode()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("child wrote no pack within 60 s")
            time.sleep(0.002)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    print("killed after", delay, "s; child said:", out.decode().split())
    committed = {f"big-{line.split()[1]}" for line in out.decode().splitlines() if line.startswith("committed")}

    reopened = Store.open(root)
    names = [i.name for i in reopened.list_checkpoints()]
    assert names[0] == "base"
    assert set(names) <= {"base"} | {f"big-{i}" for i in range(100)}
    assert committed <= set(names)  # a save that returned is durable
    assert_items_equal(base, reopened.load("base"))
    for name in names[1:]:  # whatever got committed is complete and bit-exact
        np.testing.assert_array_equal(reopened.load(name)["w"], _big(int(name.split("-")[1])))
    # every pack visible in the store is whole: puts are atomic, a torn pack is at most a *.tmp-* file
    for info in reopened.backend.list("packs/"):
        name = info.key.rsplit("/", 1)[1]
        assert pack_bytes_ok(name, reopened.backend.get(info.key)), info.key
        assert read_pack_entries(reopened.backend, name, info.size_bytes)
    assert all(".tmp-" in t for t, _mtime in reopened.backend.list_temp())
    # the store is fully usable afterwards, and the killed save's orphan chunks are reused
    nxt = len(names) - 1
    m = reopened.save("after", {"w": _big(nxt)})
    if nxt == 0:  # killed inside big-0, after its first pack: those orphan chunks are found and reused
        assert m.stats.new_chunks < m.stats.num_chunks
    assert [i.name for i in reopened.list_checkpoints()][-1] == "after"
    np.testing.assert_array_equal(reopened.load("after")["w"], _big(nxt))
