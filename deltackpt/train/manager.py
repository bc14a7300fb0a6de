"""CheckpointManager: when to save, how to resume, what to keep.

    state = TrainState(model=model, optimizer=optim, scheduler=sched, dataloader=loader)
    with CheckpointManager("ckpts", state, every_n_steps=100, keep_last=3, async_mode="thread") as mgr:
        start = mgr.restore_latest()          # 0 on a fresh store
        for step in range(start + 1, total + 1):
            train_step()
            state.step = step
            mgr.maybe_save(step)

Checkpoints are named by step (``step-00000100``). ``restore_latest`` loads the newest checkpoint whose data
reads back intact (every chunk is re-hashed on load) and falls back to older ones, logging why; a store
whose checkpoints are all damaged raises instead of silently restarting from step 0. With async saving a
save first waits for the previous one, and a background failure is raised at the next call, never lost.
"""

from __future__ import annotations

import logging
import re
import string
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.tensor import DTensor

from ..dcp.api import abort_on_failure, aborted_on_failure, one_process_save_at_a_time
from ..dcp.planner import PlainLoadPlanner
from ..dcp import (
    DeltaStorageReader,
    DeltaStorageWriter,
    StagingBuffers,
    check_replica_mode,
    default_planner,
    open_store,
    quiet_single_process,
    typed_call,
    typed_future,
)
from ..errors import (
    CheckpointMismatchError,
    CorruptChunkError,
    DeltackptError,
    ManifestFormatError,
    MissingChunkError,
)
from ..store import ProblemKind, Store, Uploader, copy_checkpoints, plan_forget, verify_store
from .state import TrainState, rank_and_world

log = logging.getLogger("deltackpt.train")

STATE_KEY = "train"
STATELESS_KEY = "stateless_optimizers"  # manifest metadata: optimizers that had no state when saved
_DAMAGE = (CorruptChunkError, MissingChunkError, ManifestFormatError)
_ASYNC_TYPES = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}


_PARAM_GROUP = re.compile(r"(.+\.optim)\.param_groups\.(\d+)\.params")


def _own_names(name_format: str) -> re.Pattern:
    """The names ``name_format`` makes, as a pattern: a store may hold other checkpoints (a base model saved
    once, a second manager's with its own format), which a manager neither resumes from nor forgets."""
    parts, fields = [], []
    for literal, field, _spec, _conversion in string.Formatter().parse(name_format):
        parts.append(re.escape(literal))
        if field is not None:
            fields.append(field)
            parts.append(r"-?[0-9]+")
    pattern = re.compile("".join(parts))
    if fields != ["step"] or not all(pattern.fullmatch(name_format.format(step=s)) for s in (0, 7, 123456789)):
        raise ValueError(f"name_format must hold the field {{step}} once, as a decimal integer (such as "
                         f"'step-{{step:08d}}'), got {name_format!r}")
    return pattern


def _param_groups(keys, prefixes: tuple[str, ...]) -> dict[str, int]:
    """Number of param groups by optimizer state key (``train.<model>.optim``) among the flat ``keys``."""
    found: dict[str, set[int]] = {}
    for key in keys:
        m = _PARAM_GROUP.fullmatch(key) if key.startswith(prefixes) else None
        if m:
            found.setdefault(m.group(1), set()).add(int(m.group(2)))
    return {optim: len(indices) for optim, indices in found.items()}


class CheckpointManager:
    """Saves a TrainState every ``every_n_steps`` into ``store`` and resumes from its newest intact checkpoint.

    ``name_format``: the checkpoints' names, from the field ``{step}``. A manager resumes from and forgets only
    checkpoints of its own names: others in the store (a base model, a second manager's, such as an EMA copy
    under ``"ema-{step:08d}"``) are left alone.
    ``keep_last``: after each successful save keep only this many newest checkpoints (None keeps all).
    ``async_mode``: None (blocking), "thread" or "process" (``dcp.async_save``; "process" needs a process group).
    An async manager stages every save into one set of buffers (one copy of this rank's state, freed by
    ``close()``), so a save blocks training for a memory copy.
    ``base_cache_bytes``: memory for the previous save's keyframes, so changed chunks are delta-coded
    without reading their bases back from the store (0 turns it off).
    ``replica_check``: what a save does when replicas of a parameter or optimizer state differ across ranks
    (silent data corruption): "raise" (nothing is saved), "warn" or "off"; the models' buffers (BatchNorm
    running stats) are each rank's own and never compared.
    ``remote``: a store (URL) every checkpoint is uploaded to in the background; ``keep_last`` then applies
    there, and the local store keeps the newest ``keep_local_last`` (default ``keep_last``) once uploaded.
    """

    def __init__(self, store, state: TrainState, *, every_n_steps: int = 100, keep_last: int | None = None,
                 async_mode: str | None = None, process_group=None, name_format: str = "step-{step:08d}",
                 base_cache_bytes: int = 256 << 20, storage_options: dict | None = None, remote=None,
                 remote_storage_options: dict | None = None, keep_local_last: int | None = None,
                 replica_check: str = "raise") -> None:
        if every_n_steps < 1:
            raise ValueError("every_n_steps must be >= 1")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 (or None to keep every checkpoint)")
        if async_mode not in (None, *_ASYNC_TYPES):
            raise ValueError(f"async_mode must be None, 'thread' or 'process', got {async_mode!r}")
        if async_mode == "process" and process_group is None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("async_mode='process' needs a process group (DCP's checkpoint process joins it): "
                             "call torch.distributed.init_process_group first, or use async_mode='thread'")
        check_replica_mode(replica_check)  # here, not at the first save
        own = _own_names(name_format).fullmatch
        self.replica_check = replica_check
        self._own_group = None
        if async_mode == "thread" and process_group is None and rank_and_world()[1] > 1:
            # DCP's save thread runs collectives while training runs its own (FSDP's all-gathers): on one
            # group their order is undefined (gloo aborts on the mismatch, or both sides wait forever). Every
            # rank makes the manager (a collective: before anything that may fail on one rank only), so
            # every rank makes this group, in the same order; close() destroys it.
            process_group = self._own_group = dist.new_group(backend="gloo")
            # gloo connects a new group's ranks pairwise: one that destroyed the group (a manager that failed
            # to open its store, or one closed at once) while a peer was still connecting failed that peer
            # with "Connection closed by peer". After this barrier every rank is connected.
            dist.barrier(group=process_group)
        self._uploader: Uploader | None = None
        try:
            self.store: Store = open_store(store, storage_options)
            self.store.base_cache.limit(base_cache_bytes)
            self.remote = remote
            self._remote_storage_options = remote_storage_options
            self._remote: Store | None = None  # opened when a rank restores from it
            # The coordinator uploads (every rank's packs are in the one local store it commits to).
            if remote is not None and rank_and_world()[0] == 0:
                local_last = keep_local_last if keep_local_last is not None else keep_last
                self._uploader = Uploader(self.store, remote, storage_options=remote_storage_options,
                                          keep_local_last=local_last, keep_remote_last=keep_last, select=own)
            self.state = state
            self.every_n_steps = every_n_steps
            self.keep_last = keep_last
            self.async_mode = async_mode
            self.process_group = process_group
            self.name_format = name_format
            self._own = own  # whether a checkpoint name is one this manager makes
            self._pending: tuple[Future, str, int] | None = None
            self._staging = StagingBuffers(share_memory=async_mode == "process") if async_mode else None
            self._closed = False
            self._saved_step: int | None = None  # last saved or restored: saving it again changes nothing
        except BaseException:  # a manager never made is never closed: let go of what it took
            if self._uploader is not None:
                self._uploader.close()
            self._destroy_own_group()
            raise

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the original error; still wait for the background save
            try:
                self.close()
            except BaseException as e:  # noqa: BLE001
                log.error("background checkpoint failed while handling another error: %s", e)

    def name_for(self, step: int) -> str:
        return self.name_format.format(step=step)

    # -- saving --------------------------------------------------------------------------------------------
    def maybe_save(self, step: int, *, force: bool = False) -> bool:
        """Save if ``step`` is on the cadence, or when ``force`` (pass ``step == total_steps`` so the last
        steps are never lost), unless this step is already saved; returns whether a save started."""
        if (step % self.every_n_steps and not force) or step == self._saved_step:
            self._raise_if_failed()
            return False
        self.save(step)
        return True

    def save(self, step: int, metadata: dict[str, Any] | None = None) -> str:
        """Checkpoint the state now (waiting for a previous async save first). Returns the name."""
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        self._wait_save()
        if self._uploader is not None:
            self._uploader.raise_if_failed()
        self.state.step = step
        _, world = rank_and_world()
        name = self.name_for(step)
        meta = {"step": step, "world_size": world,
                "optimizers": {n: type(o).__name__ for n, o in self.state.optimizers.items()}, **(metadata or {})}
        # An optimizer before its first step is saved with the state torch's get_state_dict gives it (a step
        # with lr 0: what a plain dcp.load expects); a restore clears it again, or Adam's bias correction
        # would be a step off.
        stateless = sorted(n for n, o in self.state.optimizers.items() if not o.state)
        if stateless:
            meta[STATELESS_KEY] = stateless
        writer = DeltaStorageWriter(self.store, name, overwrite=True, metadata=meta, staging=self._staging,
                                    replica_check=self.replica_check)
        payload = {STATE_KEY: self.state}
        planner = default_planner(payload, self.replica_check)
        started = time.perf_counter()
        self.state.prepare_save(True)  # DCP takes the state dict in this call, also for an async save
        try:
            if self.async_mode is None:
                with quiet_single_process(), aborted_on_failure(writer):
                    typed_call(lambda: dcp.save(payload, storage_writer=writer, planner=planner,
                                                process_group=self.process_group))
            else:
                kind = _ASYNC_TYPES[self.async_mode]
                with quiet_single_process(), aborted_on_failure(writer):
                    fut = one_process_save_at_a_time(kind, lambda: typed_call(lambda: dcp.async_save(
                        payload, storage_writer=writer, planner=planner, process_group=self.process_group,
                        async_checkpointer_type=kind)))
                abort_on_failure(writer, fut)
        finally:
            self.state.prepare_save(False)
        if self.async_mode is None:
            self._log_saved(name, started)
            self._after_save(name)
        else:
            self._staging.hold_until(fut)
            # Logged as the background save completes (before the typed future settles, so before wait()
            # returns), not when the next call collects it.
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or self._log_saved(name, started))
            self._pending = (typed_future(fut), name, step)
        self._saved_step = step
        return name

    def wait(self) -> None:
        """Block until the background save and uploads (if any) finish; raise their errors."""
        self._wait_save()
        if self._uploader is not None:
            self._uploader.wait()

    def _wait_save(self) -> None:
        if self._pending is None:
            return
        fut, name, step = self._pending
        try:
            fut.result()
        except BaseException as e:
            if not fut.done():
                # The wait itself was cut short (a SIGTERM handler's sys.exit, a Ctrl-C): the save goes on,
                # and close() must still collect it (upload it, or report its error).
                raise
            self._pending = None
            if self._saved_step == step:
                self._saved_step = None  # not saved: a retry of this step must save it
            if isinstance(e, DeltackptError):
                e.add_note(f"background save of checkpoint {name!r} failed")
                raise
            if not isinstance(e, Exception):
                raise
            raise DeltackptError(f"background save of checkpoint {name!r} failed: {type(e).__name__}: {e}") from e
        self._pending = None
        self._after_save(name)

    def _raise_if_failed(self) -> None:
        if self._pending is not None and self._pending[0].done():
            self._wait_save()
        if self._uploader is not None:
            self._uploader.raise_if_failed()

    def close(self) -> None:
        if self._closed:
            return
        failed = False
        try:
            self.wait()
        except BaseException:
            failed = True
            raise
        finally:
            self._closed = True
            try:
                if self._staging is not None:
                    self._staging.close()  # waits for a save still running
                if failed and self._pending is not None:
                    # The wait was cut short (Ctrl-C, a SIGTERM handler's sys.exit) and the save has ended since
                    # (its typed future a moment later): upload it, or report its error (the interrupt goes on).
                    name = self._pending[1]
                    try:
                        self._wait_save()
                    except Exception as e:  # noqa: BLE001
                        log.error("background save of checkpoint %r failed: %s", name, e)
                if self._uploader is not None:
                    self._uploader.close()
            except Exception as e:  # noqa: BLE001 - the save's own error, raised above, goes first
                if not failed:
                    raise
                log.error("after a failed save, the uploads failed too: %s", e)
            finally:
                self._destroy_own_group()

    def _destroy_own_group(self) -> None:
        group, self._own_group = self._own_group, None
        if group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except ValueError:
                pass  # gone already: the default group was destroyed (and made again) meanwhile

    def _log_saved(self, name: str, started: float) -> None:
        """One line per save, on the coordinator: its name, seconds, and bytes new / logical (from the
        committed manifest's stats)."""
        if rank_and_world()[0] != 0:
            return
        seconds = time.perf_counter() - started
        stats = self.store.read_manifest(name).stats
        log.info("saved checkpoint %r in %.2f s: %s bytes new / %s logical", name, seconds,
                 f"{stats.stored_bytes:,}", f"{stats.logical_bytes:,}")

    def _after_save(self, name: str) -> None:
        rank, _ = rank_and_world()
        if rank != 0:
            return
        if self._uploader is not None:
            self._uploader.submit(name)  # with a remote, keep_last applies there, after the upload
            return
        if self.keep_last is None:
            return
        # Tagged checkpoints are always kept, and checkpoints of other names (a base, another manager's).
        plan = plan_forget(self.store, keep_last=self.keep_last, select=self._own)
        plan.forget = [n for n in plan.forget if n != name]
        plan.execute()

    # -- restoring -------------------------------------------------------------------------------------------
    def restore_latest(self) -> int:
        """Load the newest intact checkpoint into the state; returns its step (0 on an empty store).

        With a remote, a remote checkpoint newer than every local one (a replaced node's empty disk, a new
        cluster) is first fetched into the local store, only the chunks it lacks. Uploads go on meanwhile.
        """
        self._wait_save()
        if self.remote is not None:
            self._fetch_newer_remote()
        # What to try is decided on the coordinator and sent to every rank: ranks that listed or verified on
        # their own could disagree (a retention or an upload in between) and enter different collectives.
        infos = self._agreed(lambda: [(i.name, i.damage) for i in
                                      reversed(self.store.list_checkpoints(include_damaged=True))
                                      if self._own(i.name)])
        if not infos:
            return 0
        failures = []
        for name, manifest_damage in infos:
            if manifest_damage is not None:
                step = self._restore_from_remote(name, manifest_damage)
                if step is not None:
                    return step
                log.warning("checkpoint %r has a damaged manifest (%s); falling back to the previous one", name,
                            manifest_damage)
                failures.append(f"{name}: {manifest_damage}")
                continue
            # Structure first (manifest, chunks indexed, packs and bases present): a damaged checkpoint is
            # skipped before it touches the state. Chunk bytes are re-hashed as they load.
            damage = self._agreed(lambda: self._structural_damage(name))
            if damage is None:
                try:
                    return self.restore(name)
                except _DAMAGE as e:
                    damage = e
            step = self._restore_from_remote(name, damage)
            if step is not None:
                return step
            log.warning("checkpoint %r is damaged (%s); falling back to the previous one", name, damage)
            failures.append(f"{name}: {damage}")
        raise DeltackptError("no intact checkpoint to resume from; " + "; ".join(failures))

    def _structural_damage(self, name: str) -> str | None:
        """What verify level 0 finds wrong with checkpoint ``name`` of the local store, or None."""
        report = verify_store(self.store, level=0, checkpoints=[name])
        problems = [p for p in report.problems if p.kind != ProblemKind.TAGS]  # its data is intact
        return problems[0].detail if problems else None

    def _agreed(self, fn):
        """``fn()`` as the coordinator computed it, on every rank (one computation, one answer)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(self.process_group) == 1:
            return fn()
        group = self.process_group
        lead = dist.get_global_rank(group, 0) if group is not None else 0
        box: list = [None]
        error = None
        if dist.get_rank() == lead:
            try:
                box = [("ok", fn())]
            except Exception as e:  # noqa: BLE001 - raised on every rank, after they have heard of it
                error, box = e, [("error", f"{type(e).__name__}: {e}")]
        dist.broadcast_object_list(box, src=lead, group=group)
        kind, value = box[0]
        if error is not None:
            raise error
        if kind == "error":
            raise DeltackptError(f"restore: the coordinator failed: {value}")
        return value

    def _restore_from_remote(self, name: str, damage) -> int | None:
        """With a remote holding ``name``, restore the checkpoint whose local copy is damaged from there."""
        if self.remote is None:
            return None
        if not self._agreed(lambda: self._remote_store().exists(name)):
            return None
        remote = self._remote_store()
        log.warning("checkpoint %r is damaged locally (%s); restoring it from %s", name, damage, self.remote)
        try:
            return self.restore(name, store=remote)
        except _DAMAGE as e:
            log.warning("checkpoint %r is damaged in %s too (%s)", name, self.remote, e)
            return None

    def _remote_store(self) -> Store:
        if self._uploader is not None:
            return self._uploader.remote
        if self._remote is None:
            self._remote = Store.open(self.remote, storage_options=self._remote_storage_options)
        return self._remote

    def _fetch_newer_remote(self) -> None:
        """On the coordinator: copy the remote's newest intact checkpoint here if it is newer than every local
        one (a damaged one is skipped for the one before it, as a local one would be)."""
        if self._uploader is not None:
            remote = self._uploader.remote
            local_infos = self.store.list_checkpoints()
            own_local = [i for i in local_infos if self._own(i.name)]
            newest_local = own_local[-1].created_ns if own_local else None
            listed = {i.name for i in local_infos}
            for info in reversed([i for i in remote.list_checkpoints() if self._own(i.name)]):
                if newest_local is not None and info.created_ns <= newest_local:
                    break
                # Listed here: an older checkpoint of that name (a branch the run went back from, on this node's
                # disk); the remote's is the run's newest, and replaces it here as the uploader replaced it there.
                overwrite = info.name in listed
                if not overwrite and self.store.exists(info.name):
                    break  # damaged here (so not listed): restore_latest restores it from the remote
                try:
                    report = copy_checkpoints(remote, self.store, [info.name], overwrite=overwrite)
                except _DAMAGE as e:
                    log.warning("checkpoint %r is damaged in %s (%s); fetching the one before it", info.name,
                                self.remote, e)
                    self._uploader.replace_damaged(info.name)  # a later save of that name replaces it there
                    continue
                self._uploader.note_fetched(info.name, info.created_ns)  # remote already: local retention applies
                log.info("fetched checkpoint %r from %s (%d bytes)", info.name, self.remote, report.bytes_sent)
                break
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=self.process_group)  # every rank then sees what the coordinator fetched

    def restore(self, name: str, *, store: Store | None = None) -> int:
        """Load checkpoint ``name`` (of ``store``, default the local one) into the state; returns its step.

        Waits for a background save first (its collectives and the load's would interleave on one group)."""
        self._wait_save()
        store = store or self.store
        reader = DeltaStorageReader(store, name)
        manifest = store.read_manifest(reader.checkpoint_id)
        saved_world = int(manifest.metadata.get("world_size", rank_and_world()[1]))
        now = {n: type(o).__name__ for n, o in self.state.optimizers.items()}
        saved_opts = manifest.metadata.get("optimizers")
        if saved_opts is not None and saved_opts != now:
            raise CheckpointMismatchError(f"checkpoint {name!r} was saved with optimizers {saved_opts}, "
                                          f"restoring into {now}")
        metadata = reader.read_metadata()
        prefix = STATE_KEY + "."
        self.state.prepare_load(saved_world, [k[len(prefix):] for k in metadata.state_dict_metadata
                                              if k.startswith(prefix)])
        try:
            target = self.state.state_dict()
            self._check_compatible(name, target, metadata)
            with quiet_single_process():
                try:
                    typed_call(lambda: dcp.load({STATE_KEY: self.state},
                                                storage_reader=DeltaStorageReader(store, reader.checkpoint_id),
                                                planner=PlainLoadPlanner(), process_group=self.process_group))
                except RuntimeError as e:  # DCP's planner, before it loads anything: a part the checkpoint lacks
                    if not str(e).startswith("Missing key in checkpoint state_dict"):
                        raise
                    key = str(e).split(":", 1)[1].strip().rstrip(".")
                    raise CheckpointMismatchError(
                        f"checkpoint {name!r} has no {key!r}: the state holds a part (a scheduler, a dataloader, "
                        "a grad scaler, an optimizer setting) the checkpoint was saved without; nothing was "
                        "restored") from None
        finally:
            self.state.prepare_load(None)
        for opt_name in manifest.metadata.get(STATELESS_KEY, []):
            if opt_name in self.state.optimizers:
                self.state.optimizers[opt_name].state.clear()
        log.info("restored checkpoint %r (step %d)", reader.checkpoint_id, self.state.step)
        self._saved_step = self.state.step
        return self.state.step

    def _check_compatible(self, name: str, target: dict[str, Any], metadata) -> None:
        """Raise CheckpointMismatchError naming every key/shape/optimizer mismatch before touching the state."""
        saved = metadata.state_dict_metadata
        flat, _ = flatten_state_dict({STATE_KEY: target})  # DCP's own keys (lists too: param_groups.0.lr)
        problems = []
        model_prefixes = tuple(f"{STATE_KEY}.{m}." for m in self.state.models)
        for key, value in flat.items():
            if not isinstance(value, torch.Tensor) or not key.startswith(model_prefixes):
                continue
            md = saved.get(key)
            if md is None:
                problems.append(f"missing in checkpoint: {key}")
                continue
            shape = list(value.shape) if not isinstance(value, DTensor) else list(value.size())
            if isinstance(md, TensorStorageMetadata) and list(md.size) != shape:
                problems.append(f"shape of {key}: checkpoint {list(md.size)}, now {shape}")
        for key, md in saved.items():
            if key.startswith(model_prefixes) and isinstance(md, TensorStorageMetadata) and key not in flat:
                problems.append(f"not in the model/optimizer now: {key}")
        # The optimizers' param groups (each group's hyperparameters are plain values, not tensors): torch maps
        # the groups by parameter name, so a group the optimizer now lacks was silently dropped with its lr and
        # weight decay. By their ``params`` keys: a scheduler adds others (``initial_lr``) to every group.
        saved_groups, groups = _param_groups(saved, model_prefixes), _param_groups(flat, model_prefixes)
        for optim in sorted(saved_groups.keys() | groups.keys()):
            if saved_groups.get(optim, 0) != groups.get(optim, 0):
                problems.append(f"param groups of {optim}: checkpoint {saved_groups.get(optim, 0)}, "
                                f"now {groups.get(optim, 0)}")
        if problems:
            shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
            raise CheckpointMismatchError(f"checkpoint {name!r} does not match the training state: "
                                          + "; ".join(shown))
        top = len(STATE_KEY) + 1
        saved_parts = {k[top:].split(".", 1)[0] for k in saved if k.startswith(STATE_KEY + ".")}
        parts = {k[top:].split(".", 1)[0] for k in flat if k.startswith(STATE_KEY + ".")}
        for part in sorted({"scheduler", "scaler"} & saved_parts - parts):
            log.warning("checkpoint %r holds a %s state this training state has no %s for: not restored", name,
                        part, part)

