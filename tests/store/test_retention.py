"""Retention: plan_forget rules (ORed), tags that pin checkpoints, and forget removing manifests only."""

from __future__ import annotations

import time

import pytest

from deltackpt.errors import CheckpointNotFoundError, CheckpointPinnedError
from deltackpt.store.pack import pack_key
from deltackpt.store.retention import (parse_duration, plan_forget, plan_forget_names, read_all_tags, read_tags,
                                       set_tags)

from store_helpers import assert_items_equal, pack_names, random_array


@pytest.fixture
def six(store, rng):
    """Six checkpoints s0..s5 (oldest first) with metadata step = 0, 10, ..., 50, a few ms apart."""
    saved = {}
    for i in range(6):
        items = {"x": random_array(rng, "float32", (1500,))}
        store.save(f"s{i}", items, metadata={"step": 10 * i})
        saved[f"s{i}"] = items
        time.sleep(0.005)
    infos = store.list_checkpoints()
    assert [i.name for i in infos] == [f"s{i}" for i in range(6)]
    return store, saved, infos


def _kept(plan) -> list[str]:
    return sorted(plan.keep)


def test_keep_last(six):
    store, _, _ = six
    plan = plan_forget(store, keep_last=2)
    assert _kept(plan) == ["s4", "s5"]
    assert plan.forget == ["s0", "s1", "s2", "s3"]  # oldest first
    assert plan.keep["s5"] == ["last 2"]
    assert _kept(plan_forget(store, keep_last=100)) == [f"s{i}" for i in range(6)]
    with pytest.raises(ValueError):
        plan_forget(store, keep_last=0)  # "forget everything" is not a retention policy


def test_keep_every_uses_the_step_metadata(six):
    store, _, _ = six
    plan = plan_forget(store, keep_every=20)
    assert _kept(plan) == ["s0", "s2", "s4", "s5"]  # steps 0, 20, 40; and the newest
    assert plan.keep["s4"] == ["every 20"] and plan.keep["s5"] == ["newest"]
    assert _kept(plan_forget(store, keep_every=30)) == ["s0", "s3", "s5"]  # steps 0, 30
    assert _kept(plan_forget(store, keep_every=7)) == ["s0", "s5"]  # position 7 would be nothing: step is used


def test_keep_every_without_step_metadata_is_refused(store, rng):
    """Positions shift as checkpoints are forgotten, so counting them would erode the store run after run."""
    for i in range(5):
        store.save(f"n{i}", {"x": random_array(rng, "uint8", (100,))})
    with pytest.raises(ValueError, match="metadata field 'step'.*none of the 5"):
        plan_forget(store, keep_every=2)
    # mixed: the rule keeps only checkpoints with a step; the others need another rule
    store.save("m5", {"x": random_array(rng, "uint8", (100,))}, metadata={"step": 4})
    store.save("m6", {"x": random_array(rng, "uint8", (100,))}, metadata={"step": True})  # not a step
    plan = plan_forget(store, keep_every=2)
    assert _kept(plan) == ["m5", "m6"] and plan.keep["m6"] == ["newest"]


def test_keep_within(six):
    store, _, infos = six
    c = [i.created_ns / 1e9 for i in infos]
    plan = plan_forget(store, keep_within="36h", now=c[3] + 36 * 3600 - 1e-3)
    assert _kept(plan) == ["s3", "s4", "s5"]
    assert plan.keep["s3"] == ["within 36h"]
    assert _kept(plan_forget(store, keep_within="7d", now=c[5] + 7 * 86400 - 1e-3)) == ["s5"]
    plan = plan_forget(store, keep_within="7d", now=c[5] + 8 * 86400)
    assert _kept(plan) == ["s5"] and plan.keep["s5"] == ["newest"]  # never the newest, whatever the rules
    assert _kept(plan_forget(store, keep_within="1d12h", now=c[0] + 86400)) == [f"s{i}" for i in range(6)]
    assert _kept(plan_forget(store, keep_within=60.0, now=c[5] + 30)) == [f"s{i}" for i in range(6)]


def test_rules_are_ored(six):
    store, _, infos = six
    c = [i.created_ns / 1e9 for i in infos]
    plan = plan_forget(store, keep_last=1, keep_every=20, keep_within="1h", now=c[1] + 3600 - 1e-3)
    # last 1 -> s5; every 20 -> s0 s2 s4; within 1h of now=c1+1h -> s1..s5
    assert _kept(plan) == ["s0", "s1", "s2", "s3", "s4", "s5"]
    plan = plan_forget(store, keep_last=1, keep_every=20)
    assert _kept(plan) == ["s0", "s2", "s4", "s5"]
    assert plan.forget == ["s1", "s3"]
    assert set(plan.keep["s4"]) == {"every 20"} and set(plan.keep["s5"]) == {"last 1"}
    assert plan.as_dict() == {"keep": [{"name": n, "reasons": plan.keep[n]} for n in plan.keep],
                              "forget": ["s1", "s3"]}


@pytest.mark.parametrize("kwargs", [{}, {"keep_tags": []}, {"keep_last": None, "keep_within": None}])
def test_empty_policy_is_refused(six, kwargs):
    store, _, _ = six
    with pytest.raises(ValueError, match="empty"):
        plan_forget(store, **kwargs)
    assert len(store.checkpoint_names()) == 6


@pytest.mark.parametrize("kwargs", [{"keep_last": -1}, {"keep_every": 0}, {"keep_within": "7x"},
                                    {"keep_within": ""}, {"keep_within": "d7"}, {"keep_within": "7d "},
                                    {"keep_within": "0s"}, {"keep_within": "0d0h"}, {"keep_within": 0.0},
                                    {"keep_within": -5.0}])
def test_bad_policy_values_are_refused(six, kwargs):
    store, _, _ = six
    with pytest.raises(ValueError):
        plan_forget(store, **kwargs)


def test_a_policy_never_forgets_the_newest(six):
    store, _, infos = six
    c = [i.created_ns / 1e9 for i in infos]
    set_tags(store, "s1", ["t"])
    for kwargs in ({"keep_every": 1000}, {"keep_within": "1s", "now": c[5] + 3600}, {"keep_tags": ["t"]},
                   {"keep_every": 7, "keep_within": 1e-9, "keep_tags": ["nope"]}):
        plan = plan_forget(store, **kwargs)
        assert "s5" in plan.keep and "s5" not in plan.forget, kwargs
    plan.execute()
    assert sorted(store.checkpoint_names()) == ["s0", "s1", "s5"]


# -- forget by name --------------------------------------------------------------------------------------------


def test_forget_names_forgets_exactly_those(six):
    store, saved, _ = six
    plan = plan_forget_names(store, ["s2", "latest", "s2"])
    assert plan.forget == ["s2", "s5"] and plan.keep == {}
    assert len(store.checkpoint_names()) == 6  # a plan changes nothing
    assert plan.execute() == ["s2", "s5"]
    assert sorted(store.checkpoint_names()) == ["s0", "s1", "s3", "s4"]
    assert_items_equal(saved["s4"], store.load("latest"))


def test_forget_names_refuses_unknown_and_tagged_before_changing_anything(six):
    store, _, _ = six
    set_tags(store, "s3", ["best", "v1"])
    with pytest.raises(CheckpointNotFoundError) as e:
        plan_forget_names(store, ["s0", "s9"])
    assert "nearby names" in str(e.value)
    with pytest.raises(CheckpointPinnedError) as e:
        plan_forget_names(store, ["s0", "s3"])
    assert e.value.name == "s3" and e.value.tags == ["best", "v1"]
    assert "--remove best --remove v1" in str(e.value)
    with pytest.raises(ValueError):
        plan_forget_names(store, [])
    assert len(store.checkpoint_names()) == 6
    set_tags(store, "s3", [])
    assert plan_forget_names(store, ["s3"]).execute() == ["s3"]


def test_read_all_tags(six):
    store, _, _ = six
    assert read_all_tags(store) == {}
    set_tags(store, "s1", ["b", "a"])
    set_tags(store, "s4", ["x"])
    assert read_all_tags(store) == {"s1": ["a", "b"], "s4": ["x"]}


def test_parse_duration():
    assert parse_duration("90s") == 90
    assert parse_duration("15m") == 900
    assert parse_duration("36h") == 36 * 3600
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("2w") == 14 * 86400
    assert parse_duration("1d12h") == 36 * 3600
    assert parse_duration("1.5h") == 5400
    for bad in ("", "h", "7", "7 d", "-7d", "7d!", "1h2"):
        with pytest.raises(ValueError):
            parse_duration(bad)


# -- tags ------------------------------------------------------------------------------------------------------


def test_tagged_checkpoints_are_never_forgotten(six):
    store, saved, _ = six
    assert set_tags(store, "s1", ["best", "release-1"]) == ["best", "release-1"]
    assert read_tags(store, "s1") == ["best", "release-1"]
    plan = plan_forget(store, keep_last=1)
    assert _kept(plan) == ["s1", "s5"]
    assert plan.keep["s1"] == ["tag best,release-1"]
    plan = plan_forget(store, keep_last=1, keep_tags=["best"])
    assert plan.keep["s1"] == ["tag best"]
    removed = plan.execute()
    assert removed == ["s0", "s2", "s3", "s4"]
    assert sorted(store.checkpoint_names()) == ["s1", "s5"]
    assert_items_equal(saved["s1"], store.load("s1"))
    assert read_tags(store, "s1") == ["best", "release-1"]


def test_keep_tags_alone_forgets_the_untagged(six):
    store, _, _ = six
    set_tags(store, "s2", ["keep"])
    set_tags(store, "s3", ["other"])
    plan = plan_forget(store, keep_tags=["keep"])
    assert _kept(plan) == ["s2", "s3", "s5"]  # any tag pins; keep_tags only names the reason; s5 is the newest
    assert plan.keep["s2"] == ["tag keep"] and plan.keep["s3"] == ["tag other"]


def test_set_tags_validation_and_removal(six):
    store, _, _ = six
    with pytest.raises(CheckpointNotFoundError):
        set_tags(store, "nope", ["a"])
    for bad in ("", "has space", "a/b", "x" * 65, "-lead"):
        with pytest.raises(ValueError):
            set_tags(store, "s0", [bad])
    assert read_tags(store, "s0") == []
    assert set_tags(store, "s0", ["b", "a", "b"]) == ["a", "b"]
    assert set_tags(store, "s0", []) == []
    assert read_tags(store, "s0") == []
    assert not store.backend.exists("tags/s0")
    assert plan_forget(store, keep_last=1).forget[0] == "s0"


def test_forgetting_untags(six):
    store, _, _ = six
    set_tags(store, "s0", ["t"])
    set_tags(store, "s0", [])
    plan_forget(store, keep_last=5).execute()
    assert not store.exists("s0")
    assert not store.backend.exists("tags/s0")


# -- execution -------------------------------------------------------------------------------------------------


def test_forget_removes_manifests_only(six):
    store, saved, _ = six
    packs = {n: store.backend.get(pack_key(n)) for n in pack_names(store)}
    plan = plan_forget(store, keep_last=2)
    assert plan.execute() == ["s0", "s1", "s2", "s3"]
    assert sorted(store.checkpoint_names()) == ["s4", "s5"]
    assert [i.name for i in store.list_checkpoints()] == ["s4", "s5"]
    for n in ("s0", "s3"):
        assert not store.exists(n)
        with pytest.raises(CheckpointNotFoundError):
            store.load(n)
    # pack bytes are untouched until gc
    assert {n: store.backend.get(pack_key(n)) for n in pack_names(store)} == packs
    for n in ("s4", "s5"):
        assert_items_equal(saved[n], store.load(n))
    assert plan_forget(store, keep_last=2).forget == []  # idempotent


def test_plan_alone_changes_nothing(six):
    store, _, _ = six
    plan_forget(store, keep_last=1)
    assert len(store.checkpoint_names()) == 6


def test_execute_tolerates_an_already_forgotten_checkpoint(six):
    store, _, _ = six
    plan = plan_forget(store, keep_last=4)
    store.forget("s0")
    assert plan.execute() == ["s1"]
    assert sorted(store.checkpoint_names()) == ["s2", "s3", "s4", "s5"]


@pytest.mark.parametrize("damage", [b'{"x', b'{"a": 1}', b"[1, 2]", b'["k%ep"]'])  # the last: one flipped bit
def test_a_damaged_tags_object_still_pins_is_reported_and_can_be_rewritten(six, damage):
    from deltackpt.store.retention import DAMAGED_TAGS
    from deltackpt.store.verify import verify_store
    from deltackpt.store.verifyreport import ProblemKind

    store, _, _ = six
    set_tags(store, "s1", ["keep"])
    store.backend.put("tags/s1", damage)  # a torn write, bit rot
    assert read_tags(store, "s1") == [DAMAGED_TAGS] and read_all_tags(store) == {"s1": [DAMAGED_TAGS]}
    assert "s1" in plan_forget(store, keep_last=1).keep  # still a pin: never forgotten by a policy
    with pytest.raises(CheckpointPinnedError):
        plan_forget_names(store, ["s1"])
    report = verify_store(store, level=0)
    assert not report.ok and [p.kind for p in report.problems] == [ProblemKind.TAGS]
    assert "s1" in report.problems[0].detail and report.damaged_checkpoints == []  # its data is intact
    assert set_tags(store, "s1", [*read_tags(store, "s1"), "new"]) == ["new"]  # rewritten, the marker dropped
    assert read_tags(store, "s1") == ["new"] and verify_store(store, level=0).ok


def test_a_checkpoint_tagged_after_the_plan_is_kept(six):
    # Another process tags s0 between forget's plan and its execution: the pin holds, with its tags.
    store, saved, _ = six
    plan = plan_forget(store, keep_last=2)
    set_tags(store, "s0", ["best"])
    removed = plan.execute()
    assert removed == ["s1", "s2", "s3"] and plan.keep["s0"] == ["tagged since the plan"]
    assert read_tags(store, "s0") == ["best"]
    assert_items_equal(saved["s0"], store.load("s0"))


def test_a_tag_that_lands_after_forget_read_the_tags_is_refused_not_lost(six, monkeypatch):
    # It landed between forget's listing of the tags and its deletion of the manifest: the tagger was told
    # the tag was set, then forget removed the checkpoint and the tag.
    store, _, _ = six
    plan = plan_forget(store, keep_last=2)
    real, raised = store.forget, []

    def forget(names):
        try:
            set_tags(store, "s1", ["best"])  # another process, now
        except CheckpointNotFoundError as e:
            raised.append(str(e))
        return real(names)

    monkeypatch.setattr(store, "forget", forget)
    assert plan.execute() == ["s0", "s1", "s2", "s3"]
    assert raised and "a forget running in another process" in raised[0]
    assert read_all_tags(store) == {}
    assert not list(store.backend.list("forgetting/"))  # the intent is gone with the forget


def test_a_forget_that_runs_between_a_tags_write_and_its_check_keeps_the_checkpoint(six, monkeypatch):
    from deltackpt.store import retention

    store, saved, _ = six
    plan = plan_forget(store, keep_last=2)
    real, removed = retention._being_forgotten, []

    def check(store_, name):  # the tag is written; the whole forget runs before the tagger looks
        if not removed:
            removed.append(plan.execute())
        return real(store_, name)

    monkeypatch.setattr(retention, "_being_forgotten", check)
    assert set_tags(store, "s1", ["best"]) == ["best"]
    assert removed == [["s0", "s2", "s3"]] and plan.keep["s1"] == ["tagged since the plan"]
    assert read_tags(store, "s1") == ["best"]
    assert_items_equal(saved["s1"], store.load("s1"))


def test_a_crashed_forgets_intent_expires_and_a_foreign_one_is_ignored(six, monkeypatch):
    import json

    from deltackpt.store import retention

    store, _, _ = six
    store.backend.put("forgetting/old", json.dumps({"names": ["s1"], "time": time.time() - 700}).encode())
    store.backend.put("forgetting/junk", b"{not json")
    assert set_tags(store, "s1", ["a"]) == ["a"]
    store.backend.put("forgetting/new", json.dumps({"names": ["s2"], "time": time.time()}).encode())
    with pytest.raises(CheckpointNotFoundError, match="forget running"):
        set_tags(store, "s2", ["a"])
    assert read_all_tags(store) == {"s1": ["a"]}
    monkeypatch.setattr(retention, "INTENT_TTL_S", 0.0)
    assert set_tags(store, "s2", ["a"]) == ["a"]


def test_a_forget_that_fails_takes_its_intent_back(six, monkeypatch):
    store, _, _ = six
    plan = plan_forget(store, keep_last=2)
    monkeypatch.setattr(store, "forget", lambda names: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError):
        plan.execute()
    assert not list(store.backend.list("forgetting/"))


def test_the_next_forget_deletes_intents_crashed_forgets_left_and_keeps_recent_ones(six, monkeypatch):
    import dataclasses
    import json

    from deltackpt.store.retention import STALE_INTENT_S

    store, _, _ = six
    for key in ("forgetting/crashed", "forgetting/recent", "forgetting/junk"):
        store.backend.put(key, json.dumps({"names": ["s1"], "time": time.time()}).encode())
    # Their ages as the listing tells them (written that long ago; what one holds does not matter).
    age = {"forgetting/crashed": STALE_INTENT_S + 60, "forgetting/junk": STALE_INTENT_S + 60,
           "forgetting/recent": STALE_INTENT_S - 120}
    real = store.backend.list
    monkeypatch.setattr(store.backend, "list", lambda prefix: [
        dataclasses.replace(i, mtime_s=time.time() - age[i.key]) if i.key in age else i for i in real(prefix)])
    assert plan_forget(store, keep_last=5).execute() == ["s0"]
    assert sorted(i.key for i in store.backend.list("forgetting/")) == ["forgetting/recent"]


def test_a_forget_whose_cleanup_of_old_intents_fails_still_reports_what_it_forgot(six, monkeypatch, caplog):
    store, _, _ = six
    real = store.backend.list

    def listing(prefix):
        if prefix == "forgetting/":
            raise OSError("listing refused")
        return real(prefix)

    monkeypatch.setattr(store.backend, "list", listing)
    assert plan_forget(store, keep_last=5).execute() == ["s0"]
    assert "left old forget intents in place" in caplog.text
    assert [i.name for i in store.list_checkpoints()] == ["s1", "s2", "s3", "s4", "s5"]


def test_a_refused_tag_leaves_the_tags_accepted_before_it(six, monkeypatch):
    # s0 was tagged "keep" after forget's plan and before its intent: the forget keeps it. While that forget
    # runs, another tag of s0 is refused; "keep" must stay (deleting the object would unpin s0 for the next one).
    store, saved, _ = six
    plan = plan_forget_names(store, ["s0", "s1"])
    assert set_tags(store, "s0", ["keep"]) == ["keep"]
    real, raised = store.forget, []

    def forget(names):
        try:
            set_tags(store, "s0", ["keep", "extra"])
        except CheckpointNotFoundError as e:
            raised.append(str(e))
        return real(names)

    monkeypatch.setattr(store, "forget", forget)
    assert plan.execute() == ["s1"] and plan.keep["s0"] == ["tagged since the plan"]
    assert raised and "a forget running in another process" in raised[0]
    assert read_tags(store, "s0") == ["keep"]
    monkeypatch.setattr(store, "forget", real)
    assert plan_forget(store, keep_last=1).execute() == ["s2", "s3", "s4"]  # the pin still holds
    assert_items_equal(saved["s0"], store.load("s0"))


def test_a_slow_forget_renews_its_intent_so_a_late_tag_is_still_refused(six, monkeypatch):
    # Removing manifests took longer than INTENT_TTL_S (many names on object storage): a tag of a checkpoint
    # still to go must be refused, not accepted and then deleted with it.
    import json

    from deltackpt.store import retention
    from deltackpt.store.manifest import manifest_key

    store, _, _ = six
    monkeypatch.setattr(retention, "FORGET_BATCH", 1)
    clock = [0.0]
    real_time = time.time
    monkeypatch.setattr(retention.time, "time", lambda: real_time() + clock[0])
    plan = plan_forget_names(store, ["s0", "s1"])
    real_delete, told = store.backend.delete, []

    def delete(key):
        if key == manifest_key("s1"):  # another process tags s1 just before its manifest goes
            try:
                told.append(set_tags(store, "s1", ["keep"]))
            except CheckpointNotFoundError:
                told.append("refused")
        real_delete(key)
        if key == manifest_key("s0"):
            clock[0] += retention.INTENT_TTL_S + 60  # this one took 11 minutes

    monkeypatch.setattr(store.backend, "delete", delete)
    assert plan.execute() == ["s0", "s1"]
    assert told == ["refused"], "the tagger was told s1 is tagged, and s1 was then forgotten"
    assert read_all_tags(store) == {} and not list(store.backend.list("forgetting/"))
    intents = []
    real_put = store.backend.put
    monkeypatch.setattr(store.backend, "put", lambda k, d: (intents.append(json.loads(d)), real_put(k, d))[1])
    plan_forget_names(store, ["s2"]).execute()
    assert len(intents) == 1  # a quick forget writes its intent once


def test_a_forget_without_room_for_its_intent_names_what_was_tagged_meanwhile(six, monkeypatch, caplog):
    from deltackpt.errors import DiskFullError

    store, _, _ = six
    plan = plan_forget_names(store, ["s0"])
    real_put, real_forget = store.backend.put, store.forget

    def put(key, data):
        if key.startswith("forgetting/"):
            raise DiskFullError(key)
        return real_put(key, data)

    def forget(names):  # a tag lands after forget listed the tags, and before s0's manifest goes
        set_tags(store, "s0", ["keep"])
        return real_forget(names)

    monkeypatch.setattr(store.backend, "put", put)
    monkeypatch.setattr(store, "forget", forget)
    assert plan.execute() == ["s0"]
    assert "no room for a forget's intent" in caplog.text
    assert "tagged while being forgotten without an intent, and removed: s0" in caplog.text
    assert read_all_tags(store) == {}
