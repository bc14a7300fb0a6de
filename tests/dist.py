"""Multi-process test harness: run a function on N gloo ranks with a hard timeout.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` fresh interpreters (``spawn`` start method, so no
state leaks from the pytest process), joins them into one gloo process group through a rendezvous *file*
(no TCP ports to pick or collide on), calls ``fn(rank, world_size, *args)`` on each and returns the list of
return values ordered by rank.

``fn`` must be a module-level function of an importable module (the test module itself is fine: pytest puts
its directory on ``sys.path`` and spawned children inherit ``sys.path``). Arguments and return values travel
by pickle; return values are pickled with the plain pickler inside the child, so tensors come back by value
(not through shared memory tied to a process that is about to exit).

Failure reporting:

* a rank that raises sends its formatted traceback; ``run_ranks`` raises ``AssertionError`` containing the
  traceback of every failed rank (after giving the other ranks a short grace period to finish or fail too,
  then killing them: ranks blocked in a collective with a dead peer would otherwise wait for the PG timeout);
* a rank that exits without reporting (segfault, ``os._exit``) is reported with its exit code;
* past ``timeout`` seconds every child (and its own children: each rank runs in its own process group, so
  e.g. DCP's async ``PROCESS`` checkpointer workers die too) is killed with SIGKILL and ``TimeoutError``
  names the ranks that had not finished.

Children get ``OMP_NUM_THREADS=1`` (and ``torch.set_num_threads(1)``) plus whatever ``env`` adds; they are
not daemonic, because a daemonic process may not start children of its own.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

__all__ = ["run_ranks", "full_tree", "assert_tree_equal", "tree_nbytes"]

# Seconds the surviving ranks get to report after one rank failed, before they are killed.
FAILURE_GRACE_S = 10.0


def _child_main(fn: Callable, rank: int, world_size: int, init_file: str, args: tuple, results) -> None:
    # Own process group: lets the parent kill this rank together with anything it spawned.
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    status, payload = "err", ""
    dist = None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        value = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            status = "ok"
        except Exception:
            payload = (
                f"rank {rank}: return value of {getattr(fn, '__qualname__', fn)!r} is not picklable:\n"
                + traceback.format_exc()
            )
    except BaseException:  # noqa: BLE001 - report everything, incl. DCP's CheckpointException(BaseException)
        payload = f"rank {rank}:\n" + traceback.format_exc()
    results.put((rank, status, payload))
    try:
        if dist is not None and dist.is_initialized():
            if status == "ok":
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        pass
    # Flush the queue's feeder thread before exiting so the parent always gets the message.
    results.close()
    results.join_thread()


def _kill(proc) -> None:
    if not proc.is_alive():
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the rank and its children (it called setpgid(0, 0))
    except (ProcessLookupError, PermissionError, OSError):
        pass
    try:
        proc.kill()
    except Exception:  # noqa: BLE001
        pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120, env: dict | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    tmpdir = tempfile.mkdtemp(prefix="deltackpt-dist-")
    init_file = os.path.join(tmpdir, "rendezvous")
    results = ctx.Queue()
    procs = []
    child_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    saved = {k: os.environ.get(k) for k in child_env}
    try:
        # spawn copies os.environ at start time; set the children's variables only around the starts.
        os.environ.update({k: str(v) for k, v in child_env.items()})
        try:
            for rank in range(world_size):
                p = ctx.Process(
                    target=_child_main,
                    args=(fn, rank, world_size, init_file, tuple(args), results),
                    name=f"rank{rank}",
                    daemon=False,
                )
                p.start()
                procs.append(p)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

        start = time.monotonic()
        deadline = start + timeout
        done: dict[int, tuple[str, Any]] = {}
        first_failure_at = None
        exited_at: dict[int, float] = {}
        while len(done) < world_size:
            now = time.monotonic()
            limit = deadline
            if first_failure_at is not None:
                limit = min(limit, first_failure_at + FAILURE_GRACE_S)
            if now >= limit:
                break
            try:
                rank, status, payload = results.get(timeout=min(0.2, max(0.01, limit - now)))
                done[rank] = (status, payload)
                if status != "ok" and first_failure_at is None:
                    first_failure_at = time.monotonic()
                continue
            except queue_mod.Empty:
                pass
            # A rank that died without reporting (crash, os._exit): give its message 2 s to arrive.
            for r, p in enumerate(procs):
                if r not in done and not p.is_alive():
                    exited_at.setdefault(r, time.monotonic())
                    if time.monotonic() - exited_at[r] > 2.0:
                        done[r] = ("died", f"rank {r}: exited with code {p.exitcode} without reporting a result")
                        if first_failure_at is None:
                            first_failure_at = time.monotonic()
        elapsed = time.monotonic() - start
        pending = [r for r in range(world_size) if r not in done]
        for p in procs:
            if pending or any(s != "ok" for s, _ in done.values()):
                _kill(p)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                _kill(p)
                p.join(timeout=5)

        failures = {r: payload for r, (status, payload) in sorted(done.items()) if status != "ok"}
        if failures:
            msg = [f"{len(failures)} of {world_size} ranks failed in {getattr(fn, '__qualname__', fn)}:"]
            for r, tb in failures.items():
                msg.append(f"---------------- rank {r} ----------------\n{tb}")
            if pending:
                msg.append(f"ranks {pending} had not finished {FAILURE_GRACE_S:.0f} s later and were killed")
            raise AssertionError("\n".join(msg))
        if pending:
            raise TimeoutError(
                f"{getattr(fn, '__qualname__', fn)}: ranks {pending} of {world_size} hung "
                f"(no result after {elapsed:.1f} s, timeout={timeout} s); all ranks were killed"
            )
        return [pickle.loads(done[r][1]) for r in range(world_size)]
    finally:
        for p in procs:
            _kill(p)
            if p.is_alive():
                p.join(timeout=5)
        results.close()
        results.cancel_join_thread()
        shutil.rmtree(tmpdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# State-dict helpers shared by the distributed tests (torch is imported lazily: the harness itself is
# torch-free until a child starts).
# ---------------------------------------------------------------------------------------------------------
def full_tree(obj):
    """A deep copy of a state-dict tree with every tensor as a plain, contiguous CPU tensor.

    DTensors become their full tensor (``full_tensor()`` is a collective: every rank of the DTensor's mesh
    must call ``full_tree`` on the same tree in the same order). Tuples stay tuples, lists lists.
    """
    import torch

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        from torch.distributed._tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor().detach().cpu().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: full_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [full_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(full_tree(v) for v in obj)
    return obj


def assert_tree_equal(actual, expected, path: str = "$") -> int:
    """Assert two state-dict trees are identical: same keys, bit-exact tensors (dtype, shape, values).

    Tensors must already be plain (see :func:`full_tree`). Returns the number of tensors compared, so
    callers can check the comparison was not vacuous.
    """
    import torch

    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        if not torch.equal(actual, expected):
            # NaN-aware bitwise comparison for floats; torch.equal treats NaN != NaN.
            same_bits = (
                actual.is_floating_point()
                and actual.element_size() in (2, 4, 8)
                and torch.equal(_bits(actual), _bits(expected))
            )
            if not same_bits:
                diff = (actual != expected).sum().item()
                raise AssertionError(f"{path}: tensor values differ ({diff} of {expected.numel()} elements)")
        return 1
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected a dict, got {type(actual).__name__}"
        assert set(actual) == set(expected), (
            f"{path}: keys differ: missing {sorted(map(str, set(expected) - set(actual)))}, "
            f"unexpected {sorted(map(str, set(actual) - set(expected)))}"
        )
        return sum(assert_tree_equal(actual[k], expected[k], f"{path}[{k!r}]") for k in expected)
    if isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        return sum(assert_tree_equal(a, e, f"{path}[{i}]") for i, (a, e) in enumerate(zip(actual, expected)))
    assert type(actual) is type(expected) and actual == expected, f"{path}: {actual!r} != {expected!r}"
    return 0


def _bits(t):
    import torch

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def tree_nbytes(obj) -> int:
    """Total bytes of the (plain) tensors in a tree."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tree_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tree_nbytes(v) for v in obj)
    return 0
