"""Argument values shared by several commands: fractions, seconds, storage options, opening the store."""

from __future__ import annotations

import argparse
import json
import math

from .status import UsageError


def parse_fraction(text: str, option: str) -> float:
    """``10%`` or ``0.1`` -> 0.1 (the engine checks the range)."""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"{option} must be a fraction or a percentage (0.1 or 10%), got {text!r}") from None


def seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def count(text: str) -> int:
    """An argparse ``type``: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def duration(text: str) -> str:
    """An argparse ``type``: a duration longer than 0 such as 90s, 36h or 7d (the engine parses it again)."""
    from ..store.retention import parse_duration

    try:
        ok = parse_duration(text) > 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected a duration longer than 0 such as 90s, 15m, 36h, 7d or 2w, "
                                         f"got {text!r}")
    return text


# Options that are strings whatever they look like (a MinIO access key of digits is not a number).
STRING_OPTIONS = frozenset({"key", "secret", "token", "endpoint_url", "region_name", "profile", "username",
                            "password", "account_name", "account_key", "sas_token", "connection_string", "project"})


def parse_pairs(pairs, option: str) -> dict:
    """``KEY=VALUE`` pairs; VALUE parsed as JSON when it is JSON, else kept as a string (always a string for
    :data:`STRING_OPTIONS`)."""
    out: dict = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"{option} wants KEY=VALUE, got {pair!r}")
        if key in STRING_OPTIONS:
            out[key] = value
            continue
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def options_for(args, location: str, side: str | None = None) -> dict | None:
    """The ``--storage-option`` pairs for a URL; None for a local path (they would mean nothing there). With
    ``side`` (copy's "src" or "dst", ls's "remote"), that side's ``--src-storage-option`` pairs where given
    instead."""
    from ..store.location import scheme_of

    own = getattr(args, f"{side}_storage_option", None) if side else None
    shared = parse_pairs(getattr(args, "storage_option", None), "--storage-option")  # malformed is an error anywhere
    if scheme_of(location) in (None, "file"):
        if own:
            raise UsageError(f"--{side}-storage-option applies to a URL, not to the local path {location!r}")
        return None
    if own:
        return parse_pairs(own, f"--{side}-storage-option")
    return shared or None


def open_store(args):
    from ..store import Store

    return Store.open(args.store, storage_options=options_for(args, args.store))
