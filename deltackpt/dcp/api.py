"""``deltackpt.save`` / ``load`` / ``async_save``: thin wrappers that build the writer or reader for DCP."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ..store import LATEST
from .planner import DeltaSavePlanner
from .reader import DeltaStorageReader
from .writer import DeltaStorageWriter


def save(state_dict: dict[str, Any], store, checkpoint_id: str, *, process_group=None, planner=None,
         overwrite: bool = False, metadata: dict[str, Any] | None = None, no_dist: bool = False,
         storage_options: dict | None = None):
    """``dcp.save`` into checkpoint ``checkpoint_id`` of ``store`` (a path, URL or Store); returns DCP's Metadata."""
    writer = DeltaStorageWriter(store, checkpoint_id, overwrite=overwrite, metadata=metadata,
                                storage_options=storage_options)
    with quiet_single_process():
        return dcp.save(state_dict, storage_writer=writer, planner=planner or DeltaSavePlanner(),
                        process_group=process_group, no_dist=no_dist)


def load(state_dict: dict[str, Any], store, checkpoint_id: str = LATEST, *, process_group=None, planner=None,
         no_dist: bool = False, storage_options: dict | None = None) -> str:
    """``dcp.load`` checkpoint ``checkpoint_id`` (default: the newest) in place; returns its name.

    A missing checkpoint raises CheckpointNotFoundError on every rank before any collective.
    """
    reader = DeltaStorageReader(store, checkpoint_id, storage_options=storage_options)
    with quiet_single_process():
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    return reader.checkpoint_id


def async_save(state_dict: dict[str, Any], store, checkpoint_id: str, *,
               async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
               process_group=None, planner=None, overwrite: bool = False,
               metadata: dict[str, Any] | None = None, storage_options: dict | None = None):
    """``dcp.async_save`` into ``store``; returns DCP's future. The state is copied before this returns."""
    writer = DeltaStorageWriter(store, checkpoint_id, overwrite=overwrite, metadata=metadata,
                                storage_options=storage_options)
    with quiet_single_process():
        return dcp.async_save(state_dict, storage_writer=writer, planner=planner or DeltaSavePlanner(),
                              process_group=process_group, async_checkpointer_type=async_checkpointer_type)


@contextmanager
def quiet_single_process():
    """Without a process group, silence DCP's "assuming the intent is to save/load in a single process"
    warning, which it repeats on every call; a single process is what our caller asked for."""
    if dist.is_available() and dist.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        yield
