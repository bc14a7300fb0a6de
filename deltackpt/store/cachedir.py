"""Where a store's index cache lives: inside a store on a local disk, else on the node (the user's cache).

LMDB's locks hold only among processes of one host, so a store on a file system several hosts mount, or on
object storage, keeps its cache node-local; ``DELTACKPT_CACHE_DIR`` overrides both (``DIR/<store_id>``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .. import settings
from .backend import Backend, local_root

# File systems that several hosts mount: a store there keeps its index cache on the local node.
_SHARED_FS = {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph", "glusterfs", "9p",
              "panfs", "wekafs", "afs", "ocfs2", "gfs2", "fuse.glusterfs", "fuse.sshfs", "fuse.juicefs",
              "fuse.gcsfuse", "fuse.s3fs", "fuse.mountpoint-s3", "fuse.cephfs", "fuse.rclone"}


def default_cache_dir(backend: Backend, store_id: str) -> Path:
    env = settings.cache_dir()
    if env:
        return Path(env) / store_id
    local = local_root(backend)
    if local is not None and not on_shared_filesystem(local):
        return local / "cache"
    # Object storage, or a directory several hosts open (LMDB's locks do not work across hosts): node-local.
    return user_cache_dirs(store_id)[0]


def mount_type(path) -> str | None:
    """The file system type of the mount holding ``path`` (from /proc/mounts), or None if unknown."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    target = os.path.realpath(path)
    best, kind = "", None
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fstype
    return kind


def on_shared_filesystem(path) -> bool:
    return mount_type(path) in _SHARED_FS


def user_cache_dirs(store_id: str) -> list[Path]:
    """Where this user's index cache of a store goes when the default place cannot be written (a read-only
    store, another user's): the user's cache directory, else (no usable home) a per-user temp directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(base) / "deltackpt" / store_id,
            Path(tempfile.gettempdir()) / f"deltackpt-{os.getuid()}" / store_id]
