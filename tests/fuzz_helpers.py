"""Shared pieces of the parser fuzz tests (tests/store and tests/dcp): hypothesis settings, byte mutations."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from deltackpt.errors import DeltackptError

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
# The metadata parsers promise ManifestFormatError (a DeltackptError and a ValueError); the codecs promise
# ValueError. Nothing else may escape.
OUR_ERRORS = (DeltackptError,)
MiB = 1 << 20


def attempt(fn, *args, errors=OUR_ERRORS):
    """fn(*args), or None if it raised one of ``errors``; anything else propagates and fails the test."""
    try:
        return fn(*args)
    except errors:
        return None


# -- mutations ---------------------------------------------------------------------------------------------------

_op = st.tuples(st.sampled_from(["flip", "set", "delete", "insert", "truncate", "dup"]),
                st.integers(0, 1 << 30), st.integers(0, 255), st.binary(max_size=16))
mutations = st.lists(_op, min_size=1, max_size=6)


def mutate(data: bytes, ops, lo: int = 0) -> bytes:
    """Apply ``ops`` to ``data[lo:]`` (``lo`` protects a prefix)."""
    b = bytearray(data)
    for kind, pos, val, blob in ops:
        n = len(b) - lo
        if n <= 0:
            b += blob
            continue
        i = lo + pos % n
        if kind == "flip":
            b[i] ^= 1 << (val % 8)
        elif kind == "set":
            b[i] = val
        elif kind == "delete":
            del b[i:i + 1 + val % 16]
        elif kind == "insert":
            b[i:i] = blob
        elif kind == "truncate":
            del b[i:]
        else:
            b[i:i] = b[i:i + 1 + val % 32]
    return bytes(b)
