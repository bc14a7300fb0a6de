"""Progress in the CLI: a bar on stderr when it is a terminal, nothing when it is piped or with --json, and
stdout the same either way."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import numpy as np
import pytest

from deltackpt.cli import main
from deltackpt.cli.output import ProgressBar as _progress
from deltackpt.store import Store
from deltackpt.store import index as index_mod
from deltackpt.store.progress import Progress

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(chunk_size_bytes=4096, pack_target_bytes=65536, cdc_min_bytes=256, cdc_avg_bytes=1024,
             cdc_max_bytes=4096)


@pytest.fixture
def store_path(tmp_path):
    """Three checkpoints, the middle one forgotten: gc has packs to delete."""
    root = tmp_path / "store"
    store = Store.init(root, **SMALL)
    for i in range(3):
        store.save(f"s{i}", {"x": np.random.default_rng(i).standard_normal(20000).astype(np.float32)})
    store.forget(["s1"])
    index_mod._close_env(root / "cache" / "index.lmdb")
    return root


def test_the_renderer_is_a_progress_and_off_without_a_terminal(capsys):
    args = type("Args", (), {"json": False})()
    assert isinstance(_progress(args), Progress)
    with _progress(args) as progress:  # stderr is captured here, not a terminal: the null progress
        progress.start("verify", 10, "pack")
        progress.advance(10)
        progress.done()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv", [["verify", "--level", "2"], ["index", "rebuild"], ["repair"],
                                  ["gc", "--grace", "0"], ["copy", "--all", "--verify"]])
def test_piped_long_commands_print_no_progress(store_path, tmp_path, capsys, argv):
    where = [str(store_path)] + ([str(tmp_path / "copy")] if argv[0] == "copy" else [])
    head = argv[:2] if argv[0] == "index" else argv[:1]
    code = main([*head, *where, *argv[len(head):]])
    out, err = capsys.readouterr()
    assert code == 0 and out.strip() and err == ""


def _run(argv: list[str], tty: bool, timeout: float = 120) -> tuple[int, str, str]:
    """Run the CLI in a subprocess, its stderr a pseudo-terminal (``tty``) or a pipe: (code, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "deltackpt", *argv]
    if not tty:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO_ROOT)
        return p.returncode, p.stdout, p.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: every holder of the terminal's other end has closed it
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env,
                             cwd=REPO_ROOT)
        os.close(slave)
        out, _ = p.communicate(timeout=timeout)
        reader.join(10)
    finally:
        os.close(master)
    return p.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def _same_but_time(text: str) -> str:
    return re.sub(r"\d+\.\d+ ?s\b", "T", text)


def test_a_terminal_shows_a_bar_on_stderr_and_stdout_is_unchanged(store_path):
    argv = ["verify", str(store_path), "--level", "2"]
    code, piped_out, piped_err = _run(argv, tty=False)
    assert code == 0 and piped_err == ""
    code, out, err = _run(argv, tty=True)
    assert code == 0
    assert "verify level 2" in err and "%|" in err  # the bar of the pack phase, drawn on the terminal
    assert _same_but_time(out) == _same_but_time(piped_out) and "\r" not in out


def test_a_terminal_with_json_shows_no_bar(store_path):
    code, out, err = _run(["gc", str(store_path), "--grace", "0", "--json"], tty=True)
    assert code == 0 and '"deleted_packs"' in out and err == ""
