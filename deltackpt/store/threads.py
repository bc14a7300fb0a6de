"""How many threads the read and write paths use, from the cores this process may run on.

Measured choices (the docstrings give the numbers); the pools themselves belong to their users.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

from . import cachedir
from .backend import local_root

T = TypeVar("T")
R = TypeVar("R")

REMOTE_READ_THREADS = 8
# Pack tables read at once from object storage (a ranged GET each, which waits on the network): an empty cache
# indexed 1,000 packs through a proxy adding 20 ms a request in 27.9 s one at a time, 4.3 s 16 at once (then
# bound by this machine's 2 cores; benchmarks/bench_catch_up.py).
REMOTE_TABLE_THREADS = 16


def table_read_threads(backend) -> int:
    """Pack tables to read at once from ``backend``: REMOTE_TABLE_THREADS where each read waits on the network
    (object storage, a file system several hosts mount: NFS, Lustre, ...), else one (a local disk's page
    cache answers at memory speed and a pool only adds contention)."""
    root = local_root(backend)
    return REMOTE_TABLE_THREADS if root is None or cachedir.on_shared_filesystem(root) else 1


def default_read_threads(cold: bool = False, remote: bool = False) -> int:
    """Threads for reading chunks: one per core when the data is in the page cache (more only contend for
    the GIL), twice that when reads wait on the device (at most 8), REMOTE_READ_THREADS from object storage
    (requests wait on the network, whatever the cores). Measured on 2 cores, a 235 MiB load: warm 0.143 s
    with 2 threads vs 0.165 s with 4; cold 0.338 s with 2 vs 0.291 s with 4."""
    if remote:
        return REMOTE_READ_THREADS
    cores = usable_cores()
    return max(1, min(8, 2 * cores if cold else cores))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the platform tells)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def default_write_threads(processes: int = 1) -> int:
    """Coding threads for one writer when ``processes`` writers (ranks) share this machine's cores: its share
    of them, at least one, at most 8. More only contend: 2 and 3 FSDP ranks on 2 cores saved changed
    checkpoints 1.19-1.24x and 1.18-1.21x DCP's time with 1 thread per rank, 1.24-1.36x and 1.26-1.29x with 2
    (two runs each of the reshard bench's ranks)."""
    cores = usable_cores()
    return max(1, min(8, cores // max(1, processes)))


class InlineExecutor:
    """The executor interface, running each job in the caller's thread (a writer with one coding thread)."""

    def submit(self, fn) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn())
        except Exception as e:  # surfaced by finish(), as a pool's would be
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def ordered_map(fn: Callable[[T], R], items: Iterable[T], threads: int) -> Iterator[R]:
    """``map(fn, items)`` with up to ``threads`` calls in flight, results in the order of ``items`` (an
    exception is raised where its item's result would be). At most ``2 * threads`` results wait at once."""
    if threads <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="deltackpt-map") as pool:
        it = iter(items)
        window: deque[Future] = deque()
        for item in it:
            window.append(pool.submit(fn, item))
            if len(window) >= 2 * threads:
                break
        while window:
            done = window.popleft()
            for item in it:
                window.append(pool.submit(fn, item))
                break
            yield done.result()
