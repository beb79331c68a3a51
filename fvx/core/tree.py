"""The few pytree helpers fvx needs, on optree.

A pytree here is any nesting of dicts, lists, tuples, NamedTuples and nodes registered with :func:`register_node` whose
leaves are tensors (or other values, which the tensor helpers pass through untouched). ``None`` is an empty subtree, as
in optree. fvx registers its own node types (e.g. ``fvx.distributed.sharding.Shards``, a params dict that carries its
shard layout as static metadata, as JAX keeps static fields in the treedef) in optree's namespace ``"fvx"``: flatten and
map fvx trees with the functions here (or pass ``namespace=fvx.core.tree.NAMESPACE`` to optree), never with another
pytree library.
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

Tree = Any
Mask = Any  # a pytree of bools with the structure of the tree, or a function tree -> such a pytree
NAMESPACE = "fvx"  # optree's registry namespace of fvx's node types


def register_node(cls: type, flatten: Callable, unflatten: Callable) -> type:
    """Register ``cls`` as a pytree node in fvx's namespace (optree's ``flatten -> (children, metadata, entries)``
    and ``unflatten(metadata, children)``); returns ``cls``, so it works as a class decorator's body."""
    return optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)


def flatten(tree: Tree, *, none_is_leaf: bool = False, is_leaf: Callable | None = None) -> tuple[list, Any]:
    """(leaves, treedef) of ``tree``, fvx's node types included."""
    return optree.tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def flatten_with_path(tree: Tree, *, none_is_leaf: bool = False) -> tuple[list[tuple], list, Any]:
    """(paths, leaves, treedef) of ``tree``: each path the tuple of keys (dict keys, field names, indices)."""
    return optree.tree_flatten_with_path(tree, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def unflatten(treedef: Any, leaves: list) -> Tree:
    return optree.tree_unflatten(treedef, leaves)


def tree_map(fn: Callable[..., Any], tree: Tree, *rest: Tree, none_is_leaf: bool = False,
             is_leaf: Callable | None = None) -> Tree:
    """optree's ``tree_map`` in fvx's namespace."""
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def leaves(tree: Tree, *, is_leaf: Callable | None = None) -> list:
    return optree.tree_leaves(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def named_leaves(tree: Tree, *, is_leaf: Callable | None = None) -> list[tuple[tuple[str, ...], Any]]:
    """``(path, leaf)`` for every leaf, the path the names of the keys on the way: dict keys, NamedTuple field names,
    sequence indices (as text). ``None`` is an empty subtree."""
    accessors, values, _ = optree.tree_flatten_with_accessor(tree, is_leaf=is_leaf, namespace=NAMESPACE)
    return [(_path(accessor), value) for accessor, value in zip(accessors, values)]


def map_with_path(fn: Callable[[tuple[str, ...], Any], Any], tree: Tree, *, is_leaf: Callable | None = None) -> Tree:
    """``tree`` with each leaf replaced by ``fn(path, leaf)`` (paths as :func:`named_leaves` names them)."""
    accessors, values, treedef = optree.tree_flatten_with_accessor(tree, is_leaf=is_leaf, namespace=NAMESPACE)
    return optree.tree_unflatten(treedef, [fn(_path(a), v) for a, v in zip(accessors, values)])


def _path(accessor: Any) -> tuple[str, ...]:
    return tuple(str(getattr(entry, "field", None) or entry.entry) for entry in accessor)


def map_tensors(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """Apply ``fn`` to every tensor leaf (with the matching leaves of ``rest``); other leaves pass through."""
    return tree_map(lambda x, *ys: fn(x, *ys) if isinstance(x, torch.Tensor) else x, tree, *rest)


def tensor_leaves(tree: Tree) -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` in optree's canonical order."""
    return [x for x in leaves(tree) if isinstance(x, torch.Tensor)]


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


def broadcast_prefix(prefix: Tree, tree: Tree) -> Tree:
    """``prefix`` (a pytree that is a prefix of ``tree``'s structure: ``{"blocks": True, "head": False}``) with each of
    its leaves repeated over the subtree of ``tree`` below it; a ValueError when it is no prefix."""
    try:
        return optree.tree_broadcast_prefix(prefix, tree, namespace=NAMESPACE)
    except ValueError as e:
        raise ValueError(f"mask does not match the tree's structure: {e}") from None


def _resolve_mask(tree: Tree, mask: Mask) -> Tree:
    return broadcast_prefix(mask(tree) if callable(mask) else mask, tree)


def partition(tree: Tree, mask: Mask) -> tuple[Tree, Tree]:
    """Split ``tree`` into (selected, rest) by a bool ``mask``; each keeps the structure with ``None`` holes.

    ``mask`` is a pytree of bools (a prefix of ``tree`` is enough: ``{"blocks": True, "head": False}``) or a function
    of the tree returning one. ``combine(*partition(t, m))`` gives back ``t``.
    """
    full = _resolve_mask(tree, mask)
    selected = tree_map(lambda x, m: x if m else None, tree, full)
    rest = tree_map(lambda x, m: None if m else x, tree, full)
    return selected, rest


def combine(*trees: Tree) -> Tree:
    """Merge trees of the same structure by taking, at each leaf, the first that is not ``None``."""

    def first(*xs):
        return next((x for x in xs if x is not None), None)

    return tree_map(first, *trees, none_is_leaf=True)
