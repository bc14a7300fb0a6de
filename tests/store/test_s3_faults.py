"""Object storage under faults: an HTTP proxy in front of the moto server answers a share of the requests with
503 SlowDown / 500 InternalError, resets connections, cuts responses or stalls (tests/s3_faults.py). Saves,
loads and copies still complete bit-exact, or fail with one BackendError naming the object and the operation,
leaving no manifest and every earlier checkpoint intact; kill -9 mid-upload leaves the store clean."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from deltackpt.errors import BackendError
from deltackpt.store import Store
from deltackpt.store import repository as repository_mod
from deltackpt.store.copy import copy
from deltackpt.store.fsspec_backend import FsspecBackend
from deltackpt.store.progress import NullProgress
from deltackpt.store.verify import verify_store
from s3_faults import FaultProxy

from store_helpers import REPO_ROOT, assert_items_equal, subprocess_env

pytestmark = pytest.mark.timeout(120)

SIZES = dict(chunk_size_bytes=64 * 1024, pack_target_bytes=256 * 1024)  # 2 MiB: 32 chunks in ~8 packs
FAST = dict(max_attempts=12, backoff_s=0.01, max_backoff_s=0.05)  # at 25% faults, 0.25**12: 6e-8 per operation


@pytest.fixture
def proxy(s3_server, rng):
    p = FaultProxy(s3_server.port, seed=rng.seed)
    yield p
    p.stop()


def _options(s3_server, endpoint: str, read_timeout_s: float = 10) -> dict:
    return {**s3_server.storage_options, "endpoint_url": endpoint,
            "config_kwargs": {"connect_timeout": 5, "read_timeout": read_timeout_s}}


def _backend(s3_server, url: str, endpoint: str, **kwargs) -> FsspecBackend:
    read_timeout_s = kwargs.pop("read_timeout_s", 10)
    return FsspecBackend(url, _options(s3_server, endpoint, read_timeout_s), **{**FAST, **kwargs})


def _direct(s3_server, url: str, tmp_path, name: str = "direct") -> Store:
    """The store reached without the proxy (what really is on the server), with its own index cache."""
    return Store.open(FsspecBackend(url, s3_server.storage_options), cache_dir=tmp_path / f"cache-{name}")


def _state(rng, step: int, base: dict | None = None) -> dict:
    if base is None:
        return {"w": rng.standard_normal(1 << 19).astype(np.float32),  # 2 MiB
                "b": rng.standard_normal(1000).astype(np.float32), "meta": b'{"step": 0}'}
    w = base["w"].copy()
    w[rng.integers(0, w.size, 20_000)] += np.float32(0.5)
    return {**base, "w": w, "meta": f'{{"step": {step}}}'.encode()}


def _ok_puts(proxy: FaultProxy, folder: str) -> list[str]:
    """Object paths the server accepted a PUT of (single-part uploads), in order."""
    return [r.target.split("?", 1)[0] for r in proxy.log
            if r.method == "PUT" and r.status == 200 and f"/{folder}/" in r.target]


def _ok_put_bytes(proxy: FaultProxy, folder: str) -> int:
    """Body bytes of the PUTs the server accepted under ``folder``."""
    return sum(r.body_bytes for r in proxy.log if r.method == "PUT" and r.status == 200 and f"/{folder}/" in r.target)


def test_proxy_forwards_chunked_request_bodies_unchanged(s3_server, s3_url, proxy):
    # botocore sends Content-Length over http:// (aws-chunked with trailers only over https, which moto's
    # server does not decode); a client that chunks must get through byte for byte.
    bucket = s3_url[len("s3://"):].split("/")[0]
    chunks = [os.urandom(1000), os.urandom(70_000), b"x"]
    body = b"".join(b"%x\r\n" % len(c) + c + b"\r\n" for c in chunks) + b"0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(f"PUT /{bucket}/run/chunked HTTP/1.1\r\nHost: s3\r\nTransfer-Encoding: chunked\r\n"
                  "Connection: close\r\n\r\n".encode() + body)
        assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
    assert [(r.method, r.body_bytes, r.status) for r in proxy.log] == [("PUT", len(body), 200)]
    assert FsspecBackend(s3_url, s3_server.storage_options).get("chunked") == b"".join(chunks)


def test_save_and_load_commit_bit_exact_through_a_quarter_of_requests_failing(s3_server, s3_url, proxy, rng,
                                                                               tmp_path):
    proxy.set_faults(0.25, ("503", "500", "reset", "drop", "cut"))
    store = Store.init(_backend(s3_server, s3_url, proxy.endpoint), cache_dir=tmp_path / "cache", **SIZES)
    first = _state(rng, 0)
    second = _state(rng, 1, first)
    store.save("first", first)
    store.save("second", second)
    # A fresh reader (empty index cache: rebuilt from pack tables) through the same faults.
    reader = Store.open(_backend(s3_server, s3_url, proxy.endpoint), cache_dir=tmp_path / "cache-reader")
    assert [i.name for i in reader.list_checkpoints()] == ["first", "second"]
    assert_items_equal(first, reader.load("first"))
    assert_items_equal(second, reader.load("second"))
    assert len(store.list_checkpoints()) == 2
    assert proxy.total_injected > 20, proxy.injected
    assert all(proxy.injected[k] > 0 for k in ("503", "500", "reset", "drop", "cut")), proxy.injected
    proxy.clear()
    assert verify_store(_direct(s3_server, s3_url, tmp_path), level=2).ok


def test_reader_with_failing_and_stalled_gets_loads_bit_exact(s3_server, s3_url, proxy, rng, tmp_path):
    store = Store.init(_backend(s3_server, s3_url, proxy.endpoint), cache_dir=tmp_path / "cache", **SIZES)
    state = _state(rng, 0)
    store.save("one", state)
    # Stalls longer than the read timeout are timeouts, retried like the rest (none can hang the reader).
    proxy.set_faults(0.4, ("503", "500", "reset", "cut", "delay"), methods={"GET", "HEAD"}, delay_s=2.0)
    reader = Store.open(_backend(s3_server, s3_url, proxy.endpoint, read_timeout_s=0.5),
                        cache_dir=tmp_path / "cache-reader")
    assert_items_equal(state, reader.load("one"))
    assert proxy.total_injected >= 3, proxy.injected  # the load makes few requests (coalesced reads)
    assert all(r.method in ("GET", "HEAD") for r in proxy.log if r.fault)


def test_a_server_that_never_answers_is_a_bounded_backend_error(s3_server, s3_url, proxy, tmp_path):
    backend = _backend(s3_server, s3_url, proxy.endpoint, read_timeout_s=0.3, max_attempts=3)
    backend.put("x/obj", b"payload")
    proxy.set_faults(1.0, ("delay",), methods={"GET"}, delay_s=30, limit=2)  # two timeouts, then an answer
    assert backend.get("x/obj") == b"payload"
    assert proxy.injected["delay"] == 2
    proxy.set_faults(1.0, ("delay",), methods={"GET"}, delay_s=30)
    start = time.monotonic()
    with pytest.raises(BackendError) as e:
        backend.get("x/obj")
    assert time.monotonic() - start < 10
    assert e.value.operation == "GET" and e.value.key == "x/obj" and "after 3 attempts" in str(e.value)
    assert proxy.injected["delay"] == 2 + 3


def test_init_whose_conditional_put_response_is_lost_still_creates_the_store(s3_server, s3_url, proxy, tmp_path):
    # The server stores the config, the client never hears so and retries: If-None-Match then fails (412).
    proxy.set_faults(1.0, ("cut",), methods={"PUT"}, path="/config", limit=1)
    store = Store.init(_backend(s3_server, s3_url, proxy.endpoint), cache_dir=tmp_path / "cache", **SIZES)
    assert proxy.injected["cut"] == 1
    assert [r.status for r in proxy.log if r.method == "PUT" and "/config" in r.target] == [200, 412]
    assert _direct(s3_server, s3_url, tmp_path).config.store_id == store.config.store_id
    # Someone else's config is still a FileExistsError, after a lost response too.
    other = _backend(s3_server, s3_url, proxy.endpoint)
    proxy.set_faults(1.0, ("reset",), methods={"PUT"}, limit=1)
    with pytest.raises(FileExistsError):
        other.put_new("config", b"another store's config")


@pytest.mark.parametrize("when", ["manifest-put", "after-packs"])
def test_failing_commit_leaves_no_manifest_and_earlier_checkpoints_intact(s3_server, s3_url, proxy, rng, tmp_path,
                                                                          monkeypatch, when):
    store = Store.init(_backend(s3_server, s3_url, proxy.endpoint, max_attempts=4), cache_dir=tmp_path / "cache",
                       **SIZES)
    first = _state(rng, 0)
    store.save("first", first)
    second = _state(rng, 1, first)
    if when == "manifest-put":  # throttled on the commit point, every time
        proxy.set_faults(1.0, ("503",), methods={"PUT"}, path="/manifests/")
    else:  # every request fails once the packs are up: the commit's checks, the put, the clean-up, the unlock
        real = repository_mod.crash_point

        def fail_everything_after_packs(label):
            if label == "save:after-packs":
                proxy.set_faults(1.0, ("503", "500", "reset"))
            real(label)

        monkeypatch.setattr(repository_mod, "crash_point", fail_everything_after_packs)
    with pytest.raises(BackendError) as e:
        store.save("second", second)
    err = e.value
    assert err.operation in ("PUT", "HEAD", "GET", "LIST", "DELETE") and err.key, err
    assert err.key in str(err) and err.operation in str(err) and "\n" not in str(err)
    if when == "manifest-put":
        assert (err.operation, err.key) == ("PUT", "manifests/second")
    proxy.clear()
    monkeypatch.undo()
    direct = _direct(s3_server, s3_url, tmp_path)
    assert not direct.backend.exists("manifests/second")
    assert [i.name for i in direct.list_checkpoints()] == ["first"]
    assert_items_equal(first, direct.load("first"))
    assert verify_store(direct, level=2).ok
    # A rerun without faults commits (over the orphan packs of the failed one).
    store.save("second", second)
    assert_items_equal(second, _direct(s3_server, s3_url, tmp_path, "after").load("second"))


def _local_history(tmp_path, rng, n: int = 3, *, related: bool = True) -> tuple[Store, dict]:
    src = Store.init(tmp_path / "src", **SIZES)
    saved, state = {}, None
    for step in range(n):
        state = _state(rng, step, state if related else None)
        src.save(f"step-{step}", state)
        saved[f"step-{step}"] = state
    return src, saved


def _cli_verify(s3_server, url: str, tmp_path) -> dict:
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("AWS_")}
    env.update(s3_server.env, HOME=str(tmp_path), DELTACKPT_CACHE_DIR=str(tmp_path / "cli-cache"))
    r = subprocess.run([sys.executable, "-m", "deltackpt", "verify", url, "--level", "2", "--json"],
                       capture_output=True, text=True, timeout=90, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_copy_to_s3_through_a_flaky_proxy_verifies_clean(s3_server, s3_url, proxy, rng, tmp_path):
    src, saved = _local_history(tmp_path, rng)
    proxy.set_faults(0.25, ("503", "500", "reset", "drop", "cut"))
    dst = Store.init(_backend(s3_server, s3_url, proxy.endpoint), cache_dir=tmp_path / "cache", **SIZES)
    report = copy(src, dst, verify=True)
    assert report.copied == list(saved) and report.problems == []
    assert proxy.total_injected > 10, proxy.injected
    proxy.clear()
    out = _cli_verify(s3_server, s3_url, tmp_path)
    assert out["ok"] and out["problems"] == [] and out["damaged_checkpoints"] == []
    direct = _direct(s3_server, s3_url, tmp_path)
    for name, items in saved.items():
        assert_items_equal(items, direct.load(name))


def test_interrupted_copy_resumes_without_sending_anything_twice(s3_server, s3_url, proxy, rng, tmp_path):
    src, saved = _local_history(tmp_path, rng, related=False)  # every checkpoint brings several packs
    # The reference: the same copy, uninterrupted, into another bucket.
    ref = Store.init(_backend(s3_server, f"s3://{s3_server.new_bucket()}/run", s3_server.endpoint),
                     cache_dir=tmp_path / "cache-ref", **SIZES)
    copy(src, ref)
    ref_packs = {o.key.rsplit("/", 1)[-1]: o.size_bytes for o in ref.backend.list("packs/")}
    dst = Store.init(_backend(s3_server, s3_url, proxy.endpoint, max_attempts=3), cache_dir=tmp_path / "cache",
                     **SIZES)
    state = {"packs": 0, "phase": None}

    class DiesMidway(NullProgress):  # every request fails from the second pack of step-1 on
        def start(self, label, total, unit):
            state["phase"] = label

        def advance(self, n=1):
            if state["phase"] == "copy step-1":
                state["packs"] += 1
                if state["packs"] == 2:
                    proxy.set_faults(1.0, ("503", "reset"))

    with pytest.raises(BackendError):
        copy(src, dst, progress=DiesMidway())
    first_sent = _ok_put_bytes(proxy, "packs") + _ok_put_bytes(proxy, "manifests")
    proxy.clear()
    assert [i.name for i in _direct(s3_server, s3_url, tmp_path).list_checkpoints()] == ["step-0"]
    assert state["packs"] == 2 and len(_ok_puts(proxy, "packs")) > 2
    rerun = copy(src, Store.open(_backend(s3_server, s3_url, proxy.endpoint), cache_dir=tmp_path / "cache-2"))
    assert rerun.skipped == ["step-0"] and rerun.copied == ["step-1", "step-2"]
    puts = _ok_puts(proxy, "packs") + _ok_puts(proxy, "manifests")
    assert len(puts) == len(set(puts)), "an object was sent twice"
    assert first_sent + rerun.bytes_sent == _ok_put_bytes(proxy, "packs") + _ok_put_bytes(proxy, "manifests")
    # Every pack of the uninterrupted copy arrived once, over the two runs, and nothing else. (Manifests are
    # only counted: a resumed checkpoint's stats name the packs its own run sent, so its compressed manifest
    # may differ from the reference's by a few bytes.)
    sent_packs = {r.target.split("?", 1)[0].rsplit("/", 1)[-1]: r.body_bytes for r in proxy.log
                  if r.method == "PUT" and r.status == 200 and "/packs/" in r.target}
    assert sent_packs == ref_packs
    assert sorted(p.rsplit("/", 1)[-1] for p in _ok_puts(proxy, "manifests")) == ["step-0", "step-1", "step-2"]
    assert _cli_verify(s3_server, s3_url, tmp_path)["ok"]


CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from deltackpt.store import Store

    store = Store.open(sys.argv[1])  # the S3 endpoint and credentials come from the environment
    x = np.random.default_rng(7).standard_normal(12 << 20, dtype=np.float32)
    print("start", flush=True)
    store.save("big", {"w": x})
    print("committed", flush=True)
    """
)


def test_kill_9_mid_upload_leaves_committed_checkpoints_intact_and_a_rerun_commits(s3_server, s3_url, rng,
                                                                                    tmp_path):
    # Packs of 20 MiB: multipart uploads (8 MiB parts), so the kill lands inside one.
    store = Store.init(s3_url, storage_options=s3_server.storage_options, cache_dir=tmp_path / "cache",
                       chunk_size_bytes=1 << 20, pack_target_bytes=20 << 20)
    base = _state(rng, 0)
    store.save("base", base)
    base_packs = {i.key for i in store.backend.list("packs/")}
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("AWS_")}
    env.update(s3_server.env, HOME=str(tmp_path), DELTACKPT_CACHE_DIR=str(tmp_path / "child-cache"))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, s3_url], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while {i.key for i in store.backend.list("packs/")} == base_packs:  # the first pack of the new save
            if proc.poll() is not None:
                pytest.fail(f"child exited early: {proc.communicate()[1].decode()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("child wrote no pack within 60 s")
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    assert b"committed" not in out, "the kill came too late to test anything"
    direct = _direct(s3_server, s3_url, tmp_path)
    report = verify_store(direct, level=2)
    assert report.ok and report.problems == [] and report.damaged_checkpoints == [], report
    assert report.orphan_packs, "the killed save's first pack is there, unreferenced (gc removes it)"
    assert [i.name for i in direct.list_checkpoints()] == ["base"]
    assert_items_equal(base, direct.load("base"))
    x = np.random.default_rng(7).standard_normal(12 << 20, dtype=np.float32)
    direct.save("big", {"w": x})
    again = _direct(s3_server, s3_url, tmp_path, "again")
    assert [i.name for i in again.list_checkpoints()] == ["base", "big"]
    np.testing.assert_array_equal(again.load("big")["w"], x)
    assert_items_equal(base, again.load("base"))


def test_access_denied_is_one_line_not_retried_and_writes_nothing(s3_server, s3_url, proxy, tmp_path):
    proxy.set_faults(1.0, ("403",))
    backend = _backend(s3_server, s3_url, proxy.endpoint)
    with pytest.raises(BackendError, match="access denied") as ei:
        Store.init(backend)
    assert "\n" not in str(ei.value)
    assert proxy.injected["403"] == 1, "an access error is final, not retried"
    assert list(FsspecBackend(s3_url, s3_server.storage_options).list("")) == []
    env = {**s3_server.env, "AWS_ENDPOINT_URL": proxy.endpoint, "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "deltackpt", "ls", s3_url], capture_output=True, text=True,
                       timeout=60, env={**os.environ, **env})
    assert r.returncode == 3 and "access denied" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_host_that_missed_a_commit_catches_up_with_one_get_not_a_listing(s3_server, s3_url, proxy, rng, tmp_path):
    """Two hosts (caches of their own) save in turn into one bucket. The one whose cache missed the other's
    commit reads that commit's record, one GET, and lists no packs (a LIST per 1,000 packs, per host and
    save on a job of many hosts); it still deduplicates against the other's chunks."""
    url = s3_url
    a = Store.init(_backend(s3_server, url, proxy.endpoint), cache_dir=tmp_path / "cache-a", **SIZES)
    b = Store.open(_backend(s3_server, url, proxy.endpoint), cache_dir=tmp_path / "cache-b")
    s0 = _state(rng, 0)
    a.save("s0", s0)
    s1 = _state(rng, 1, s0)
    b.save("s1", s1)  # b's cache saw no commit before: it lists
    proxy.log.clear()
    m = a.save("s2", s1)
    assert m.stats.new_chunks == 0
    listings = [r.target for r in proxy.log if "list-type=2" in r.target]
    assert listings and not [t for t in listings if "packs" in t], listings
    records = [r.target for r in proxy.log if r.method == "GET" and "/commits/" in r.target]
    assert records == [f"/{url[len('s3://'):]}/commits/s1"]
    assert_items_equal(s1, b.load("s2"))


BIG = dict(chunk_size_bytes=1 << 20, pack_target_bytes=20 << 20)  # a 20 MiB pack: a multipart upload (8 MiB parts)


def test_a_multipart_pack_whose_completion_response_is_lost_is_saved(s3_server, s3_url, proxy, rng, tmp_path):
    """The server completes the upload, its answer is cut: s3fs aborts the upload, which then no longer exists
    (404 NoSuchUpload, a FileNotFoundError). The put is retried, not failed as a missing object."""
    store = Store.init(_backend(s3_server, s3_url, proxy.endpoint), cache_dir=tmp_path / "cache", **BIG)
    state = {"w": rng.standard_normal(6 << 20).astype(np.float32)}  # 24 MiB
    proxy.set_faults(1.0, ("cut",), methods={"POST"}, path="uploadId=", limit=1)
    store.save("big", state)
    assert proxy.injected["cut"] == 1
    direct = _direct(s3_server, s3_url, tmp_path)
    assert_items_equal(state, direct.load("big"))
    assert verify_store(direct, level=2).ok


def test_gc_aborts_unfinished_multipart_uploads_older_than_its_grace(s3_server, s3_url, rng, tmp_path):
    """A killed upload (or a completion and an abort that both failed) leaves parts that are billed and belong
    to no object: gc aborts them once they are older than its grace period, and no others."""
    from deltackpt.store.gc import plan_gc

    backend = FsspecBackend(s3_url, s3_server.storage_options)
    store = Store.init(backend, cache_dir=tmp_path / "cache", **SIZES)
    state = _state(rng, 0)
    store.save("s1", state)
    bucket, prefix, _ = backend.fs.split_path(backend.root)
    key = f"{prefix}/packs/ab/{'ab' * 16}"
    up = backend.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    backend.fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1,
                       Body=b"x" * (5 << 20))
    other = backend.fs.call_s3("create_multipart_upload", Bucket=bucket, Key="elsewhere/obj")  # not the store's
    assert [t for t, _ in backend.list_unfinished()] == [f"packs/ab/{'ab' * 16}?uploadId={up['UploadId']}"]
    # moto reports every upload as started in 2010: as S3 would, one started now is younger than the grace
    listed = backend.list_unfinished
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "list_unfinished", lambda: [(t, time.time() - 60) for t, _ in listed()])
        assert plan_gc(store).temp_files == []  # younger than the default grace period (an hour)
        assert len(plan_gc(store, grace_s=30).temp_files) == 1
    plan = plan_gc(store, grace_s=0)
    assert len(plan.temp_files) == 1
    assert plan.execute().removed_temp_files == 1
    left = backend.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert [u["UploadId"] for u in left] == [other["UploadId"]]
    # A policy that may not list multipart uploads: gc goes on without that housekeeping
    def refused():
        raise BackendError("LIST unfinished uploads: access denied", key="", operation="LIST")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "list_unfinished", refused)
        assert plan_gc(store, grace_s=0).temp_files == []
    assert_items_equal(state, Store.open(backend, cache_dir=tmp_path / "cache2").load("s1"))
    assert verify_store(Store.open(backend, cache_dir=tmp_path / "cache2"), level=2).ok


@pytest.mark.parametrize("folder", ["locks/", "tags/", "commits/", "manifests/", "packs/"])
def test_folder_marker_objects_are_not_keys_of_the_store(s3_server, s3_url, rng, tmp_path, folder):
    """Consoles ("Create folder"), FUSE mounts and Hadoop's s3a make empty objects named like a folder; a store
    lists none of them (a lock, tag or commit record named 'locks/' failed every save and gc)."""
    from deltackpt.store.gc import plan_gc

    backend = FsspecBackend(s3_url, s3_server.storage_options)
    store = Store.init(backend, cache_dir=tmp_path / "cache", **SIZES)
    bucket, prefix, _ = backend.fs.split_path(backend.root)
    backend.fs.call_s3("put_object", Bucket=bucket, Key=f"{prefix}/{folder}", Body=b"")
    assert [i.key for i in backend.list(folder)] == []
    state = _state(rng, 0)
    second = _state(rng, 1, state)
    store.save("s1", state)
    store.save("s2", second)
    store.forget(["s1"])
    plan_gc(store, grace_s=0).execute()
    assert_items_equal(second, Store.open(backend, cache_dir=tmp_path / "cache2").load("s2"))
    assert verify_store(Store.open(backend, cache_dir=tmp_path / "cache2"), level=2).ok


def test_a_400_on_a_get_is_retried_not_read_as_an_empty_object(s3_server, s3_url, proxy, rng, tmp_path):
    """s3fs maps a 400 (TokenRefreshRequired here) to EINVAL, as it maps the 416 of an empty object: such a GET
    read as b"" (no retry), so one transient 400 on the newest manifest made it look damaged and `latest`
    resolve to the checkpoint before it; a ranged read of a pack read as its end."""
    backend = FsspecBackend(s3_url + "-raw", _options(s3_server, proxy.endpoint), max_attempts=3, backoff_s=0.01)
    backend.put("manifests/x", b"not empty")
    backend.put("packs/ab/abcd", b"0123456789")
    proxy.set_faults(1.0, ("400",), methods={"GET"}, path="/manifests/x", limit=1)
    assert backend.get("manifests/x") == b"not empty"
    proxy.set_faults(1.0, ("400",), methods={"GET"}, path="/packs/", limit=1)
    assert backend.get_range("packs/ab/abcd", 2, 4) == b"2345"
    proxy.set_faults(1.0, ("400",), methods={"GET"}, path="/manifests/x")
    with pytest.raises(BackendError):
        backend.get("manifests/x")
    proxy.clear()
    backend.put("empty", b"")
    assert backend.get("empty") == b"" and backend.get_range("packs/ab/abcd", 10, 5) == b""
    store = Store.open_or_init(FsspecBackend(s3_url, _options(s3_server, proxy.endpoint), max_attempts=3,
                                             backoff_s=0.01), cache_dir=tmp_path / "cache", **SIZES)
    store.save("step-1", {"w": rng.standard_normal(1000).astype(np.float32)})
    store.save("step-2", {"w": rng.standard_normal(1000).astype(np.float32)})
    before = proxy.injected["400"]
    proxy.set_faults(1.0, ("400",), methods={"GET"}, path="/manifests/step-2", limit=1)
    assert store.resolve("latest", fallback=True) == "step-2"
    assert proxy.injected["400"] == before + 1


@pytest.mark.parametrize("size", [1000, 3 * 1024 * 1024, 20 * 1024 * 1024, "refreshed"],
                         ids=["small", "one-part", "multipart", "after-a-client-refresh"])
def test_a_put_to_a_server_that_stops_answering_is_a_bounded_backend_error(s3_server, s3_url, proxy, size):
    """botocore sent every PUT with ``Expect: 100-continue`` and aiohttp waits for the 100 with no timeout: a
    server that accepted the connection and then never answered hung a save (and a close waiting on its
    upload) for good. Now the read timeout bounds each attempt, as for a GET, also once s3fs has made its
    session and client again (a refresh for new credentials)."""
    import threading

    backend = _backend(s3_server, s3_url, proxy.endpoint, read_timeout_s=0.5, max_attempts=2)
    backend.put("x/warm", b"payload")  # (the client's connection and credentials, before the stall)
    if size == "refreshed":
        backend.fs.connect(refresh=True)
        size = 1000
    proxy.set_faults(1.0, ("stall",), methods={"PUT", "POST"})
    for op in ("put", "put_new"):
        outcome = {}

        def attempt():
            try:
                getattr(backend, op)(f"x/{op}", b"x" * size)
                outcome["result"] = "returned"
            except BaseException as e:  # noqa: BLE001 - the test looks at it
                outcome["result"] = e

        start = time.monotonic()
        t = threading.Thread(target=attempt, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), f"{op} of {size} bytes still blocked after 30 s"
        assert isinstance(outcome["result"], BackendError), outcome["result"]
        assert time.monotonic() - start < 20
    assert proxy.injected["stall"] >= 4


def test_a_conditional_put_refused_without_naming_its_condition_is_an_existing_key(s3_server, s3_url, proxy):
    """A 412 whose body does not name If-None-Match (MinIO and other S3-compatible servers) was retried as a
    transient error: a second save of a name failed with BackendError instead of FileExistsError, and one
    whose first response was lost failed although the server had its manifest."""
    backend = _backend(s3_server, s3_url, proxy.endpoint, max_attempts=4)
    proxy.set_faults(1.0, ("bare412",), methods={"PUT"})
    backend.put_new("x/once", b"mine")
    with pytest.raises(FileExistsError):
        backend.put_new("x/once", b"someone else's")
    backend.put_new("x/once", b"mine")  # a resend of our own (its response lost): done
    statuses = [r.status for r in proxy.log if r.method == "PUT" and r.target.endswith("/x/once")]
    assert statuses == [200, 412, 412]  # each refusal answered once, not retried


def test_a_session_the_caller_passes_in_keeps_its_other_clients_as_they_were(s3_server, s3_url):
    """Dropping ``Expect`` is deltackpt's business: it was registered on a session passed in storage options,
    and every S3 client the application then made from it lost the header too."""
    import asyncio
    import io

    import aiobotocore.session

    async def expect_header_of_an_app_put(session) -> list:
        seen = []
        async with session.create_client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1",
                                          aws_access_key_id="testing", aws_secret_access_key="testing") as c:
            c.meta.events.register("before-send.s3.PutObject",
                                   lambda request, **_: seen.append(request.headers.get("Expect")))
            await c.put_object(Bucket=s3_url.split("/")[2], Key="app/x", Body=io.BytesIO(b"z" * 1000))
        return seen

    session = aiobotocore.session.AioSession()
    assert asyncio.run(expect_header_of_an_app_put(session)) == [b"100-continue"]
    backend = FsspecBackend(s3_url, {**s3_server.storage_options, "session": session})
    backend.put("x/obj", b"payload")
    assert backend.get("x/obj") == b"payload"
    assert asyncio.run(expect_header_of_an_app_put(session)) == [b"100-continue"]
