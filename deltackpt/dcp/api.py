"""``deltackpt.save`` / ``load`` / ``async_save``: thin wrappers that build the writer or reader for DCP.

DCP wraps every rank's error in ``CheckpointException``, a ``BaseException`` that ``except Exception`` does
not catch; these wrappers raise the typed error instead (see :func:`unwrap`).
"""

from __future__ import annotations

import threading
import traceback
import warnings
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Callable, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ..errors import DeltackptError
from ..store import LATEST
from .planner import DeltaSavePlanner, PlainLoadPlanner
from .reader import DeltaStorageReader
from .staging import StagingBuffers
from .writer import DeltaStorageWriter

T = TypeVar("T")


def default_planner(state_dict, replica_check: str = "raise") -> DeltaSavePlanner:
    """The planner a save uses unless given one: replicas compared (unless ``replica_check`` is "off"), but not
    the buffers of a top-level ``TrainState`` (anything with ``buffer_keys()``: BatchNorm's running stats are
    each rank's own)."""
    return DeltaSavePlanner(unchecked=[f"{key}.{name}" for key, value in state_dict.items()
                                       if callable(getattr(value, "buffer_keys", None))
                                       for name in value.buffer_keys()],
                            digests=replica_check != "off")


def unwrap(exc: BaseException) -> BaseException:
    """The typed error behind DCP's ``CheckpointException``; any other exception is returned as is.

    The error chosen is the lowest rank's deltackpt error, else the lowest rank's error. It carries
    ``rank_errors`` (rank -> that rank's error) and notes naming its rank and the other ranks' errors::

        try:
            dcp.save(state, storage_writer=deltackpt.DeltaStorageWriter(store, "step-100"))
        except CheckpointException as e:
            raise deltackpt.unwrap(e) from None
    """
    if not isinstance(exc, CheckpointException):
        return exc
    errors = {rank: unwrap(f[0] if isinstance(f, tuple) else f) for rank, f in sorted(exc.failures.items())}
    if not errors:
        return exc
    rank = next((r for r, e in errors.items() if isinstance(e, DeltackptError)), next(iter(errors)))
    err = errors[rank]
    if "rank_errors" in vars(err):
        return err  # unwrapped before (the same exception object is shared by every rank's entry)
    err.rank_errors = errors
    failure = exc.failures[rank]
    if err.__traceback__ is None and isinstance(failure, tuple) and failure[1]:
        err.add_note(f"raised on rank {rank}:\n" + "".join(traceback.format_list(failure[1])).rstrip())
    else:
        err.add_note(f"raised on rank {rank}")
    others = [f"rank {r}: {type(e).__name__}: {e}" for r, e in errors.items() if r != rank]
    if others:
        err.add_note("other ranks failed too:\n  " + "\n  ".join(others))
    return err


def typed_call(call: Callable[[], T]) -> T:
    """Run a DCP call; its CheckpointException is raised as the typed error (outside the handler, so the
    error keeps its own context instead of the wrapper's)."""
    try:
        return call()
    except CheckpointException as e:
        err = unwrap(e)
    raise err


def typed_future(fut: Future) -> Future:
    """A future that settles like ``fut``, with its CheckpointException unwrapped."""
    out: Future = Future()

    def settle(done: Future) -> None:
        if done.cancelled():
            out.cancel()
            return
        exc = done.exception()
        if exc is None:
            out.set_result(done.result())
        else:
            out.set_exception(unwrap(exc))

    fut.add_done_callback(settle)
    return out


def save(state_dict: dict[str, Any], store, checkpoint_id: str, *, process_group=None, planner=None,
         overwrite: bool = False, metadata: dict[str, Any] | None = None, no_dist: bool = False,
         storage_options: dict | None = None, replica_check: str = "raise"):
    """``dcp.save`` into checkpoint ``checkpoint_id`` of ``store`` (a path, URL or Store); returns DCP's Metadata.
    ``replica_check``: what the save does when replicas of a tensor differ across ranks (DeltaStorageWriter)."""
    writer = DeltaStorageWriter(store, checkpoint_id, overwrite=overwrite, metadata=metadata,
                                storage_options=storage_options, replica_check=replica_check)
    planner = planner or default_planner(state_dict, replica_check)
    with quiet_single_process(), aborted_on_failure(writer):
        return typed_call(lambda: dcp.save(state_dict, storage_writer=writer, planner=planner,
                                           process_group=process_group, no_dist=no_dist))


def load(state_dict: dict[str, Any], store, checkpoint_id: str = LATEST, *, process_group=None, planner=None,
         no_dist: bool = False, fallback: bool = False, storage_options: dict | None = None) -> str:
    """``dcp.load`` checkpoint ``checkpoint_id`` (default: the newest) in place; returns its name.

    A missing checkpoint raises CheckpointNotFoundError, a damaged manifest CorruptManifestError, on every
    rank before any collective. ``fallback``: ``latest`` skips a newest checkpoint whose manifest is damaged.
    """
    reader = DeltaStorageReader(store, checkpoint_id, fallback=fallback, storage_options=storage_options)
    with quiet_single_process():
        typed_call(lambda: dcp.load(state_dict, storage_reader=reader, planner=planner or PlainLoadPlanner(),
                                    process_group=process_group, no_dist=no_dist))
    return reader.checkpoint_id


def async_save(state_dict: dict[str, Any], store, checkpoint_id: str, *,
               async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
               process_group=None, planner=None, overwrite: bool = False,
               metadata: dict[str, Any] | None = None, storage_options: dict | None = None,
               staging: StagingBuffers | None = None, replica_check: str = "raise") -> Future:
    """``dcp.async_save`` into ``store``; returns a future whose error is the typed one. The state is copied
    before this returns.

    ``staging``: pass the same :class:`StagingBuffers` to every call to copy into one set of buffers instead of
    allocating a new copy each time (a call first waits for the previous save that uses them); ``close()`` it
    after the last save. ``replica_check`` as for :func:`save`.
    """
    writer = DeltaStorageWriter(store, checkpoint_id, overwrite=overwrite, metadata=metadata,
                                storage_options=storage_options, staging=staging, replica_check=replica_check)
    planner = planner or default_planner(state_dict, replica_check)
    with quiet_single_process(), aborted_on_failure(writer):
        fut = one_process_save_at_a_time(async_checkpointer_type, lambda: typed_call(lambda: dcp.async_save(
            state_dict, storage_writer=writer, planner=planner, process_group=process_group,
            async_checkpointer_type=async_checkpointer_type)))
    abort_on_failure(writer, fut)
    if staging is not None:
        staging.hold_until(fut)
    return typed_future(fut)


_PROCESS_SAVES = threading.Lock()
# Set when this process's newest PROCESS-mode save has finished (an event, not its future: a failed future's
# traceback holds the staged copy of the state until the next save).
_last_process_save: list = [None]


def one_process_save_at_a_time(kind: AsyncCheckpointerType, start):
    """``start()`` (a ``dcp.async_save``), after this process's previous PROCESS-mode save has finished when
    ``kind`` is PROCESS. DCP runs every PROCESS-mode save of a process through one checkpoint process and one
    pipe, which it does not guard: two at once (a second CheckpointManager for an EMA copy) read each other's
    replies, and both failed. Its checkpoint process serves one save at a time anyway."""
    if kind != AsyncCheckpointerType.PROCESS:
        return start()
    with _PROCESS_SAVES:
        previous = _last_process_save[0]
        if previous is not None:
            previous.wait()  # (its outcome is its caller's to collect)
        fut = start()
        done = threading.Event()
        fut.add_done_callback(lambda _f: done.set())
        _last_process_save[0] = done
        return fut


@contextmanager
def aborted_on_failure(writer: DeltaStorageWriter):
    """Release ``writer``'s store lock when the save in this block fails (DCP tells the writer nothing when
    another rank's write fails)."""
    try:
        yield
    except BaseException:
        writer.abort()
        raise


def abort_on_failure(writer: DeltaStorageWriter, fut: Future) -> None:
    """aborted_on_failure for an async save's future."""
    fut.add_done_callback(lambda f: (f.cancelled() or f.exception() is not None) and writer.abort())


@contextmanager
def quiet_single_process():
    """Without a process group, silence DCP's "assuming the intent is to save/load in a single process"
    warning, which it repeats on every call (a single process is what our caller asked for). The filter stays
    for the process: an async save warns from DCP's background thread, after this context has exited."""
    global _quieted
    if not _quieted and not (dist.is_available() and dist.is_initialized()):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        _quieted = True
    yield


_quieted = False
