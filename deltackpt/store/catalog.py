"""The catalog of a store's checkpoints: listing them, resolving a name, reading their manifests.

- ``list_checkpoints``: the manifests listed, each summarized once and the summary kept in the index cache
  (keyed by name, checked against the manifest's size and mtime), so ``ls`` reads no manifest twice.
- ``resolve``: ``latest`` is the newest readable checkpoint; an unknown name's error lists names close to it.
- ``read_manifest`` and its array forms (``read_manifest_refs``, ``add_manifest_ids``): every check of a
  manifest, its name included.
"""

from __future__ import annotations

import difflib
import re
from functools import partial

import msgspec

from ..errors import CheckpointNotFoundError, CorruptManifestError, InvalidNameError, UnsupportedFormatError
from . import idset
from .manifest import (LATEST, Manifest, ManifestRefs, is_checkpoint_name, manifest_body, manifest_from_body,
                       manifest_key, refs_from_body, validate_name)
from .refstream import stream_manifest_ids
from .summary import CheckpointInfo, damaged_info, summarize_manifest


class Catalog:
    """The Store's checkpoints (a mix-in of :class:`~.repository.Store`, whose ``backend`` and index cache
    of checkpoint summaries it uses)."""

    def checkpoint_names(self) -> list[str]:
        names = []
        for info in self.backend.list("manifests/"):
            name = info.key[len("manifests/"):]
            if is_checkpoint_name(name):
                names.append(name)
        return names

    def list_checkpoints(self, *, include_damaged: bool = False) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first.

        A checkpoint whose manifest cannot be read is left out, or with ``include_damaged`` listed with
        ``damage`` set, placed by its manifest's modification time.
        """
        listed = {info.key[len("manifests/"):]: info for info in self.backend.list("manifests/")
                  if is_checkpoint_name(info.key[len("manifests/"):])}
        cached = self._cache_index().get_summaries()
        out, fresh = [], {}
        for name, obj in listed.items():
            info = None
            # Rewriting a manifest changes its mtime (unless within a second on S3: then its ETag), maybe its size.
            stamp = (obj.size_bytes, obj.mtime_s, self._content_version(obj))
            raw = cached.get(name)
            if raw is not None:
                try:
                    info = msgspec.msgpack.decode(raw, type=CheckpointInfo)
                except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
                    info = None
                if info is not None and (info.manifest_bytes, info.manifest_mtime_s, info.manifest_version) != stamp:
                    info = None
            if info is None:
                try:
                    m = self.read_manifest(name)
                except (CorruptManifestError, UnsupportedFormatError) as e:
                    # Listed as unreadable, with why (a newer format says so): one such manifest does not
                    # hide the others, and gc, which lists the damaged too, leaves the store alone.
                    if include_damaged:
                        out.append(damaged_info(name, obj, str(e)))
                    continue
                except (CheckpointNotFoundError, InvalidNameError):
                    continue  # stray files and manifests forgotten meanwhile are not checkpoints
                info = summarize_manifest(m, obj.size_bytes, obj.mtime_s, self._content_version(obj))
                fresh[name] = msgspec.msgpack.encode(info)
            out.append(info)
        stale = [n for n in cached if n not in listed]
        if fresh or stale:
            self._cache_index().put_summaries(fresh, drop=stale)
        out.sort(key=lambda i: (i.created_ns, i.name))
        return out

    def summarize(self, manifest: Manifest) -> CheckpointInfo:
        """The ``list_checkpoints`` entry of a manifest already read."""
        obj = self._manifest_object(manifest.name)
        if obj is None:
            return summarize_manifest(manifest, 0, 0.0)
        return summarize_manifest(manifest, obj.size_bytes, obj.mtime_s, self._content_version(obj))

    def _content_version(self, obj) -> str:
        """What, beside size and mtime, tells a manifest rewritten: its ETag where the backend's versions come
        from the bytes (a restored copy of the store keeps its summaries); else nothing."""
        return (obj.version or "") if self.backend.content_versions else ""

    def _manifest_object(self, name: str):
        """The ObjectInfo (size, mtime) of checkpoint ``name``'s manifest, or None."""
        key = manifest_key(name)
        return next((i for i in self.backend.list(key) if i.key == key), None)

    def resolve(self, name: str, *, fallback: bool = False) -> str:
        """The concrete checkpoint name for ``name`` (``latest`` = newest); CheckpointNotFoundError if none.

        A newest checkpoint whose manifest is damaged raises CorruptManifestError naming it, unless
        ``fallback``: then the newest readable checkpoint is chosen.
        """
        if name == LATEST:
            m = self._newest_manifest(fallback)
            if m is None:
                raise CheckpointNotFoundError(LATEST)
            return m.name
        validate_name(name)
        if not self.backend.exists(manifest_key(name)):
            names = self.checkpoint_names()
            nearby = difflib.get_close_matches(name, names, n=5, cutoff=0.5) or sorted(names, key=_natural)[-5:]
            raise CheckpointNotFoundError(name, nearby)
        return name

    def _newest_manifest(self, fallback: bool) -> Manifest | None:
        newest = self._newest(fallback)
        return newest[1] if newest is not None else None

    def _newest(self, fallback: bool) -> tuple[CheckpointInfo, Manifest] | None:
        """The newest checkpoint's listing and manifest (see :meth:`resolve` for ``fallback``)."""
        for info in reversed(self.list_checkpoints(include_damaged=True)):
            try:
                return info, self.read_manifest(info.name)  # a cached summary does not prove it still decodes
            except CheckpointNotFoundError:
                continue  # forgotten meanwhile
            except UnsupportedFormatError:
                if not fallback:
                    raise  # newer, not damaged: "upgrade deltackpt"
                continue
            except CorruptManifestError as e:
                damage = str(e)
            if not fallback:
                raise CorruptManifestError(f"the newest checkpoint is damaged: {damage}; load an older "
                                           "checkpoint by name", checkpoint=info.name)
        return None

    def read_manifest(self, name: str) -> Manifest:
        return self._read_manifest_as(name, manifest_from_body)

    def read_manifest_refs(self, name: str, with_ends: bool = False) -> ManifestRefs:
        """The chunk refs of checkpoint ``name`` in arrays (see ManifestRefs; ``with_ends``: each ref's end too),
        its manifest held to every check of read_manifest: for verify and gc, which need no object per item or
        per ref."""
        return self._read_manifest_as(name, partial(refs_from_body, with_ends=with_ends))

    def add_manifest_ids(self, name: str, collector: idset.Collector) -> None:
        """Add every chunk id checkpoint ``name`` references to ``collector`` (verify's and gc's sets), its
        manifest held to every check of read_manifest_refs: nothing is added when one fails, and the same error
        is raised. Read as a stream in bounded memory (see :mod:`.refstream`) where it can be."""
        name = self.resolve(name) if name == LATEST else validate_name(name)
        ends = collector.with_ends  # each ref's skip + length too (verify's check of the refs against chunk sizes)
        staged = stream_manifest_ids(self.backend, manifest_key(name), name, collector.fresh, ends)
        if isinstance(staged, tuple):
            collector.take(*staged)
        else:  # any doubt, or a small manifest read whole: the general reading decides
            refs = self._read_manifest_as(name, partial(refs_from_body, with_ends=ends), staged)
            collector.add(refs.ids, refs.ends)

    def _read_manifest_as(self, name: str, from_body, data: bytes | None = None):
        """``from_body`` of checkpoint ``name``'s manifest, its stored bytes ``data`` when already read."""
        name = self.resolve(name) if name == LATEST else validate_name(name)
        where = f"manifest {name!r}"
        try:
            stored = self.backend.get(manifest_key(name)) if data is None else data
            body = manifest_body(stored, where, checkpoint=name)  # stored bytes freed
            del stored, data
        except FileNotFoundError:
            self.resolve(name)  # raises CheckpointNotFoundError with nearby names
            raise CheckpointNotFoundError(name) from None
        m = from_body(body, where, checkpoint=name)
        if m.name != name:
            raise CorruptManifestError(f"manifest {name!r} says its name is {m.name!r}", checkpoint=name)
        return m

    def latest_manifest(self) -> Manifest | None:
        """The newest readable checkpoint's manifest (damaged ones are skipped), or None in an empty store."""
        return self._newest_manifest(fallback=True)

    def exists(self, name: str) -> bool:
        return self.backend.exists(manifest_key(name))


def _natural(name: str) -> list:
    """A sort key that orders the numbers in names by value: step-9 before step-10."""
    return [int(t) if k % 2 else t for k, t in enumerate(re.split(r"(\d+)", name))]
