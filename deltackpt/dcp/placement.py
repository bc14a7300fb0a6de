"""Mapping DCP write items to store items: keys, placement in the global tensor, raw bytes."""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex


def item_key(index: MetadataIndex) -> str:
    """A store item key for a DCP item: ``fqn@o0,o1,...`` for a tensor chunk, ``fqn@b`` for a byte item.

    The suffix after the last '@' tells the kinds apart, so keys are unique whatever the fqn contains.
    """
    if index.offset is None:
        return f"{index.fqn}@b"
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def shard_placement(fqn: str, key: str, offsets: Sequence[int], sizes: Sequence[int], global_size: Sequence[int],
                    elem_bytes: int) -> tuple[str, int]:
    """(group, global byte offset) of a tensor chunk.

    A chunk that is one contiguous range of the row-major global tensor (a whole tensor, a dim-0 shard, a
    row of a dim-1 shard) is placed in the global tensor's byte space (group = fqn), so its store chunks line
    up whatever the sharding. Any other box is chunked on its own (group = its key, offset 0).
    """
    if tuple(sizes) == tuple(global_size):  # a whole tensor, the common case (357 of a fine-tune's items)
        return (fqn, 0) if math.prod(sizes) else (key, 0)
    offsets, sizes, global_size = list(offsets), list(sizes), list(global_size)
    if math.prod(sizes) == 0:
        return key, 0
    differing = [i for i, (s, g) in enumerate(zip(sizes, global_size)) if s != g]
    if differing and any(sizes[i] != 1 for i in range(differing[-1])):
        return key, 0
    stride, elem_offset = 1, 0
    for i in reversed(range(len(global_size))):
        elem_offset += offsets[i] * stride
        stride *= global_size[i]
    return fqn, elem_offset * elem_bytes


def unsupported_layout(value: torch.Tensor) -> str | None:
    """Why ``value``'s bytes cannot stand for it in a checkpoint, or None when they can."""
    if value.is_meta:  # (checked first: a meta tensor has a layout and no bytes to copy out)
        return ("a meta tensor has a shape and dtype but no data to store; materialize it first (e.g. "
                "module.to_empty(device='cpu') and initialize or load its values)")
    if value.layout != torch.strided:
        return (f"a {str(value.layout).removeprefix('torch.')} tensor has no plain bytes to store; save its "
                ".to_dense(), or its indices and values as tensors")
    if value.is_quantized:
        return ("a quantized tensor's bytes lose its scale and zero point; save its .dequantize(), or its "
                ".int_repr() and its quantization parameters as tensors")
    return None


def tensor_bytes(value) -> tuple[torch.Tensor, "object", int]:
    """(contiguous CPU tensor, its bytes as a numpy uint8 array, element size for byte planes).

    Few torch calls per tensor (each may hand the GIL to the coding threads): the byte view is taken in numpy.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a tensor from the planner, got {type(value).__name__}")
    why = unsupported_layout(value)
    if why is not None:
        raise TypeError(why)
    t = value.detach() if value.requires_grad else value  # (numpy() refuses a tensor that requires grad)
    if not t.is_cpu:
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    size = t.element_size()
    elem_size = size if size in (1, 2, 4, 8) else 8 if size % 8 == 0 else 1
    if not t.numel():
        return t, b"", elem_size
    if t.is_conj() or t.is_neg():  # a lazy conjugate/negative view: its memory is not its values
        t = t.resolve_conj().resolve_neg()
    if t.dtype not in _NOT_NUMPY:
        try:
            return t, t.numpy().reshape(-1).view(np.uint8), elem_size
        except TypeError:  # a dtype numpy lacks (bfloat16, float8, ...); the failed try costs ~12 us: once
            _NOT_NUMPY.add(t.dtype)
    return t, t.reshape(-1).view(torch.uint8).numpy(), elem_size


_NOT_NUMPY: set = set()  # torch dtypes that Tensor.numpy() refuses


class Shard(NamedTuple):
    """One shard of a tensor as a store ChunkWriter takes it: ``add_array(key, raw, dtype=..., ...)``."""

    raw: object  # its bytes (a uint8 array over the tensor's memory, or b"")
    dtype: str
    elem_size: int
    shape: tuple
    group: str
    offset: int  # its byte offset in the global tensor


def prepare_shard(key: str, fqn: str, value, offsets: Sequence[int], sizes: Sequence[int],
                  global_size: Sequence[int]) -> Shard:
    """One shard of a tensor (``offsets``/``sizes`` within ``global_size``) placed in the whole tensor, so its
    chunks line up with any other sharding of the same tensor."""
    try:
        tensor, raw, elem_size = tensor_bytes(value)  # (it checks the layout: once per item, not twice)
    except TypeError as e:
        raise TypeError(f"item {key!r}: {e}") from None
    group, offset = shard_placement(fqn, key, offsets, sizes, global_size, tensor.element_size())
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        dtype = _DTYPE_NAMES[tensor.dtype] = str(tensor.dtype).removeprefix("torch.")
    return Shard(raw, dtype, elem_size, tensor.shape, group, offset)


def bytes_in_place(value) -> bool:
    """Whether :func:`tensor_bytes` of ``value`` is a view of its memory (a CPU tensor as it is), not a copy:
    such bytes can be hashed ahead of the writer (a GPU tensor's copy is made only when it is written)."""
    return (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.layout == torch.strided
            and not value.is_quantized and value.is_contiguous() and not value.is_conj() and not value.is_neg())


def add_shard(writer, key: str, fqn: str, value, offsets: Sequence[int], sizes: Sequence[int],
              global_size: Sequence[int]) -> None:
    """Add one shard of a tensor to a store ChunkWriter at its place in the whole tensor."""
    add_prepared(writer, key, prepare_shard(key, fqn, value, offsets, sizes, global_size))


def add_prepared(writer, key: str, s: Shard) -> None:
    """Add a shard :func:`prepare_shard` made to a store ChunkWriter."""
    writer.add_array(key, s.raw, dtype=s.dtype, elem_size=s.elem_size, shape=s.shape, group=s.group,
                     global_offset=s.offset)


_DTYPE_NAMES: dict = {}  # torch dtype -> its name in the store ("float32")
