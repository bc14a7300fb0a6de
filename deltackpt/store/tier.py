"""Hot and cold tiers: a local store for the newest checkpoints, a remote store (object storage) for all of them.

The training loop saves into the local (hot) store as always; an :class:`Uploader` thread then copies each
committed checkpoint to the remote (cold) store with :func:`~deltackpt.store.copy.copy_checkpoints` (only
chunks the remote lacks, manifest last), so the training step never waits on the network. Local checkpoints
beyond ``keep_local_last`` are forgotten only once they are uploaded (the remote may have forgotten them
since, by its own retention).

The local store records its remote in a small JSON object ``tier`` ({"remote": url, "remote_id": its store id,
"uploading": name or null, "uploaded": {name: created_ns}}), so ``deltackpt ls`` can show where each checkpoint
lives and an uploader started later knows what was sent: it first uploads, in the background, every local
checkpoint the remote does not hold, the record does not list and the remote's retention would keep (an upload
cut short by a crash, a failed one, one committed just before the crash). "uploaded" counts only for the remote
store of that id: a remote wiped and made again at the same URL (or another endpoint's bucket of that name) is
sent everything again, and nothing local is forgotten on the word of a store that never held it. Storage options
(credentials) are never written there.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading

from ..errors import (CheckpointExistsError, CheckpointNotFoundError, CorruptChunkError, DeltackptError,
                      ManifestFormatError, MissingChunkError, UnsupportedFormatError)
from .copy import copy_checkpoints, open_or_create_destination
from .backend import local_root
from .location import describe
from .retention import ForgetPlan, plan_forget, read_all_tags

TIER_KEY = "tier"
log = logging.getLogger("deltackpt.tier")
# Upload errors that sending again cannot mend (the data, not the network): raised once, not retried.
_PERMANENT = (CheckpointExistsError, CheckpointNotFoundError, CorruptChunkError, MissingChunkError,
              ManifestFormatError, UnsupportedFormatError)


def read_tier(store) -> dict | None:
    """The local store's tier record ({"remote": url, "remote_id": store id or None, "uploading": name or None,
    "uploaded": {name: created_ns}}), or None. A record without a valid "uploaded" or "remote_id" (an older
    release's) reads as uploaded nothing."""
    try:
        raw = json.loads(store.backend.get(TIER_KEY))
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError):
        return None  # a damaged record only loses the tier column of `ls` (and the uploader re-checks)
    if not isinstance(raw, dict) or not isinstance(raw.get("remote"), str):
        return None
    uploading = raw.get("uploading")
    uploaded = raw.get("uploaded")
    remote_id = raw.get("remote_id")
    if not isinstance(remote_id, str) or not isinstance(uploaded, dict) \
            or not all(isinstance(n, str) and type(t) is int for n, t in uploaded.items()):
        remote_id, uploaded = None, {}
    return {"remote": raw["remote"], "remote_id": remote_id,
            "uploading": uploading if isinstance(uploading, str) else None, "uploaded": uploaded}


def write_tier(store, remote: str, remote_id: str, uploading: str | None = None,
               uploaded: dict[str, int] | None = None) -> None:
    record = {"remote": remote, "remote_id": remote_id, "uploading": uploading,
              "uploaded": dict(sorted((uploaded or {}).items()))}
    store.backend.put(TIER_KEY, json.dumps(record).encode())


def tier_states(local, remote, *, local_infos=None, remote_infos=None) -> dict[str, str]:
    """Where each checkpoint lives: 'local', 'uploading', 'remote', 'both', or 'differs' (each store holds a
    checkpoint of that name, not the same one: their creation times differ) (names of either store).
    ``local_infos``/``remote_infos``: the stores' ``list_checkpoints(include_damaged=True)`` when the caller
    has them (each is listed once either way)."""
    record = read_tier(local) or {}
    made_here = _created_or_damaged(local, local_infos)
    made_there = _created_or_damaged(remote, remote_infos) if remote is not None else {}
    out = {}
    for name in made_here.keys() | made_there.keys():
        if name in made_here and name in made_there:
            t_here, t_there = made_here[name], made_there[name]
            out[name] = "differs" if None not in (t_here, t_there) and t_here != t_there else "both"
        elif name in made_there:
            out[name] = "remote"
        else:
            out[name] = "uploading" if name == record.get("uploading") else "local"
    return out


def _created_or_damaged(store, infos=None) -> dict[str, int | None]:
    """name -> created_ns of each of ``store``'s checkpoints, None for a damaged one (its time is unknown)."""
    if infos is None:
        infos = store.list_checkpoints(include_damaged=True)
    return {i.name: None if i.damaged else i.created_ns for i in infos}


def _created(store) -> dict[str, int]:
    """name -> created_ns of ``store``'s checkpoints, oldest first (a copy keeps created_ns: it tells a
    checkpoint from a later one saved under its name)."""
    return {i.name: i.created_ns for i in store.list_checkpoints()}


class Uploader:
    """Copies committed checkpoints of ``local`` to ``remote`` in a background thread, oldest first.

    ``submit(name)`` never blocks; ``wait()`` blocks until everything submitted is remote; an upload error is
    raised by the next ``submit``/``wait``/``raise_if_failed`` (like an async save's), and the checkpoint is
    uploaded again with the next ``submit`` (or by the next Uploader of this store). ``keep_local_last``:
    forget local checkpoints beyond the newest N once they are uploaded; ``keep_remote_last``: retention of
    the remote store (None keeps all; a checkpoint tagged in either store is kept). ``select(name)``: the
    checkpoints both retentions are about (a CheckpointManager's own names); others are uploaded and kept.
    """

    def __init__(self, local, remote, *, storage_options: dict | None = None, keep_local_last: int | None = None,
                 keep_remote_last: int | None = None, select=None) -> None:
        if keep_local_last is not None and keep_local_last < 1:
            raise ValueError("keep_local_last must be >= 1 (or None to keep every local checkpoint)")
        self.local = local
        self.remote = open_or_create_destination(local, remote, storage_options)
        if self.remote.config.store_id == local.config.store_id:
            raise DeltackptError(f"remote {remote!r} is the local store itself (or a copy sharing its id): "
                                 "name another store")
        # Where `deltackpt ls` finds it again, from any directory: a URL, or an absolute path.
        local_dir = local_root(self.remote.backend)
        self.remote_url = os.path.abspath(local_dir) if local_dir is not None else describe(self.remote.backend)
        self.keep_local_last = keep_local_last
        self._select = select or (lambda name: True)
        self.keep_remote_last = keep_remote_last
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._failed_name: str | None = None
        self._retry: list[str] = []  # failed uploads, queued again by the next submit
        self._damaged_remote: set[str] = set()  # remote checkpoints found damaged: a local one replaces them
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="deltackpt-upload", daemon=True)
        self._closed = False
        # Local checkpoints (name -> created_ns, which a copy keeps) that need no upload: sent by this
        # uploader or an earlier one to this remote (which may have forgotten them since, by its retention),
        # or that its retention would forget as soon as they arrived. The created_ns tells a checkpoint from
        # a later one saved under its name.
        local_ns, remote_ns = _created(local), _created(self.remote)
        record = read_tier(local)
        remote_id = self.remote.config.store_id
        sent = record["uploaded"] if record is not None and record["remote_id"] == remote_id else {}
        pinned = read_all_tags(local)
        own_remote_times = [t for n, t in remote_ns.items() if self._select(n)]
        self._uploaded = {n: t for n, t in local_ns.items()
                          if sent.get(n) == t or remote_ns.get(n) == t
                          or (n not in pinned and self._select(n) and self._retired(t, own_remote_times))}
        write_tier(local, self.remote_url, remote_id, uploaded=self._uploaded)
        for name in local_ns:  # what an earlier run did not finish sending: a crash, a failure
            if name not in self._uploaded:
                self._queue.put((name, True))
        if keep_local_last is not None:
            self._queue.put((None, True))  # then the local retention, once (an earlier run may have kept more)
        self._thread.start()

    def _retired(self, created_ns: int, remote_times) -> bool:
        """Whether the remote's retention would forget a checkpoint created at ``created_ns`` on arrival."""
        return self.keep_remote_last is not None and sum(t > created_ns for t in remote_times) >= self.keep_remote_last

    def note_fetched(self, name: str, created_ns: int) -> None:
        """Local checkpoint ``name`` was fetched from the remote: nothing to upload, and local retention may
        forget it (the remote holds it, or held it until its own retention forgot it)."""
        with self._lock:
            self._uploaded[name] = created_ns
            write_tier(self.local, self.remote_url, self.remote.config.store_id, uploaded=self._uploaded)

    def replace_damaged(self, name: str) -> None:
        """The remote's checkpoint ``name`` is damaged (a restore skipped it): a local checkpoint saved under
        that name later (the run resumed before it) replaces it instead of failing as a different checkpoint
        of the same name."""
        with self._lock:
            self._damaged_remote.add(name)

    def submit(self, name: str) -> None:
        """Queue ``name`` for upload (after any failed upload, queued again first), then raise an earlier
        upload's error if there was one."""
        if self._closed:
            raise RuntimeError("Uploader is closed")
        with self._lock:
            retry, self._retry = self._retry, []
        for n in retry:
            self._queue.put((n, False))
        self._queue.put((name, False))
        self.raise_if_failed()

    def wait(self) -> None:
        """Block until every submitted checkpoint is remote (or failed); raise the first failure."""
        self._queue.join()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        with self._lock:
            err, name = self._error, self._failed_name
            self._error = self._failed_name = None
        if err is not None:
            raise DeltackptError(f"background upload of checkpoint {name!r} to {self.remote_url} failed: "
                                 f"{err}") from err

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                name, backlog = job
                if name is None:
                    self._drop_local()
                else:
                    self._upload(name)
            except BaseException as e:  # noqa: BLE001 - surfaced at the next call
                log.warning("upload of checkpoint %r failed: %s", name, e)
                with self._lock:
                    if not isinstance(e, _PERMANENT) and name not in self._retry:
                        self._retry.append(name)  # a network fault, a full disk: sent again with the next submit
                    # A checkpoint an earlier run left unsent is caught up on a best-effort basis: its failure
                    # is logged (and retried), not raised into the training loop.
                    if not backlog and self._error is None:
                        self._error, self._failed_name = e, name
            finally:
                self._queue.task_done()

    def _upload(self, name: str) -> None:
        try:
            created_ns = self.local.read_manifest(name).created_ns
        except CheckpointNotFoundError:
            return  # forgotten locally before its turn (a `deltackpt forget` of the local store): nothing to send
        write_tier(self.local, self.remote_url, self.remote.config.store_id, uploading=name, uploaded=self._uploaded)
        try:
            self._send(name, created_ns)
        except BaseException:
            try:  # not uploading any more: `ls` showed it as uploading for good
                write_tier(self.local, self.remote_url, self.remote.config.store_id, uploaded=self._uploaded)
            except Exception:  # noqa: BLE001 - the upload's own error is the one to report
                pass
            raise

    def _send(self, name: str, created_ns: int) -> None:
        with self._lock:
            replace = name in self._damaged_remote
        try:
            report = copy_checkpoints(self.local, self.remote, [name], overwrite=replace)
        except CheckpointNotFoundError:
            if self.local.exists(name):
                raise
            log.info("checkpoint %r was forgotten locally during its upload: not sent", name)
            return
        except CheckpointExistsError:
            # The remote holds an older checkpoint of this name: the run went back (a restore of an earlier
            # step) and saved it again, replacing it locally too. A newer remote one is not ours to replace.
            theirs = self.remote.read_manifest(name).created_ns
            if theirs >= created_ns:
                raise
            log.info("checkpoint %r replaces an older one of that name on %s", name, self.remote_url)
            report = copy_checkpoints(self.local, self.remote, [name], overwrite=True)
        if replace:
            with self._lock:
                self._damaged_remote.discard(name)
        self._uploaded[name] = created_ns
        write_tier(self.local, self.remote_url, self.remote.config.store_id, uploaded=self._uploaded)
        log.info("uploaded checkpoint %r: %d bytes sent, %d skipped, %.2f s", name, report.bytes_sent,
                 report.bytes_skipped, report.seconds)
        if self.keep_remote_last is not None:
            plan = plan_forget(self.remote, keep_last=self.keep_remote_last, select=self._select)
            pinned = read_all_tags(self.local)  # tagged locally after its upload: kept there too
            plan.forget = [n for n in plan.forget if n not in pinned]
            plan.execute()
        if self.keep_local_last is not None:
            self._drop_local()

    def _drop_local(self) -> None:
        """Forget local checkpoints beyond the newest ``keep_local_last`` that were uploaded (the remote holds
        them, or held them until its retention forgot them), the very checkpoint: same created_ns."""
        local_ns = _created(self.local)
        names = [n for n in local_ns if self._select(n)]
        old = names[:-self.keep_local_last] if len(names) > self.keep_local_last else []
        if old:
            pinned = read_all_tags(self.local)
            remote_ns = _created(self.remote)
            confirmed = [n for n in old if n not in pinned
                         and local_ns[n] in (self._uploaded.get(n), remote_ns.get(n))]
            if confirmed:
                ForgetPlan(store=self.local, forget=confirmed).execute()
        here = set(self.local.checkpoint_names())
        left = {n: t for n, t in self._uploaded.items() if n in here}
        if left != self._uploaded:
            self._uploaded = left
            write_tier(self.local, self.remote_url, self.remote.config.store_id, uploaded=self._uploaded)
