"""How the DCP layer names things in the store: checkpoint ids are checkpoint names, and DCP's metadata
lives in each manifest's ``layer_data`` under ``LAYER_KEY``."""

from __future__ import annotations

import os

from ..store import validate_name

LAYER_KEY = "dcp"


def checkpoint_name(checkpoint_id: str | os.PathLike) -> str:
    """The store checkpoint name a DCP ``checkpoint_id`` means (validated: no '/', no '..').

    Raises ValueError for an id that is neither a string nor a path, InvalidNameError for a bad name.
    """
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    if not isinstance(checkpoint_id, str):
        raise ValueError(f"checkpoint_id must be a string name, got {type(checkpoint_id).__name__}")
    return validate_name(checkpoint_id)
