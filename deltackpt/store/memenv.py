"""An in-memory stand-in for the LMDB environment of the chunk index (see ``index.py``): the index is kept
in dicts when no cache location can be written (a read-only store, a full disk)."""

from __future__ import annotations

import threading


class MemoryTxn:
    """The part of an LMDB transaction the index uses, over dicts: the index kept in memory."""

    def __init__(self, lock: threading.RLock | None, db: dict | None) -> None:
        self._lock, self._db = lock, db

    def __enter__(self) -> "MemoryTxn":
        if self._lock is not None:
            self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        if self._lock is not None:
            self._lock.release()

    def _pick(self, db) -> dict:
        return self._db if db is None else db

    def get(self, key, default=None, db=None):
        return self._pick(db).get(bytes(key), default)

    def put(self, key, value, db=None, overwrite=True) -> bool:
        d, key = self._pick(db), bytes(key)
        if not overwrite and key in d:
            return False
        d[key] = bytes(value)
        return True

    def delete(self, key, db=None) -> bool:
        return self._pick(db).pop(bytes(key), None) is not None

    def cursor(self, db=None) -> "_Cursor":
        return _Cursor(sorted(self._pick(db).items()))  # a snapshot, in key order like LMDB's

    def stat(self, db) -> dict:
        return {"entries": len(db)}

    def drop(self, db, delete=True) -> None:
        db.clear()


class _Cursor:
    """What is used of an LMDB cursor: iteration over (key, value), and ``iternext``."""

    def __init__(self, items: list) -> None:
        self._items = items

    def __iter__(self):
        return iter(self._items)

    def iternext(self, keys: bool = True, values: bool = True):
        for k, v in self._items:
            yield (k, v) if keys and values else (k if keys else v)


class MemoryEnv:
    """Stands in for an LMDB environment when no cache location can be written."""

    def __init__(self, db_names) -> None:
        self._lock = threading.RLock()  # writers only: a dict read or snapshot is atomic under the GIL
        self.dbs: dict[bytes, dict] = {name: {} for name in db_names}

    def begin(self, write: bool = False, db=None) -> MemoryTxn:
        return MemoryTxn(self._lock if write else None, db)
