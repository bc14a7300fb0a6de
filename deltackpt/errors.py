"""The exception hierarchy of deltackpt. Imports nothing of ours.

Every error deltackpt raises on purpose derives from :class:`DeltackptError`, so callers can catch the
whole family; each one also derives from the builtin that best describes it (``KeyError`` for a missing
checkpoint, ``ValueError`` for a malformed manifest), so generic code keeps working.
"""

from __future__ import annotations


class DeltackptError(Exception):
    """Base class of every error deltackpt raises on purpose."""


class NativeKernelUnavailable(DeltackptError, ImportError):
    """The C kernels were required (DELTACKPT_KERNELS=native) but ``deltackpt._native`` cannot be imported."""


class StoreNotFoundError(DeltackptError, FileNotFoundError):
    """The path is not a deltackpt store (no ``config`` object)."""


class StoreExistsError(DeltackptError, FileExistsError):
    """``Store.init`` on a path that already holds a store, or a store's folders without its ``config``."""


class UnsupportedFormatError(DeltackptError):
    """The store or an object in it was written by a newer, incompatible format version."""


class StoreLockedError(DeltackptError):
    """Another process holds a lock that conflicts with the requested operation."""


class CheckpointNotFoundError(DeltackptError, KeyError):
    """No committed checkpoint has this name."""

    def __init__(self, name: str, nearby: list[str] | None = None, reason: str | None = None):
        self.name = name
        self.nearby = list(nearby or [])
        self.reason = reason
        super().__init__(name)

    def __str__(self) -> str:
        msg = f"no checkpoint named {self.name!r}"
        if self.reason:
            msg += f" ({self.reason})"
        if self.nearby:
            msg += f"; nearby names: {', '.join(self.nearby)}"
        return msg


class CheckpointExistsError(DeltackptError, FileExistsError):
    """A checkpoint with this name is already committed (pass overwrite=True to replace it).

    The message starts "Checkpoint already exists", as DCP's FileSystemWriter says, so code written against
    DCP's wording keeps working.
    """

    def __init__(self, name: str, where: str = "", hint: str = "pass overwrite=True to replace it"):
        self.name = name
        self.where = where  # e.g. "in the destination, with other data"
        self.hint = hint  # what the caller can do instead
        super().__init__(name)

    def __str__(self) -> str:
        where = f" {self.where}" if self.where else ""
        return f"Checkpoint already exists: {self.name}{where}; {self.hint}"


class InvalidNameError(DeltackptError, ValueError):
    """A checkpoint name that is empty, too long, reserved or could escape the store (``/``, ``..``)."""


class ManifestFormatError(DeltackptError, ValueError):
    """A stored metadata object (config, manifest, pack header, index record) does not match its schema."""


class CorruptChunkError(DeltackptError):
    """A chunk's bytes do not hash to its id, or its pack entry is damaged.

    Carries the chunk id, the pack, and the checkpoint / item when known, so the damage can be traced.
    """

    def __init__(
        self,
        message: str,
        *,
        chunk_id: str | None = None,
        pack: str | None = None,
        checkpoint: str | None = None,
        item: str | None = None,
        base_chunk_id: str | None = None,
    ):
        self.chunk_id = chunk_id
        self.pack = pack
        self.checkpoint = checkpoint
        self.item = item
        self.base_chunk_id = base_chunk_id
        parts = [message]
        for label, value in (
            ("chunk", chunk_id),
            ("base chunk", base_chunk_id),
            ("pack", pack),
            ("checkpoint", checkpoint),
            ("item", item),
        ):
            if value:
                parts.append(f"{label} {value}")
        super().__init__("; ".join(parts))

    def __reduce__(self):
        kw = dict(chunk_id=self.chunk_id, pack=self.pack, checkpoint=self.checkpoint, item=self.item,
                  base_chunk_id=self.base_chunk_id)
        return (_rebuild_corrupt, (self.args[0], kw))


def _rebuild_corrupt(message, kw):
    err = CorruptChunkError.__new__(CorruptChunkError)
    Exception.__init__(err, message)
    err.__dict__.update(kw)
    return err


class MissingChunkError(DeltackptError, KeyError):
    """A manifest references a chunk that no pack holds."""

    def __init__(self, chunk_id: str, *, checkpoint: str | None = None, item: str | None = None):
        self.chunk_id = chunk_id
        self.checkpoint = checkpoint
        self.item = item
        super().__init__(chunk_id)

    def __str__(self) -> str:
        msg = f"chunk {self.chunk_id} is not in any pack"
        if self.checkpoint:
            msg += f"; checkpoint {self.checkpoint}"
        if self.item:
            msg += f"; item {self.item}"
        return msg

    def __reduce__(self):
        return (_rebuild_missing, (self.chunk_id, self.checkpoint, self.item))


def _rebuild_missing(chunk_id, checkpoint, item):
    return MissingChunkError(chunk_id, checkpoint=checkpoint, item=item)


class CheckpointMismatchError(DeltackptError, ValueError):
    """A checkpoint does not fit the state it is restored into (parameter names, shapes, optimizer type)."""


class SilentDataCorruptionError(DeltackptError):
    """Replicas of the same data disagree across ranks: a bit flipped in memory or compute."""


class BackendError(DeltackptError, OSError):
    """A storage operation failed after its retries (or cannot work: unknown scheme, missing bucket, access
    denied); names the object and the operation."""

    def __init__(self, message: str, *, key: str | None = None, operation: str | None = None):
        super().__init__(message)
        self.key = key
        self.operation = operation

    def __str__(self) -> str:
        return self.args[0] if self.args else ""

    def __reduce__(self):
        return (_rebuild_backend_error, (str(self), self.key, self.operation))


def _rebuild_backend_error(message, key, operation):
    return BackendError(message, key=key, operation=operation)


class CheckpointPinnedError(DeltackptError):
    """Forgetting a checkpoint by name that has tags: a tag pins a checkpoint until it is removed."""

    def __init__(self, name: str, tags: list[str]):
        self.name = name
        self.tags = list(tags)
        super().__init__(name, self.tags)

    def __str__(self) -> str:
        removes = " ".join(f"--remove {t}" for t in self.tags)
        return (f"checkpoint {self.name!r} is pinned by tag(s) {', '.join(self.tags)}; remove them first: "
                f"deltackpt tag STORE {self.name} {removes}")


class CorruptManifestError(ManifestFormatError):
    """A checkpoint's stored manifest cannot be decoded or fails validation; ``checkpoint`` names it."""

    def __init__(self, message: str, *, checkpoint: str | None = None):
        self.checkpoint = checkpoint
        super().__init__(message)

    def __reduce__(self):
        return (_rebuild_corrupt_manifest, (self.args[0], self.checkpoint))


def _rebuild_corrupt_manifest(message, checkpoint):
    return CorruptManifestError(message, checkpoint=checkpoint)


class DiskFullError(DeltackptError, OSError):
    """The filesystem ran out of space (ENOSPC, or a quota) while deltackpt wrote ``filename``.

    A failed save removes its temporary files; the packs it already published stay (another save may use
    them), and a retry reuses their chunks. Free space (e.g. ``deltackpt forget`` then ``deltackpt gc``; a
    failed save's own packs are younger than gc's grace period: ``--grace 0`` when no save is running) and
    retry.
    """

    def __init__(self, filename: str, needed_bytes: int | None = None, free_bytes: int | None = None,
                 errno_: int | None = None):
        import errno

        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        msg = f"disk full while writing {filename}"
        if needed_bytes is not None:
            msg += f": at least {needed_bytes} more bytes needed"
            if free_bytes is not None:
                msg += f", {free_bytes} free"
        super().__init__(errno_ or errno.ENOSPC, msg + "; free space on that filesystem and retry")
        self.filename = filename

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        return (DiskFullError, (self.filename, self.needed_bytes, self.free_bytes, self.errno))


class StorePermissionError(DeltackptError, PermissionError):
    """A write to a store this user cannot write (a read-only store or mount, another user's store).

    Reading commands still work: the index cache then lives in the user's cache directory or in memory.
    """




class SourceFormatError(DeltackptError, ValueError):
    """A checkpoint to import is not one deltackpt can read: not a DCP directory or ``torch.save`` file, a
    truncated ``.distcp`` file, a payload that does not match its metadata."""


class UnsafeSourceError(SourceFormatError):
    """A file to import needs unpickling beyond plain data (``torch.load(weights_only=True)``'s allow-list, or
    DCP's metadata classes): it is refused, and nothing in it is executed. Also a ``torch`` export of values
    that ``weights_only=True`` could not load back (nothing is written then)."""


class TargetExistsError(DeltackptError, FileExistsError):
    """An export target (a file or a directory) already exists; exports never overwrite."""
