"""Measuring helpers: peak RSS of a phase, directory sizes, page-cache handling, child processes' peak RSS.

Peak RSS of a phase (the method is reported with every number): Linux keeps a per-process high-water mark
(``VmHWM``) that ``echo 5 > /proc/self/clear_refs`` resets to the current RSS, so the phase's peak is exact:
reset before, read after. Where that is not allowed a thread polls RSS every millisecond (it can miss a
short spike). External programs (restic) run as children; their own peak is their ``VmHWM``, polled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

MiB = 1 << 20


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil

    return psutil.Process().memory_info().rss


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm, rss = _status_kib("VmHWM"), _status_kib("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 1024


class PeakRSS:
    """``with PeakRSS() as m: ...`` -> ``m.baseline``, ``m.peak`` (bytes), ``m.method``; ``m.overhead``."""

    def __init__(self, poll_interval_s: float = 0.001) -> None:
        self.poll_interval_s = poll_interval_s
        self.baseline = self.peak = self._polled = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakRSS":
        self.baseline = rss_bytes()
        if _reset_hwm():
            self.method = "VmHWM reset via clear_refs"
        else:
            self.method = f"RSS polled every {self.poll_interval_s * 1e3:g} ms"
            self._polled = self.baseline
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._polled = max(self._polled, rss_bytes())
            time.sleep(self.poll_interval_s)

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._polled, rss_bytes())
        else:
            self.peak = max((_status_kib("VmHWM") or 0) * 1024, rss_bytes())

    def add_child(self, child_peak_bytes: int) -> None:
        """Account a child that ran inside the phase while this process sat at about its baseline."""
        self.peak = max(self.peak, self.baseline + child_peak_bytes)

    @property
    def overhead(self) -> int:
        return max(0, self.peak - self.baseline)


def _child_hwm(pid: int, exe: str) -> int | None:
    """The child's VmHWM once it runs ``exe`` (before its exec it is a copy of us and must not count)."""
    try:
        if os.path.basename(os.readlink(f"/proc/{pid}/exe")) != exe:
            return None
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_child(cmd: list[str], env: dict | None = None, cwd: str | None = None,
              poll_interval_s: float = 0.005) -> tuple[str, int]:
    """Run ``cmd``; return (stdout, the child's peak RSS in bytes). Raises RuntimeError on failure.

    The peak is the child's own high-water mark (``VmHWM``), polled every ``poll_interval_s`` until it
    exits: ``wait4``'s ``ru_maxrss`` cannot be used, because it also counts the copy of this process the
    child was before its ``exec``.
    """
    import tempfile

    exe = os.path.basename(os.path.realpath(shutil.which(cmd[0]) or cmd[0]))
    peak = 0
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)
        while p.poll() is None:
            hwm = _child_hwm(p.pid, exe)
            if hwm is not None:
                peak = max(peak, hwm)
            time.sleep(poll_interval_s)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({p.returncode}): {stderr.strip()[-500:]}")
    return stdout, peak


def dir_usage(path: str | os.PathLike, exclude_top: tuple[str, ...] = ()) -> tuple[int, int]:
    """(apparent bytes, allocated bytes on disk) of every file under ``path``, skipping top-level entries
    named in ``exclude_top``."""
    root = Path(path)
    apparent = allocated = 0
    if not root.exists():
        return 0, 0
    for dirpath, dirs, files in os.walk(root):
        if Path(dirpath) == root:
            dirs[:] = [d for d in dirs if d not in exclude_top]
            files = [f for f in files if f not in exclude_top]
        for name in files:
            try:
                st = os.stat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return apparent, allocated


def dir_bytes(path: str | os.PathLike, exclude_top: tuple[str, ...] = ()) -> int:
    """Apparent size of every file under ``path`` (skipping top-level entries named in ``exclude_top``)."""
    return dir_usage(path, exclude_top)[0]


def drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def warm_tree(path: str | os.PathLike, block: int = 8 * MiB) -> int:
    """Read every file under ``path`` once, so each system's load starts from an equally warm page cache."""
    total = 0
    buf = bytearray(block)
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                    while n := f.readinto(buf):
                        total += n
            except OSError:
                pass
    return total
