"""The few pytree helpers fvx needs, on optree.

A pytree here is any nesting of dicts, lists, tuples, NamedTuples and registered nodes whose leaves are tensors
(or other values, which the tensor helpers pass through untouched). ``None`` is an empty subtree, as in optree.
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

Tree = Any
Mask = Any  # a pytree of bools with the structure of the tree, or a function tree -> such a pytree


def map_tensors(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """Apply ``fn`` to every tensor leaf (with the matching leaves of ``rest``); other leaves pass through."""
    return optree.tree_map(lambda x, *ys: fn(x, *ys) if isinstance(x, torch.Tensor) else x, tree, *rest)


def tensor_leaves(tree: Tree) -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` in optree's canonical order."""
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def zeros_like(tree: Tree) -> Tree:
    """A tree of zero tensors with the shapes, dtypes and devices of ``tree``'s tensor leaves."""
    return map_tensors(torch.zeros_like, tree)


def global_norm(tree: Tree) -> torch.Tensor:
    """sqrt(sum of squares over every floating-point tensor leaf), as a 0-dim fp32 tensor (one foreach kernel)."""
    leaves = [x for x in tensor_leaves(tree) if x.is_floating_point()]
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(leaves, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)


def cast(tree: Tree, dtype: torch.dtype) -> Tree:
    """Cast floating-point tensor leaves to ``dtype``; integer and bool leaves keep theirs."""
    return map_tensors(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)


def to_device(tree: Tree, device: torch.device | str, non_blocking: bool = False) -> Tree:
    """Move every tensor leaf to ``device``."""
    return map_tensors(lambda x: x.to(device, non_blocking=non_blocking), tree)


def _resolve_mask(tree: Tree, mask: Mask) -> Tree:
    mask = mask(tree) if callable(mask) else mask
    try:
        return optree.tree_broadcast_prefix(mask, tree)
    except ValueError as e:
        raise ValueError(f"mask does not match the tree's structure: {e}") from None


def partition(tree: Tree, mask: Mask) -> tuple[Tree, Tree]:
    """Split ``tree`` into (selected, rest) by a bool ``mask``; each keeps the structure with ``None`` holes.

    ``mask`` is a pytree of bools (a prefix of ``tree`` is enough: ``{"blocks": True, "head": False}``) or a function
    of the tree returning one. ``combine(*partition(t, m))`` gives back ``t``.
    """
    full = _resolve_mask(tree, mask)
    selected = optree.tree_map(lambda x, m: x if m else None, tree, full)
    rest = optree.tree_map(lambda x, m: None if m else x, tree, full)
    return selected, rest


def combine(*trees: Tree) -> Tree:
    """Merge trees of the same structure by taking, at each leaf, the first that is not ``None``."""

    def first(*xs):
        return next((x for x in xs if x is not None), None)

    return optree.tree_map(first, *trees, none_is_leaf=True)
