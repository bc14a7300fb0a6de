"""Hot/cold tiers: the manager saves locally, uploads in the background to S3 (moto on 127.0.0.1), keeps
only the newest local checkpoints once they are remote, and a replaced node (empty local disk) resumes from
the remote store bit-exact. Upload errors surface at the next call."""

from __future__ import annotations

import shutil

import pytest
import torch

from deltackpt import CheckpointManager, DeltackptError, TrainState
from deltackpt.errors import BackendError
from deltackpt.store import Store
from deltackpt.store.tier import tier_states
from dist import assert_tree_equal
from train_helpers import dataset, full_state, make_model, make_optim, make_sched, train_step

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]


def _state(seed=0):
    model = make_model(seed)
    optim = make_optim(model)
    return TrainState(model=model, optimizer=optim, scheduler=make_sched(optim))


def _train(state, mgr, start, stop, refs=None):
    data = torch.stack(dataset(0))
    m, o, s = state.models["model"], state.optimizers["optim"], state.schedulers["scheduler"]
    for step in range(start + 1, stop + 1):
        train_step(m, o, s, data[(4 * step) % 20:(4 * step) % 20 + 4])
        state.step = step
        if mgr.maybe_save(step, force=step == stop) and refs is not None:
            refs[step] = full_state(m, o)


def test_upload_keep_local_last_and_resume_on_a_replaced_node(tmp_path, s3_server, s3_url):
    opts = s3_server.storage_options
    local = tmp_path / "node-a"
    state, refs = _state(), {}
    with CheckpointManager(str(local), state, every_n_steps=2, remote=s3_url, remote_storage_options=opts,
                           keep_local_last=2) as mgr:
        assert mgr.restore_latest() == 0
        _train(state, mgr, 0, 8, refs)
    remote = Store.open(s3_url, storage_options=opts)
    names = [f"step-{s:08d}" for s in (2, 4, 6, 8)]
    assert [i.name for i in remote.list_checkpoints()] == names
    assert [i.name for i in Store.open(local).list_checkpoints()] == names[-2:]
    assert tier_states(Store.open(local), remote) == {**{n: "remote" for n in names[:2]},
                                                      **{n: "both" for n in names[2:]}}
    # The node dies with its disk; a spare starts with an empty local store and the same remote.
    shutil.rmtree(local)
    fresh = _state(seed=123)
    with CheckpointManager(str(tmp_path / "node-b"), fresh, every_n_steps=2, remote=s3_url,
                           remote_storage_options=opts) as mgr:
        assert mgr.restore_latest() == 8
        assert_tree_equal(full_state(fresh.models["model"], fresh.optimizers["optim"]), refs[8])
        _train(fresh, mgr, 8, 10)
    assert [i.name for i in Store.open(s3_url, storage_options=opts).list_checkpoints()][-1] == "step-00000010"
    # The spare fetched only what the newest checkpoint reads, not the history.
    assert [i.name for i in Store.open(tmp_path / "node-b").list_checkpoints()] == ["step-00000008",
                                                                                   "step-00000010"]


def test_upload_failure_surfaces_at_the_next_call(tmp_path, s3_server, s3_url):
    import s3fs

    opts = s3_server.storage_options
    state = _state()
    mgr = CheckpointManager(str(tmp_path / "l"), state, every_n_steps=1, remote=s3_url, remote_storage_options=opts)
    _train(state, mgr, 0, 1)
    mgr.wait()
    bucket = s3_url.split("/")[2]
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    fs.rm(bucket, recursive=True)  # the bucket disappears under the run
    _train(state, mgr, 1, 2)
    with pytest.raises(DeltackptError, match="background upload of checkpoint 'step-00000002'"):
        mgr.wait()
    mgr.close()
    assert [i.name for i in Store.open(tmp_path / "l").list_checkpoints()] == ["step-00000001", "step-00000002"]


def test_a_remote_in_a_missing_bucket_is_refused_at_once(tmp_path, s3_server):
    with pytest.raises(BackendError, match="bucket does not exist"):
        CheckpointManager(str(tmp_path / "l"), _state(), remote="s3://no-such-bucket/run",
                          remote_storage_options=s3_server.storage_options)


def test_ls_shows_where_each_checkpoint_lives(tmp_path, s3_server, s3_url, capsys):
    from deltackpt import cli

    opts = s3_server.storage_options
    state = _state()
    with CheckpointManager(str(tmp_path / "l"), state, every_n_steps=1, remote=s3_url, remote_storage_options=opts,
                           keep_local_last=1) as mgr:
        _train(state, mgr, 0, 3)
    args = ["ls", str(tmp_path / "l"), "--json"] + [f"--storage-option={k}={v}" for k, v in
                                                   (("endpoint_url", opts["endpoint_url"]), ("key", "testing"),
                                                    ("secret", "testing"))]
    from deltackpt.store.fsspec_backend import FsspecBackend
    listed, real_list = [], FsspecBackend.list

    def counting_list(self, prefix=""):
        listed.append(prefix)
        return real_list(self, prefix)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FsspecBackend, "list", counting_list)
        assert cli.main(args) == 0
    assert listed.count("manifests/") == 1  # the remote's checkpoints are listed once
    import json
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["location"]) for r in rows] == [("step-00000001", "remote"), ("step-00000002", "remote"),
                                                         ("step-00000003", "both")]
    # The remote's own options, in place of the shared ones (which name an option no client knows).
    args = ["ls", str(tmp_path / "l"), "--json", f"--storage-option=endpoint_url={opts['endpoint_url']}",
            "--storage-option=profile_nme=x"] + [f"--remote-storage-option={k}={v}" for k, v in (
                ("endpoint_url", opts["endpoint_url"]), ("key", "testing"), ("secret", "testing"))]
    assert cli.main(args) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3


def test_a_damaged_local_copy_is_restored_from_the_remote(tmp_path, s3_server, s3_url):
    opts = s3_server.storage_options
    state, refs = _state(), {}
    local = tmp_path / "l"
    with CheckpointManager(str(local), state, every_n_steps=2, remote=s3_url, remote_storage_options=opts) as mgr:
        _train(state, mgr, 0, 4, refs)
    store = Store.open(local)
    newest = store.read_manifest("step-00000004")
    pack = store.index.lookup(newest.items[0].chunks[0].id).pack
    (local / "packs" / pack[:2] / pack).unlink()  # the local disk lost a pack of the newest checkpoint
    fresh = _state(seed=5)
    with CheckpointManager(str(local), fresh, every_n_steps=2, remote=s3_url, remote_storage_options=opts) as mgr:
        assert mgr.restore_latest() == 4
    assert_tree_equal(full_state(fresh.models["model"], fresh.optimizers["optim"]), refs[4])


@pytest.mark.parametrize("keep_local_last", [1, 2])
def test_a_damaged_local_manifest_is_restored_from_the_remote(tmp_path, s3_server, s3_url, keep_local_last):
    """Not an error ("no intact checkpoint", with one kept locally) and not a silent step back (with two)."""
    opts = s3_server.storage_options
    state, refs = _state(), {}
    local = tmp_path / "l"
    with CheckpointManager(str(local), state, every_n_steps=2, remote=s3_url, remote_storage_options=opts,
                           keep_local_last=keep_local_last) as mgr:
        _train(state, mgr, 0, 4, refs)
    manifest = local / "manifests" / "step-00000004"
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0x10
    manifest.write_bytes(bytes(data))
    fresh = _state(seed=5)
    with CheckpointManager(str(local), fresh, every_n_steps=2, remote=s3_url, remote_storage_options=opts) as mgr:
        assert mgr.restore_latest() == 4
    assert_tree_equal(full_state(fresh.models["model"], fresh.optimizers["optim"]), refs[4])


def test_a_replaced_node_skips_a_damaged_newest_remote_checkpoint(tmp_path, s3_server, s3_url):
    import s3fs

    opts = s3_server.storage_options
    state, refs = _state(), {}
    with CheckpointManager(str(tmp_path / "node-a"), state, every_n_steps=2, remote=s3_url,
                           remote_storage_options=opts) as mgr:
        _train(state, mgr, 0, 4, refs)
    remote = Store.open(s3_url, storage_options=opts)
    older = {e.pack for c in remote.read_manifest("step-00000002").items for e in
             map(remote.index.lookup, (r.id for r in c.chunks))}
    only_newest = {e.pack for c in remote.read_manifest("step-00000004").items for e in
                   map(remote.index.lookup, (r.id for r in c.chunks))} - older
    assert only_newest
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    for pack in only_newest:
        fs.rm_file(f"{s3_url[5:]}/packs/{pack[:2]}/{pack}")  # lost on the remote
    fresh = _state(seed=5)
    with CheckpointManager(str(tmp_path / "node-b"), fresh, every_n_steps=2, remote=s3_url,
                           remote_storage_options=opts) as mgr:
        assert mgr.restore_latest() == 2
        assert_tree_equal(full_state(fresh.models["model"], fresh.optimizers["optim"]), refs[2])
        again = {}
        _train(fresh, mgr, 2, 6, again)  # saves step 4 again: it replaces the damaged one on the remote
        mgr.wait()
    remote = Store.open(s3_url, storage_options=opts)
    assert [i.name for i in remote.list_checkpoints()] == ["step-00000002", "step-00000004", "step-00000006"]
    restored = _state(seed=9)
    with CheckpointManager(str(tmp_path / "node-c"), restored, every_n_steps=2, remote=s3_url,
                           remote_storage_options=opts) as mgr:
        assert mgr.restore_latest() == 6
    assert_tree_equal(full_state(restored.models["model"], restored.optimizers["optim"]), again[6])


def test_keep_last_bounds_the_local_store_too_unless_keep_local_last_says_otherwise(tmp_path):
    state = _state()
    with CheckpointManager(str(tmp_path / "hot"), state, every_n_steps=1, keep_last=2,
                           remote=str(tmp_path / "cold")) as mgr:
        _train(state, mgr, 0, 5)
    names = [f"step-{s:08d}" for s in range(1, 6)]
    assert [i.name for i in Store.open(tmp_path / "hot").list_checkpoints()] == names[-2:]
    assert [i.name for i in Store.open(tmp_path / "cold").list_checkpoints()] == names[-2:]
    state = _state()
    with CheckpointManager(str(tmp_path / "hot2"), state, every_n_steps=1, keep_last=2, keep_local_last=3,
                           remote=str(tmp_path / "cold2")) as mgr:
        _train(state, mgr, 0, 5)
    assert [i.name for i in Store.open(tmp_path / "hot2").list_checkpoints()] == names[-3:]


def test_resume_is_not_held_by_a_checkpoint_an_earlier_run_left_unsent(tmp_path):
    local, cold = tmp_path / "hot", str(tmp_path / "cold")
    state = _state()
    with CheckpointManager(str(local), state, every_n_steps=2, remote=cold) as mgr:
        _train(state, mgr, 0, 4)
    with CheckpointManager(str(local), state, every_n_steps=2) as mgr:  # step 6: the run died before its upload
        _train(state, mgr, 4, 6)
    store = Store.open(local)
    cid = store.read_manifest("step-00000006").items[0].chunks[0].id
    pack = store.index.lookup(cid).pack
    (local / "packs" / pack[:2] / pack).unlink()  # and the disk lost one of its packs
    with CheckpointManager(str(local), _state(seed=5), every_n_steps=2, remote=cold) as mgr:
        assert mgr.restore_latest() == 4  # step 6 is damaged; its catch-up upload fails in the background
    assert [i.name for i in Store.open(cold).list_checkpoints()] == ["step-00000002", "step-00000004"]


def test_a_run_that_went_back_replaces_the_remotes_later_checkpoints_of_the_same_names(tmp_path):
    """Restore step 2, train on (another lr, say), save steps 4 and 6 again: they replace the remote's older
    ones as they replaced the local ones (the upload failed as "already exists", and a spare resumed from the
    abandoned run)."""
    cold = str(tmp_path / "cold")
    state = _state()
    with CheckpointManager(str(tmp_path / "hot"), state, every_n_steps=2, remote=cold) as mgr:
        _train(state, mgr, 0, 6)
        assert mgr.restore("step-00000002") == 2
        refs = {}
        for group in state.optimizers["optim"].param_groups:
            group["lr"] *= 0.5
        _train(state, mgr, 2, 6, refs)
    spare = _state(seed=5)
    with CheckpointManager(str(tmp_path / "spare"), spare, every_n_steps=2, remote=cold) as mgr:
        assert mgr.restore_latest() == 6
    assert_tree_equal(full_state(spare.models["model"], spare.optimizers["optim"]), refs[6])


def test_a_fetched_checkpoint_counts_as_uploaded_for_local_retention(tmp_path):
    cold = str(tmp_path / "cold")
    state = _state()
    with CheckpointManager(str(tmp_path / "hot"), state, every_n_steps=2, remote=cold, keep_last=1) as mgr:
        _train(state, mgr, 0, 4)
    spare = _state(seed=5)
    with CheckpointManager(str(tmp_path / "spare"), spare, every_n_steps=2, remote=cold, keep_last=1) as mgr:
        assert mgr.restore_latest() == 4
        _train(spare, mgr, 4, 8)
    assert [i.name for i in Store.open(cold).list_checkpoints()] == ["step-00000008"]
    assert [i.name for i in Store.open(tmp_path / "spare").list_checkpoints()] == ["step-00000008"]


def test_a_remote_that_is_the_local_store_is_refused(tmp_path):
    with pytest.raises(DeltackptError, match="the local store itself"):
        CheckpointManager(str(tmp_path / "hot"), _state(), remote=str(tmp_path / "hot") + "/", keep_last=3,
                          keep_local_last=1)


def test_damaged_tags_do_not_make_resume_skip_an_intact_checkpoint(tmp_path):
    state, refs = _state(), {}
    with CheckpointManager(str(tmp_path / "l"), state, every_n_steps=2) as mgr:
        _train(state, mgr, 0, 4, refs)
    Store.open(tmp_path / "l").backend.put("tags/step-00000004", b'["best"')  # a torn write
    fresh = _state(seed=5)
    with CheckpointManager(str(tmp_path / "l"), fresh, every_n_steps=2) as mgr:
        assert mgr.restore_latest() == 4
    assert_tree_equal(full_state(fresh.models["model"], fresh.optimizers["optim"]), refs[4])


def test_a_node_holding_an_older_checkpoint_of_the_remotes_newest_name_resumes_from_the_remotes(tmp_path):
    """The run went back on another node and saved step 4 again; back on the first node, whose disk kept the
    abandoned branch's step 4 and 6, resume fetches the remote's step 4 over the local one (it stopped at the
    name before and resumed from the abandoned step 6), and `ls` shows the two as different."""
    cold = str(tmp_path / "cold")
    # Node A trains to step 6; everything is uploaded; A's disk survives.
    a = _state()
    with CheckpointManager(str(tmp_path / "node-a"), a, every_n_steps=2, remote=cold) as mgr:
        _train(a, mgr, 0, 6)
    # Node B (spare) resumes, the run goes back to step 2 (lower lr) and saves step 4 again (documented:
    # it replaces the remote's older step 4). Then B is preempted.
    b, refs = _state(seed=5), {}
    with CheckpointManager(str(tmp_path / "node-b"), b, every_n_steps=2, remote=cold) as mgr:
        assert mgr.restore_latest() == 6
        assert mgr.restore("step-00000002", store=Store.open(cold)) == 2
        for g in b.optimizers["optim"].param_groups:
            g["lr"] *= 0.5
        _train(b, mgr, 2, 4, refs)
    remote = Store.open(cold)
    newest = remote.list_checkpoints()[-1].name
    assert newest == "step-00000004"        # the remote's newest checkpoint (the run's current branch)
    # A fresh node resumes from it:
    c = _state(seed=7)
    with CheckpointManager(str(tmp_path / "node-c"), c, every_n_steps=2, remote=cold) as mgr:
        assert mgr.restore_latest() == 4
    assert_tree_equal(full_state(c.models["model"], c.optimizers["optim"]), refs[4])
    # The job lands on node A again (its disk kept the abandoned branch's step 4 and step 6):
    a2 = _state(seed=9)
    with CheckpointManager(str(tmp_path / "node-a"), a2, every_n_steps=2, remote=cold) as mgr:
        states = tier_states(Store.open(tmp_path / "node-a"), remote)
        step = mgr.restore_latest()
    assert states["step-00000004"] == "differs" and states["step-00000002"] == "both"
    assert step == 4, f"node A resumed from step {step} of the abandoned branch"
    assert_tree_equal(full_state(a2.models["model"], a2.optimizers["optim"]), refs[4])
    assert tier_states(Store.open(tmp_path / "node-a"), remote)["step-00000004"] == "both"
