"""progress: how long engine operations say how far they are, without printing (restic's printer).

An operation that may take long (verify, gc, index rebuild, repair, copy) takes a ``progress`` object and
reports each phase: ``start(label, total, unit)``, then ``advance(n)`` as work is done, then ``done()``. The
engine never renders anything; the CLI passes a terminal bar, every other caller gets :data:`NULL_PROGRESS`.
Calls come from the thread running the operation, one phase at a time.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol, runtime_checkable


@runtime_checkable
class Progress(Protocol):
    def start(self, label: str, total: int, unit: str) -> None:
        """A phase begins: ``total`` units of ``unit`` ("B", "pack", "chunk", ...) to do."""

    def advance(self, n: int = 1) -> None:
        """``n`` more units of the current phase are done."""

    def done(self) -> None:
        """The current phase ended (also when it stopped early or failed)."""


class NullProgress:
    """Reports to no one: the default."""

    def start(self, label: str, total: int, unit: str) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def done(self) -> None:
        pass


NULL_PROGRESS = NullProgress()


@contextmanager
def phase(progress: Progress | None, label: str, total: int, unit: str) -> Iterator[Progress]:
    """``start`` a phase of ``progress`` (None: no one listens) and ``done`` it however the block ends."""
    progress = progress or NULL_PROGRESS
    progress.start(label, total, unit)
    try:
        yield progress
    finally:
        progress.done()
