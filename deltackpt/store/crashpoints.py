"""Crash injection for tests: ``DELTACKPT_CRASH_POINT=<label>`` makes the process SIGKILL itself there.

The labels mark the steps of the commit protocol, gc and forget (``crash_point("commit:before-manifest")``),
so tests can prove that a crash at each step leaves the store consistent. Unset, it costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

from .. import settings

_POINT = settings.crash_point()


def crash_point(label: str) -> None:
    if _POINT is not None and _POINT == label:
        os.kill(os.getpid(), signal.SIGKILL)
