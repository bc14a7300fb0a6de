"""DeltaSavePlanner: DCP's default save planner plus replica digests for silent-data-corruption checks.

DCP saves a replicated value once (from whichever rank it picks), so a bit flipped in one replica's memory
would be saved, or silently dropped, unnoticed. With this planner every rank hashes its copy of each
replicated tensor (plain tensors every rank holds, as under DDP; DTensor shards with a Replicate placement,
as in HSDP) while planning; DeltaStorageWriter's coordinator compares the digests before anything is
written and raises SilentDataCorruptionError naming the item and the disagreeing ranks.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from typing import Iterable

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.tensor import DTensor, Replicate

from ..errors import ManifestFormatError, UnsafeSourceError
from ..store import paused_gc
from .placement import item_key, tensor_bytes


def _replicated(value) -> bool:
    if isinstance(value, DTensor):
        return any(isinstance(p, Replicate) for p in value.placements)
    return isinstance(value, torch.Tensor)


class DeltaSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner that also records a digest of every replicated tensor this rank holds.

    ``unchecked``: keys (DCP's flattened fqns) of plain tensors each rank holds its own of, not replicas
    (BatchNorm's running stats under DDP or FSDP: ``TrainState.buffer_keys``). Their digests are not compared.
    ``digests=False``: no digest at all (a save with ``replica_check="off"``: hashing every replica would cost
    a pass over the state for nothing).
    """

    def __init__(self, *args, unchecked: Iterable[str] = (), digests: bool = True, **kwargs) -> None:
        if kwargs.get("enable_plan_caching"):
            raise ValueError("DeltaSavePlanner does not take enable_plan_caching: DeltaStorageWriter needs every "
                             "rank's full plan at every save (each carries that save's parent checkpoint)")
        super().__init__(*args, **kwargs)
        self.unchecked = frozenset(unchecked)  # a set, not a callable: process-mode async saves pickle the planner
        self.digests = digests

    def create_local_plan(self) -> SavePlan:
        # DCP's planning makes a few objects per item and no cycles: the collector, paused as on the write path,
        # would otherwise scan the process's long-lived objects (a gen-0 pass every 700 allocations).
        with paused_gc():
            plan = super().create_local_plan()
        if not (self.digests and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return plan
        unchecked = self.unchecked
        digests = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.index.fqn in unchecked \
                    or not _replicated(self.state_dict.get(item.index.fqn)):
                continue
            _, raw, _ = tensor_bytes(self.resolve_data(item))
            digests[item_key(item.index)] = xxhash.xxh3_128_hexdigest(raw)
        return dataclasses.replace(plan, storage_data={"replica_digests": digests})

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        with paused_gc():  # (see create_local_plan)
            return super().create_global_plan(all_plans)

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        # One plan has no item in another to drop: DCP's pass would copy it unchanged (sets and a dict of every
        # item: 2.9 % of the instructions of a fine-tune's first save of 370 items, measured with callgrind).
        if len(all_plans) == 1:
            return list(all_plans)
        return super()._dedup_save_plans(all_plans)


def first_line(e: BaseException) -> str:
    """The line of an error that says what went wrong (torch's weights_only refusal says it after a preamble)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    named = [line for line in lines if "WeightsUnpickler error" in line or "GLOBAL" in line]
    return (named or lines or [type(e).__name__])[0][:200]


class PlainBytes:
    """Load-planner mixin: a checkpoint's non-tensor values are unpickled as plain data only
    (``weights_only=True``: numbers, strings, containers, tensors, BytesIO). DCP's own planners use
    ``weights_only=False``, which runs any code a checkpoint holds (one imported, or copied in from another
    cluster). ``refusal_hint``: what the UnsafeSourceError for anything else suggests."""

    refusal_hint = "load it with planner=DefaultLoadPlanner() if you trust where it came from"

    def load_bytes(self, read_item, value) -> None:
        try:
            with torch.serialization.safe_globals([io.BytesIO]):  # DCP pickles a BytesIO value as one: bytes
                obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeSourceError(f"value {read_item.dest_index.fqn!r} needs unpickling beyond plain data "
                                    f"({first_line(e)}); {self.refusal_hint}") from None
        except (RuntimeError, EOFError, ValueError) as e:  # not a torch.save blob (empty, truncated, other bytes)
            raise ManifestFormatError(f"value {read_item.dest_index.fqn!r} is not a torch.save blob "
                                      f"({first_line(e)})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class PlainLoadPlanner(PlainBytes, DefaultLoadPlanner):
    """DCP's default load planner with :class:`PlainBytes`: what ``deltackpt.load`` and CheckpointManager
    use unless given a planner."""
