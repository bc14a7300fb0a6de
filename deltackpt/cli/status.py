"""Exit statuses of every command and the one table that maps an exception to its status."""

from __future__ import annotations

import argparse

from ..errors import DeltackptError, InvalidNameError

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

EXIT_STATUS = ((EXIT_OK, "success"), (EXIT_PROBLEMS, "problems found (e.g. verify found damage)"),
               (EXIT_USAGE, "usage error (bad arguments, invalid checkpoint name)"),
               (EXIT_ERROR, "deltackpt error (not a store, unknown checkpoint, corrupt data, ...)"),
               (EXIT_INTERRUPTED, "interrupted"))
EPILOG = "exit status:\n" + "\n".join(f"  {code:<4} {text}" for code, text in EXIT_STATUS) + """

errors: one line on stderr (a traceback with --debug); with --json, this object on stdout instead:
  {"error": {"type": "CheckpointNotFoundError", "message": "...", "exit_code": 3}}
output cut short by a closed pipe (e.g. `| head -1`) leaves the command's own exit status, nothing on stderr."""


class UsageError(ValueError):
    """Bad command-line arguments (exit 2); carries the parser whose usage line fits, when one does."""

    def __init__(self, message: str, parser: argparse.ArgumentParser | None = None):
        super().__init__(message)
        self.parser = parser


def _interrupted(exc: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def exit_code_for(exc: BaseException) -> int:
    """One table from exception to exit status; anything else is re-raised (a bug, shown with its traceback)."""
    if _interrupted(exc):  # also an error raised while handling a Ctrl-C (an import it cut short)
        return EXIT_INTERRUPTED
    if isinstance(exc, InvalidNameError) or (isinstance(exc, ValueError) and not isinstance(exc, DeltackptError)):
        return EXIT_USAGE
    if isinstance(exc, DeltackptError):
        return EXIT_ERROR
    if isinstance(exc, (OSError, ValueError)):
        return EXIT_ERROR
    raise exc
