"""Every ``DELTACKPT_*`` environment variable, read here and nowhere else (torchsnapshot's ``knobs.py``).

Each function reads the environment when called, so tests and launchers can set a variable before the code
that uses it runs; a malformed value is a ``ValueError`` naming the variable.

==============================  =========================================================================
variable                        effect
==============================  =========================================================================
``DELTACKPT_KERNELS``           ``auto`` (C kernels if built, else numpy), ``native`` or ``numpy``
``DELTACKPT_REQUIRE_NATIVE``    ``1``: fail at import if the C kernels are missing (CI sets it)
``DELTACKPT_BASE_CACHE_BYTES``  memory per Store object for the previous save's keyframes; fixes the cap
                                (0 = off); unset: 256 MiB for CheckpointManager and multi-rank saves, else
                                0 until a Store object is used a second time
``DELTACKPT_CACHE_DIR``         where index caches live (``DIR/<store_id>``); unset: inside a local store,
                                else the user's cache directory
``DELTACKPT_CRASH_POINT``       tests only: SIGKILL the process at this commit/gc/forget step
==============================  =========================================================================
"""

from __future__ import annotations

import os

KERNEL_CHOICES = ("auto", "native", "numpy")


def kernels() -> str:
    """The kernel backend asked for: 'auto', 'native' or 'numpy'."""
    raw = os.environ.get("DELTACKPT_KERNELS", "auto")
    choice = raw.strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"DELTACKPT_KERNELS={raw!r} is not valid; allowed values: {', '.join(KERNEL_CHOICES)}")
    return choice


def require_native() -> bool:
    return os.environ.get("DELTACKPT_REQUIRE_NATIVE", "").strip() == "1"


def base_cache_bytes() -> int | None:
    """The keyframe cache cap the environment fixes, or None when it leaves the choice to deltackpt."""
    raw = os.environ.get("DELTACKPT_BASE_CACHE_BYTES")
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"DELTACKPT_BASE_CACHE_BYTES must be an integer byte count, got {raw!r}") from None
    if value < 0:
        raise ValueError("DELTACKPT_BASE_CACHE_BYTES must be >= 0")
    return value


def cache_dir() -> str | None:
    """The directory under which index caches live (one per store id), or None for the default places."""
    return os.environ.get("DELTACKPT_CACHE_DIR") or None


def crash_point() -> str | None:
    return os.environ.get("DELTACKPT_CRASH_POINT") or None
