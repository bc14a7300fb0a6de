"""Helpers shared by the benchmarks: RSS measurement, page-cache dropping, directory sizes, medians.

Peak RSS of one phase: Linux keeps a per-process high-water mark (``VmHWM`` in /proc/self/status) that
``echo 5 > /proc/self/clear_refs`` resets to the current RSS (Linux >= 4.0). So a phase's peak is measured
exactly by resetting the mark just before it and reading it just after. Where that is not allowed, a
thread polls RSS every millisecond instead (it can miss a short spike; the method used is reported).
"""

from __future__ import annotations

import os
import resource
import statistics

from deltackpt.bench.measure import PeakRSS, dir_usage, drop_page_cache, rss_bytes, warm_tree  # noqa: F401 (re-exported)

MiB = 1 << 20


def ru_maxrss_bytes() -> int:
    """Lifetime peak RSS of this process (getrusage; KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trim_heap() -> bool:
    """Return freed heap memory to the OS (glibc ``malloc_trim``), so RSS counts only live memory.

    Building a state dict (e.g. training steps) frees temporaries that glibc may keep resident; without a
    trim, a later phase could reuse them without raising RSS and its cost would be under-counted.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


read_tree = warm_tree  # the same helper as deltackpt bench's


def dir_size(path: str | os.PathLike, *, exclude_top: tuple[str, ...] = ()) -> tuple[int, int]:
    """(apparent bytes, allocated bytes on disk) of every file under ``path``; ``exclude_top``: names of
    top-level entries to skip (e.g. a cache folder)."""
    return dir_usage(path, exclude_top)


def median(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return statistics.median(vals)
