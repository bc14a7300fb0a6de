"""How commands write: JSON or text on stdout, tables, sizes, and progress bars on a terminal's stderr."""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
from typing import Callable


class StdoutClosed(Exception):
    """The reader of our stdout went away (`| head -1`): not an error."""


def silence_stdout() -> None:
    """Point stdout at /dev/null (the recipe in Python's signal docs): the reader went away, and the command
    goes on to its own exit status without failing on every later write or on the interpreter's last flush."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass  # stdout is not a file descriptor (captured): nothing to silence


def out(text: str) -> None:
    try:
        print(text)
    except BrokenPipeError:
        silence_stdout()  # `verify | head -1` still exits 1 when it found damage


def emit(args, data, text: Callable[[], str]) -> None:
    """``data`` as JSON with ``--json``, else the text ``text()`` renders. The JSON is strict: a float that is
    not finite (a diverged run's ``loss: nan`` in checkpoint metadata) is written as null (NaN) or as the
    string "inf" / "-inf", as ``diff`` does, never as the bare ``NaN`` that jq and most parsers refuse."""
    out(json.dumps(jsonable(data), indent=2, sort_keys=True, allow_nan=False) if args.json else text())


def jsonable(value):
    """``value`` as strict JSON can hold it: non-finite floats as null / "inf" / "-inf", bytes as hex, keys as
    strings, times (msgpack's timestamps, which metadata may hold) in ISO 8601, anything else as its text."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value is None or isinstance(value, (str, int, float)):  # (bool is an int)
        return value
    if isinstance(value, dict):  # (metadata may have int keys, which JSON names by their text)
        return {k if isinstance(k, str) else str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    return str(value)


def fmt_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_ratio(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.2f}x"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


class ProgressBar:
    """The engine's progress (deltackpt.store.progress.Progress) as a tqdm bar per phase on stderr when it is a
    terminal and not --json; else nothing. A context manager: a bar an error left open is closed."""

    def __init__(self, args) -> None:
        self.enabled = sys.stderr.isatty() and not args.json
        self.bar = None

    def __enter__(self):
        from ..store.progress import NULL_PROGRESS

        return self if self.enabled else NULL_PROGRESS

    def start(self, label: str, total: int, unit: str) -> None:
        from tqdm import tqdm

        self.done()
        if total <= 0:
            return  # nothing to do: no bar
        self.bar = tqdm(total=total, desc=label, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                        file=sys.stderr, leave=False, dynamic_ncols=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def done(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __exit__(self, *exc) -> None:
        self.done()
