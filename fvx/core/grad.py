"""Pure gradients over a params pytree, and pure activation checkpointing (remat).

Gradients come from ``torch.autograd.grad`` taken outside any compiled region (design §2 "Gradients"): compiled code
inside ``f`` is differentiated by AOTAutograd, and ``torch.func.grad`` is avoided because it fails with checkpointing
and DTensor params and builds a second-order graph (about 2.6x the memory).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from fvx.core import functional, tree as tree_util


def _differentiable_leaves(params: Any) -> tuple[list[torch.Tensor], Any]:
    """Detached leaves that require grad (sharing storage with ``params``), and the treedef to rebuild the tree."""
    paths, leaves, treedef = tree_util.flatten_with_path(params)
    for path, leaf in zip(paths, leaves):
        if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
            where = ".".join(map(str, path)) or "<root>"
            raise TypeError(
                f"value_and_grad: params leaf {where!r} is {type(leaf).__name__}"
                f"{'' if not isinstance(leaf, torch.Tensor) else f' of dtype {leaf.dtype}'}; every leaf of the "
                "differentiated argument must be a floating-point tensor (split frozen or integer leaves off with "
                "fvx.core.tree.partition and pass them as another argument)"
            )
    return [leaf.detach().requires_grad_(True) for leaf in leaves], treedef


def _split_output(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("value_and_grad(has_aux=True): f must return a pair (loss, aux)")
        loss, aux = out
    else:
        loss, aux = out, None
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"value_and_grad: f must return a 0-dim floating-point loss, got {got}")
    return loss, aux


def _settled(g: torch.Tensor) -> torch.Tensor:
    """``g`` as a plain tensor: a gradient still being reduced by a collective (``AsyncCollectiveTensor``, e.g. the
    reduce-scatter of a sharded param's gradient) waited on."""
    return g.wait() if isinstance(g, AsyncCollectiveTensor) else g


def value_and_grad(f: Callable[..., Any], has_aux: bool = False) -> Callable[..., Any]:
    """Turn ``f(params, *args) -> loss`` (or ``(loss, aux)``) into ``(params, *args) -> ((loss, aux)|loss, grads)``.

    Pure to the caller: ``params`` is a pytree of floating-point tensors, ``grads`` has its structure, no ``.grad``
    field is read or written, and nothing returned holds a graph. Leaves that ``f`` does not use get zero gradients.
    """

    @functools.wraps(f)
    def wrapped(params: Any, *args: Any, **kwargs: Any):
        leaves, treedef = _differentiable_leaves(params)
        with torch.enable_grad():
            loss, aux = _split_output(f(tree_util.unflatten(treedef, leaves), *args, **kwargs), has_aux)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True) if leaves else ()
        grads = tree_util.unflatten(treedef, [_settled(g) for g in grads])
        loss = loss.detach()
        if has_aux:
            return (loss, tree_util.map_tensors(torch.Tensor.detach, aux)), grads
        return loss, grads

    return wrapped


def grad(f: Callable[..., Any], has_aux: bool = False) -> Callable[..., Any]:
    """Like :func:`value_and_grad` but returns ``grads`` (or ``(grads, aux)`` with ``has_aux``), as ``jax.grad``."""
    vg = value_and_grad(f, has_aux=has_aux)

    @functools.wraps(f)
    def wrapped(params: Any, *args: Any, **kwargs: Any):
        value, grads = vg(params, *args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def _call_with(module: torch.nn.Module, params: dict, buffers: dict, args: tuple, kwargs: dict) -> Any:
    return functional.call(module, params, buffers, args, kwargs)


def remat(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with its activations recomputed in the backward: pure activation checkpointing.

    The params and buffers the module holds *now* (under an enclosing ``functional_call`` these are the caller's
    tensors) are captured and passed to non-reentrant ``torch.utils.checkpoint`` as explicit inputs; the recompute
    runs through ``functional_call`` with exactly those tensors, never the skeleton's own. Install it in a diffusers
    model with ``model.enable_gradient_checkpointing(fvx.core.grad.remat)``. Arguments may be any pytree, tensor or not;
    ``module`` may be its bound ``__call__`` (what some diffusers stacks hand the checkpoint function).
    """
    if isinstance(getattr(module, "__self__", None), torch.nn.Module):
        module = module.__self__
    params, buffers = functional.held(module)
    return torch.utils.checkpoint.checkpoint(
        _call_with, module, params, buffers, args, kwargs, use_reentrant=False, preserve_rng_state=False
    )
