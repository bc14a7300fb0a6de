"""The CLI on object storage: a process configured only by the standard AWS environment reaches the S3 server
(started by the test on 127.0.0.1); copy, ls, show, verify, forget, gc on an s3:// URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from deltackpt.store import Store


def _cli(env, *args):
    r = subprocess.run([sys.executable, "-m", "deltackpt", *args, "--json"], capture_output=True, text=True,
                       timeout=120, env=env)
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else None), r.stderr


def test_cli_copy_and_maintenance_on_s3_with_environment_only(tmp_path, s3_server, s3_url):
    src = Store.init(tmp_path / "src", chunk_size_bytes=4096, pack_target_bytes=65536)
    rng = np.random.default_rng(0)
    w = rng.standard_normal(40_000).astype(np.float32)
    for step in range(3):
        w = w.copy()
        w[step * 100:(step + 1) * 100] += 1
        src.save(f"step-{step}", {"w": w}, metadata={"step": step})
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env, HOME=str(tmp_path))  # no ~/.aws, no storage options: the environment only

    code, out, err = _cli(env, "copy", str(tmp_path / "src"), s3_url, "--all", "--verify")
    assert code == 0, err
    assert out["copied"] == ["step-0", "step-1", "step-2"] and out["problems"] == []
    code, out, err = _cli(env, "ls", s3_url)
    assert code == 0, err
    assert [c["name"] for c in out] == ["step-0", "step-1", "step-2"]
    code, out, err = _cli(env, "verify", s3_url, "--level", "2")
    assert code == 0 and out["ok"], err
    code, out, err = _cli(env, "forget", s3_url, "--keep-last", "1")
    assert code == 0, err
    code, out, err = _cli(env, "gc", s3_url, "--grace", "0")
    assert code == 0, err
    remote = Store.open(s3_url, storage_options=s3_server.storage_options)
    np.testing.assert_array_equal(remote.load("latest")["w"], w)
    assert [i.name for i in remote.list_checkpoints()] == ["step-2"]


def test_missing_bucket_and_unknown_scheme_are_one_line_errors(tmp_path, s3_server):
    env = {**os.environ, **s3_server.env, "HOME": str(tmp_path)}
    for url in ("s3://no-such-bucket-here/run", "zz://x/y"):
        r = subprocess.run([sys.executable, "-m", "deltackpt", "ls", url], capture_output=True, text=True,
                           timeout=60, env=env)
        assert r.returncode == 3, (url, r.stderr)
        assert ("bucket does not exist" if url.startswith("s3") else "unknown storage scheme") in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "deltackpt", "init", "s3://no-such-bucket-here/run"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 3 and "bucket" in r.stderr, r.stderr


def test_copy_between_two_object_stores_takes_options_per_side(tmp_path, s3_server, capsys):
    """A run moved between two clusters' object stores, each with its own endpoint and credentials: copy's
    --src-storage-option / --dst-storage-option replace --storage-option for their side."""
    from deltackpt import cli

    opts = s3_server.storage_options
    src_url, dst_url = (f"s3://{s3_server.new_bucket()}/run" for _ in range(2))
    src = Store.init(src_url, storage_options=opts, chunk_size_bytes=4096)
    w = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    src.save("step-1", {"w": w})

    def side(flag):
        return [f"{flag}=endpoint_url={opts['endpoint_url']}", f"{flag}=key=testing", f"{flag}=secret=testing"]

    # The shared options name an option no client knows: used on either side, the copy would fail.
    args = ["copy", src_url, dst_url, "--all", "--json", f"--storage-option=endpoint_url={opts['endpoint_url']}",
            "--storage-option=profile_nme=x",
            *side("--src-storage-option"), *side("--dst-storage-option")]
    assert cli.main(args) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["copied"] == ["step-1"]
    np.testing.assert_array_equal(Store.open(dst_url, storage_options=opts).load("step-1")["w"], w)
    assert cli.main(args[:7] + side("--dst-storage-option")) == 3  # the source then takes the shared ones
    assert "profile_nme" in capsys.readouterr().out
    assert cli.main(["copy", src_url, str(tmp_path / "local"), "--all", *side("--src-storage-option"),
                     "--dst-storage-option=key=x"]) == 2  # a local destination takes no options
    assert "--dst-storage-option applies to a URL" in capsys.readouterr().err
