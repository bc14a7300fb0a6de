"""The uploader of a hot/cold tier, against a local directory as the remote (the S3 path: tests/train/test_tiers.py).

Local retention counts what was uploaded even after the remote's own retention forgot it; a failed upload is
sent again; an uploader started after a crash sends what the last one did not finish; tags pin on both sides.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from deltackpt.errors import DeltackptError
from deltackpt.store import Store, tier
from deltackpt.store.retention import read_tags, set_tags
from deltackpt.store.tier import Uploader, read_tier, write_tier

from store_helpers import SMALL, assert_items_equal

pytestmark = pytest.mark.timeout(120)


def _save(store: Store, rng, name: str) -> dict:
    state = {"w": rng.standard_normal(3000).astype(np.float32)}
    store.save(name, state)
    return state


def _names(store_or_path) -> list[str]:
    store = store_or_path if isinstance(store_or_path, Store) else Store.open(store_or_path)
    return [i.name for i in store.list_checkpoints()]


def _copies_failing(monkeypatch, fails, error) -> list[list[str]]:
    """Make the uploader's copies raise ``error`` when ``fails(names, calls so far)``; returns the calls."""
    real, calls = tier.copy_checkpoints, []

    def copy(src, dst, names, **kw):
        calls.append(list(names))
        if fails(names, calls):
            raise error
        return real(src, dst, names, **kw)

    monkeypatch.setattr(tier, "copy_checkpoints", copy)
    return calls


@pytest.mark.parametrize("keep_local, keep_remote", [(2, 2), (1, 1), (2, 1), (1, 3)])
def test_local_retention_counts_what_the_remote_retention_already_forgot(tmp_path, rng, keep_local, keep_remote):
    local = Store.init(tmp_path / "hot", **SMALL)
    up = Uploader(local, str(tmp_path / "cold"), keep_local_last=keep_local, keep_remote_last=keep_remote)
    names = [f"step-{i}" for i in range(1, 7)]
    for name in names:
        _save(local, rng, name)
        up.submit(name)
        up.wait()
    up.close()
    assert _names(local) == names[-keep_local:]
    assert _names(tmp_path / "cold") == names[-keep_remote:]
    uploaded = read_tier(local)["uploaded"]  # pruned with the local checkpoints
    assert uploaded == {i.name: i.created_ns for i in local.list_checkpoints()}


def test_a_failed_upload_is_sent_again_with_the_next_submit(tmp_path, rng, monkeypatch):
    local = Store.init(tmp_path / "hot", **SMALL)
    up = Uploader(local, str(tmp_path / "cold"), keep_local_last=1)
    calls = _copies_failing(monkeypatch, lambda names, calls: len(calls) == 1, OSError("network down"))
    _save(local, rng, "a")
    up.submit("a")
    with pytest.raises(DeltackptError, match="background upload of checkpoint 'a'"):
        up.wait()
    assert _names(local) == ["a"]  # not uploaded: not dropped
    _save(local, rng, "b")
    up.submit("b")
    up.close()
    assert calls == [["a"], ["a"], ["b"]]
    assert _names(tmp_path / "cold") == ["a", "b"] and _names(local) == ["b"]


def test_an_error_is_raised_by_submit_after_its_checkpoint_is_queued(tmp_path, rng, monkeypatch):
    local = Store.init(tmp_path / "hot", **SMALL)
    up = Uploader(local, str(tmp_path / "cold"))
    _copies_failing(monkeypatch, lambda names, calls: len(calls) == 1, OSError("network down"))
    _save(local, rng, "a")
    up.submit("a")
    up._queue.join()
    _save(local, rng, "b")
    with pytest.raises(DeltackptError, match="'a'"):
        up.submit("b")  # the error of 'a' surfaces here, and 'b' (with 'a' again) is queued all the same
    up.close()
    assert _names(tmp_path / "cold") == ["a", "b"]


def test_a_new_uploader_sends_what_a_crashed_one_did_not(tmp_path, rng):
    local = Store.init(tmp_path / "hot", **SMALL)
    cold = str(tmp_path / "cold")
    for name in ("s1", "s2", "s3", "s4"):
        _save(local, rng, name)
    # The last run uploaded s1 (its remote has forgotten it since), crashed while sending s2, and never
    # queued s3 and s4.
    remote_id = Store.init(cold, **SMALL).config.store_id
    write_tier(local, cold, remote_id, uploading="s2", uploaded={"s1": local.read_manifest("s1").created_ns})
    up = Uploader(local, cold, keep_local_last=1)
    up.wait()
    up.close()
    assert _names(cold) == ["s2", "s3", "s4"]  # oldest first; s1 is not sent again
    assert _names(local) == ["s4"]
    record = read_tier(local)
    assert record["uploading"] is None and list(record["uploaded"]) == ["s4"]


def test_an_uploaded_list_for_another_remote_is_not_trusted(tmp_path, rng):
    local = Store.init(tmp_path / "hot", **SMALL)
    _save(local, rng, "s1")
    write_tier(local, str(tmp_path / "old-remote"), "0" * 32, uploaded={"s1": local.read_manifest("s1").created_ns})
    up = Uploader(local, str(tmp_path / "cold"))
    up.close()
    assert _names(tmp_path / "cold") == ["s1"]


def test_a_remote_made_again_at_the_same_url_is_sent_everything(tmp_path, rng):
    """The remote was wiped and made again at its URL (an operator, a lifecycle rule, another endpoint's bucket
    of that name): the record's uploaded list was another store's, so nothing local is forgotten on its word
    (the record was once trusted by URL: s1 and s2 were forgotten locally and existed nowhere)."""
    local = Store.init(tmp_path / "hot", **SMALL)
    cold = str(tmp_path / "cold")
    up = Uploader(local, cold)
    states = {}
    for name in ("s1", "s2", "s3"):
        states[name] = _save(local, rng, name)
        up.submit(name)
    up.close()
    shutil.rmtree(cold)
    Store.init(cold, **SMALL)
    up = Uploader(local, cold, keep_local_last=1)
    up.wait()
    up.close()
    assert _names(cold) == ["s1", "s2", "s3"]
    assert _names(local) == ["s3"]
    for name, state in states.items():
        assert_items_equal(state, Store.open(cold).load(name))
    # a record of an older release (no remote id) is trusted for nothing either
    record = json.loads(local.backend.get("tier"))
    del record["remote_id"]
    local.backend.put("tier", json.dumps(record).encode())
    assert read_tier(local)["uploaded"] == {}


def test_the_remote_retention_keeps_what_is_tagged_in_either_store(tmp_path, rng):
    local = Store.init(tmp_path / "hot", **SMALL)
    up = Uploader(local, str(tmp_path / "cold"), keep_remote_last=1)
    for i in range(1, 5):
        _save(local, rng, f"s{i}")
        if i == 1:
            set_tags(local, "s1", ["best"])  # tagged before its upload: the copy carries the tag
        up.submit(f"s{i}")
        if i == 2:
            up.wait()
            set_tags(local, "s2", ["paper"])  # tagged after it: the local tag pins it all the same
    up.close()
    cold = Store.open(tmp_path / "cold")
    assert _names(cold) == ["s1", "s2", "s4"]
    assert read_tags(cold, "s1") == ["best"]


def test_an_uploaded_name_saved_again_is_sent_again(tmp_path, rng):
    local = Store.init(tmp_path / "hot", **SMALL)
    cold = str(tmp_path / "cold")
    up = Uploader(local, cold)
    _save(local, rng, "s1")
    up.submit("s1")
    up.close()
    before = Store.open(cold).read_manifest("s1").created_ns
    # s1 saved again with other data (a rolled-back run), then the process died before its upload
    w = rng.standard_normal(3000).astype(np.float32)
    local.save("s1", {"w": w}, overwrite=True)
    again = local.read_manifest("s1").created_ns
    assert again != before
    _save(local, rng, "s2")
    up = Uploader(local, cold, keep_local_last=1)
    up.wait()  # the newer s1 replaces the remote's older one, as it replaced the local one; s2 is sent
    remote = Store.open(cold)
    assert remote.read_manifest("s1").created_ns == again
    np.testing.assert_array_equal(remote.load("s1")["w"], w)
    assert _names(local) == ["s2"]
    # A remote checkpoint newer than the local one of its name (another run's) is not replaced.
    _save(local, rng, "s3")
    remote.save("s3", {"w": w})
    with pytest.raises(DeltackptError, match="already exists"):
        up.submit("s3")
        up.wait()
    up.close()
    assert _names(local)[-1] == "s3"  # not counted as uploaded: kept


def test_a_permanent_upload_error_is_raised_once_not_retried(tmp_path, rng, monkeypatch):
    from deltackpt.errors import CorruptChunkError

    local = Store.init(tmp_path / "hot", **SMALL)
    up = Uploader(local, str(tmp_path / "cold"))
    calls = _copies_failing(monkeypatch, lambda names, _calls: names == ["bad"],
                            CorruptChunkError("chunk bytes do not match their hash"))
    _save(local, rng, "bad")
    up.submit("bad")
    with pytest.raises(DeltackptError, match="'bad'"):
        up.wait()
    for name in ("s2", "s3"):
        _save(local, rng, name)
        up.submit(name)  # no error: 'bad' is not sent again
        up.wait()
    up.close()
    assert calls == [["bad"], ["s2"], ["s3"]]


def test_a_failed_catch_up_is_logged_not_raised(tmp_path, rng, monkeypatch, caplog):
    local = Store.init(tmp_path / "hot", **SMALL)
    _save(local, rng, "s1")  # committed, never uploaded
    real = tier.copy_checkpoints
    _copies_failing(monkeypatch, lambda names, _calls: names == ["s1"], OSError("network down"))
    up = Uploader(local, str(tmp_path / "cold"))
    up.wait()  # the catch-up failed: logged, and sent again with the next submit
    assert "upload of checkpoint 's1' failed" in caplog.text
    monkeypatch.setattr(tier, "copy_checkpoints", real)
    _save(local, rng, "s2")
    up.submit("s2")
    up.close()
    assert _names(tmp_path / "cold") == ["s1", "s2"]


def test_an_older_record_is_caught_up_without_resending_what_retention_would_forget(tmp_path, rng, monkeypatch):
    import json

    local = Store.init(tmp_path / "hot", **SMALL)
    cold = str(tmp_path / "cold")
    up = Uploader(local, cold, keep_remote_last=2)  # an earlier release's manager kept every local checkpoint
    names = [f"s{i}" for i in range(6)]
    for name in names:
        _save(local, rng, name)
        up.submit(name)
    up.close()
    local.backend.put("tier", json.dumps({"remote": cold, "uploading": None}).encode())  # its record
    sent = []
    real = tier.copy_checkpoints
    monkeypatch.setattr(tier, "copy_checkpoints", lambda *a, **k: (sent.append(a[2]), real(*a, **k))[1])
    up = Uploader(local, cold, keep_local_last=2, keep_remote_last=2)
    up.wait()
    up.close()
    assert sent == []  # the remote holds the newest two; the rest it would forget at once
    assert _names(local) == names[-2:] and _names(cold) == names[-2:]  # trimmed at start


def test_ls_finds_a_relative_remote_from_any_directory_and_only_the_store_uploaded_to(tmp_path, rng, monkeypatch,
                                                                                      capsys):
    """The record holds the remote as an absolute path (it held a relative one, which `ls` opened relative to
    wherever it ran: another store that happened to be there was listed as this run's remote)."""
    from deltackpt import cli

    monkeypatch.chdir(tmp_path)
    local = Store.init(tmp_path / "hot", **SMALL)
    up = Uploader(local, "cold")
    for name in ("s1", "s2"):
        _save(local, rng, name)
        up.submit(name)
    up.close()
    assert read_tier(local)["remote"] == str(tmp_path / "cold")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    Store.init(elsewhere / "cold", **SMALL).save("other", {"x": np.zeros(4, dtype=np.float32)})
    assert cli.main(["ls", str(tmp_path / "hot"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["location"]) for r in rows] == [("s1", "both"), ("s2", "both")]
    # the remote replaced by another store at its path: locations unknown, not that store's checkpoints
    shutil.rmtree(tmp_path / "cold")
    shutil.copytree(elsewhere / "cold", tmp_path / "cold")
    assert cli.main(["ls", str(tmp_path / "hot"), "--json"]) == 0
    out = capsys.readouterr()
    assert [(r["name"], r["location"]) for r in json.loads(out.out)] == [("s1", "?"), ("s2", "?")]
    assert "not the one uploaded to" in out.err


def test_a_checkpoint_forgotten_locally_during_its_upload_is_not_an_error(tmp_path, rng, monkeypatch):
    # A `deltackpt forget` of the hot store while the uploader sent that checkpoint: the copy failed on its
    # vanished chunks, a permanent error raised into the training loop at the next submit.
    from deltackpt.store import copy as copy_mod
    from deltackpt.store.gc import plan_gc

    local = Store.init(tmp_path / "hot", **SMALL)
    up = Uploader(local, str(tmp_path / "cold"))
    real = copy_mod._send_chunks

    def send(src, dst, name, *args, **kw):
        if name == "b":
            other = Store.open(tmp_path / "hot")
            other.forget(["b"])
            plan_gc(other, grace_s=0).execute()
        return real(src, dst, name, *args, **kw)

    monkeypatch.setattr(copy_mod, "_send_chunks", send)
    state = _save(local, rng, "a")
    _save(local, rng, "b")
    up.submit("b")
    up._queue.join()
    _save(local, rng, "c")
    up.submit("c")  # raised the error of 'b'
    up.close()
    up.raise_if_failed()
    assert _names(tmp_path / "cold") == ["c"]
    assert _names(local) == ["a", "c"]
    assert_items_equal(state, local.load("a"))


def test_checkpoints_saved_after_a_resume_on_a_node_whose_clock_is_behind_stay_the_newest(tmp_path, monkeypatch):
    """Node A's clock runs 2 minutes ahead; it uploads steps 1-3 and dies. Node B (right clock) fetches step 3
    and saves 4-6: each is made after the newest checkpoint it saw, so they sort after step 3. Before, they got
    B's earlier clock: the remote's retention forgot each at once, local retention evicted it as uploaded, and the
    next resume went back to step 3."""
    import time as real_time
    import types

    from deltackpt.store import commit as commit_mod
    from deltackpt.store.copy import copy_checkpoints

    def clock(offset_s: float) -> None:
        monkeypatch.setattr(commit_mod, "time", types.SimpleNamespace(
            time_ns=lambda: real_time.time_ns() + int(offset_s * 1e9)))

    cold = str(tmp_path / "cold")
    a = Store.init(tmp_path / "node-a", **SMALL)
    clock(120)
    up = Uploader(a, cold, keep_local_last=1, keep_remote_last=2)
    for step in (1, 2, 3):
        a.save(f"step-{step}", {"w": np.full(1000, step, np.float32)}, metadata={"step": step})
        up.submit(f"step-{step}")
    up.close()
    clock(0)
    b = Store.init(tmp_path / "node-b", **SMALL)
    up = Uploader(b, cold, keep_local_last=1, keep_remote_last=2)
    copy_checkpoints(up.remote, b, ["step-3"])  # what restore_latest fetches
    up.note_fetched("step-3", b.read_manifest("step-3").created_ns)
    for step in (4, 5, 6):
        b.save(f"step-{step}", {"w": np.full(1000, step, np.float32)}, metadata={"step": step})
        up.submit(f"step-{step}")
    up.close()
    remote = Store.open(cold)
    assert [i.name for i in remote.list_checkpoints()] == ["step-5", "step-6"]
    assert [i.name for i in b.list_checkpoints()] == ["step-6"]
    assert remote.load("latest")["w"][0] == 6


def test_a_failed_upload_is_not_shown_as_uploading_once_it_failed(tmp_path, rng, monkeypatch):
    """The tier record said ``uploading`` from an upload's start and was cleared only when it succeeded: after
    a failure (and the run's end) ``ls`` showed the checkpoint as uploading for good."""
    from deltackpt.store.tier import tier_states

    local = Store.init(tmp_path / "hot", **SMALL)
    up = Uploader(local, str(tmp_path / "cold"))
    _save(local, rng, "a")
    up.submit("a")
    up.wait()
    _copies_failing(monkeypatch, lambda names, calls: True, OSError("network down"))
    _save(local, rng, "b")
    up.submit("b")
    with pytest.raises(DeltackptError, match="background upload of checkpoint 'b'"):
        up.close()
    assert read_tier(local)["uploading"] is None
    remote = Store.open(tmp_path / "cold")
    states = tier_states(local, remote)
    assert states["a"] == "both" and states["b"] == "local"


def test_ls_shows_the_remotes_tags_of_checkpoints_the_remote_holds(tmp_path, rng, capsys):
    """Tags came from the local store only: a checkpoint pinned on the remote (its retention keeps it) was
    listed with no tags once it lived there alone."""
    from deltackpt import cli

    local = Store.init(tmp_path / "hot", **SMALL)
    up = Uploader(local, str(tmp_path / "cold"), keep_local_last=1)
    for name in ("a", "b", "c"):
        _save(local, rng, name)
        up.submit(name)
        up.wait()
    up.close()
    set_tags(Store.open(tmp_path / "cold"), "a", ["release"])
    set_tags(Store.open(tmp_path / "cold"), "c", ["best"])
    set_tags(local, "c", ["mine"])
    assert cli.main(["ls", str(tmp_path / "hot"), "--json"]) == 0
    rows = {r["name"]: (r["location"], r["tags"]) for r in json.loads(capsys.readouterr().out)}
    assert rows == {"a": ("remote", ["release"]), "b": ("remote", []), "c": ("both", ["best", "mine"])}


def test_du_counts_every_object_of_the_store(tmp_path, rng):
    """du's totals left out commit records, tags and the tier record (physical counts what the checkpoints
    need, as the benchmarks do; other the rest)."""
    import os

    local = Store.init(tmp_path / "hot", **SMALL)
    up = Uploader(local, str(tmp_path / "cold"))
    for name in ("a", "b"):
        _save(local, rng, name)
        up.submit(name)
    up.close()
    set_tags(local, "a", ["keep"])
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _dirs, files in os.walk(tmp_path / "hot")
                  for f in files if not os.path.relpath(d, tmp_path / "hot").startswith(("cache", "locks")))
    usage = local.usage()
    assert usage.physical_bytes + usage.other_bytes == on_disk and usage.other_bytes > 0
