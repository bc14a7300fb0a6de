"""StagingBuffers: the training-safe copy of a state dict that an async save writes from, kept from save to save.

``dcp.async_save`` blocks training while it "stages" the state (copies it so training may go on mutating it).
A fresh copy allocates and page-faults the whole state every save; these buffers are allocated once and
refilled with ``copy_``, so from the second save on the stall is a memory copy. The background save then
reads the buffers in place (they are contiguous CPU tensors: no further copy).

- CUDA tensors are copied into pinned host memory with non-blocking copies on the tensor's current stream
  (ordered after the kernels that produced the values), waited for once at the end.
- The buffers are re-created when the state's structure, shapes, dtypes, devices or DTensor layouts change.
- Tensors that share memory in the state (tied weights) share one buffer.
- Non-tensor leaves are copied (``BytesIO``) or deep-copied (anything mutable), never aliased.
- Memory: one copy of the local state (``nbytes``), freed by :meth:`close`.
"""

from __future__ import annotations

import copy
import io
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch
from torch.cuda import _pin_memory_utils
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

_IMMUTABLE = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)


def _is_plain(value) -> bool:
    return type(value) in (torch.Tensor, torch.nn.Parameter) or isinstance(value, DTensor)


def _describe(value: torch.Tensor) -> tuple:
    """What a buffer must match: the local tensor's shape/dtype/device, and a DTensor's layout."""
    local = value._local_tensor if isinstance(value, DTensor) else value
    desc = (tuple(local.shape), local.dtype, local.device)
    if isinstance(value, DTensor):
        desc += (value.device_mesh, tuple(value.placements), tuple(value.shape), tuple(value.stride()))
    return desc


def _alias_key(local: torch.Tensor) -> tuple:
    return (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
            tuple(local.stride()), local.dtype)


def _copy_leaf(value):
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, io.BytesIO):
        return io.BytesIO(value.getbuffer())  # copies the bytes
    return copy.deepcopy(value)


class StagingBuffers:
    """Buffers an async save stages into, reused while the state keeps its layout.

    ``share_memory``: allocate the buffers in shared memory (for ``AsyncCheckpointerType.PROCESS``, which hands
    them to its background process; pinned too for CUDA tensors). Otherwise the first PROCESS save moves them
    into shared memory itself, once.

    One save at a time: :meth:`stage` first waits for the save registered with :meth:`hold_until` (the buffers
    must not change under a background save still reading them).
    """

    def __init__(self, *, share_memory: bool = False) -> None:
        self.share_memory = share_memory
        self._layout: tuple | None = None
        self._buffers: list[torch.Tensor] = []
        self._slots: list[int | None] = []  # per leaf: its buffer, or None for a non-tensor leaf
        self._wrappers: dict[int, DTensor] = {}  # leaf -> the DTensor built once around its buffer
        self._events: list[torch.cuda.Event] = []
        self._storages: list[torch.UntypedStorage] = []  # shared+pinned ones, unpinned as they are freed
        self._held: Future | None = None
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers now."""
        return sum(b.untyped_storage().nbytes() for b in self._buffers)

    def stage(self, state_dict: Any) -> Any:
        """A copy of ``state_dict`` (same structure) whose tensors are this object's CPU buffers."""
        with self._lock:
            self._wait_held()
            leaves, spec = tree_flatten(state_dict)
            tensors = [(i, v) for i, v in enumerate(leaves) if _is_plain(v)]
            layout = (spec, tuple((i, _describe(v)) for i, v in tensors),
                      tuple(self._alias_groups(tensors)))
            if layout != self._layout:
                self._allocate(leaves, tensors, layout)
            out = list(leaves)
            streams = {}
            for i, value in enumerate(leaves):
                slot = self._slots[i]
                if slot is None:
                    out[i] = _copy_leaf(value)
                    continue
                local = value._local_tensor if isinstance(value, DTensor) else value
                buf = self._buffers[slot]
                if local.is_cuda:
                    streams.setdefault(local.device, torch.cuda.current_stream(local.device))
                    buf.copy_(local.detach(), non_blocking=True)
                else:
                    buf.copy_(local.detach())
                out[i] = self._wrappers.get(i, buf)
            self._events = []
            for stream in streams.values():
                event = torch.cuda.Event()
                event.record(stream)
                self._events.append(event)
            # The copies must be complete when this returns: a PROCESS save pickles the buffers, and the planner
            # hashes replicas, in background work that starts before DCP would call synchronize_staging.
            self.synchronize()
            return tree_unflatten(out, spec)

    def synchronize(self) -> None:
        """Wait for the non-blocking device-to-host copies of the last :meth:`stage`."""
        for event in self._events:
            event.synchronize()
        self._events = []

    def hold_until(self, fut: Future) -> None:
        """The buffers are in use until ``fut`` (the background save) is done; the next stage waits for it."""
        self._held = fut

    def close(self) -> None:
        """Free the buffers (after the held save, if any, is done). A later stage allocates them again."""
        with self._lock:
            self._wait_held()
            self.synchronize()
            self._layout, self._buffers, self._slots, self._wrappers, self._storages = None, [], [], {}, []

    def _wait_held(self) -> None:
        if self._held is not None:
            wait_futures([self._held])  # its outcome belongs to whoever started that save
            self._held = None

    @staticmethod
    def _alias_groups(tensors: list[tuple[int, torch.Tensor]]) -> list[int]:
        """For each tensor leaf, the position of the first leaf that views the same memory the same way."""
        first: dict[tuple, int] = {}
        groups = []
        for pos, (_, v) in enumerate(tensors):
            local = v._local_tensor if isinstance(v, DTensor) else v
            groups.append(first.setdefault(_alias_key(local), pos))
        return groups

    def _allocate(self, leaves: list, tensors: list[tuple[int, torch.Tensor]], layout: tuple) -> None:
        # the old buffers go before the new ones come: at most one staged copy at a time
        self._layout, self._buffers, self._wrappers, self._storages = None, [], {}, []
        slots: list[int | None] = [None] * len(leaves)
        for pos, (i, value) in enumerate(tensors):
            group = layout[2][pos]
            if group != pos:
                slots[i] = slots[tensors[group][0]]
            else:
                local = value._local_tensor if isinstance(value, DTensor) else value
                slots[i] = len(self._buffers)
                self._buffers.append(self._empty(local))
            if isinstance(value, DTensor):
                # DTensor's own constructor: from_local would move a CPU buffer to a CUDA mesh's device
                self._wrappers[i] = DTensor(self._buffers[slots[i]], value._spec, requires_grad=False)
        self._slots, self._layout = slots, layout

    def _empty(self, like: torch.Tensor) -> torch.Tensor:
        pin = like.is_cuda
        if not self.share_memory:
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
        storage = torch.UntypedStorage._new_shared(like.numel() * like.element_size())
        self._storages.append(storage)
        if pin and storage.nbytes():
            _pin_memory_utils.pin_memory(storage.data_ptr(), storage.nbytes())
            # unpinned when the storage is freed; not at exit, after CUDA may be gone
            weakref.finalize(storage, _pin_memory_utils.unpin_memory, storage.data_ptr()).atexit = False
        return torch.empty(0, dtype=like.dtype).set_(storage, 0, like.shape)
