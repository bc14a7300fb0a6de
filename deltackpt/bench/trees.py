"""State-dict trees (nested dicts, lists and tuples of tensors): zero, clone, allocate alike, compare bits."""

from __future__ import annotations

import torch


def zero_tree(obj) -> None:
    if isinstance(obj, torch.Tensor):
        obj.detach().zero_()
    elif isinstance(obj, dict):
        for v in obj.values():
            zero_tree(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            zero_tree(v)


def clone_tree(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def fresh_like(obj):
    """Same structure, every tensor newly allocated and zero-filled (pages touched): a load target."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: fresh_like(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(fresh_like(v) for v in obj)
    return obj


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]) if t.element_size() in ints and t.numel() else t


def tree_equal(a, b) -> bool:
    """Bit-exact comparison of two state-dict trees."""
    if isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bits(a), _bits(b)))
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(tree_equal(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(tree_equal(x, y) for x, y in zip(a, b))
    return a == b
