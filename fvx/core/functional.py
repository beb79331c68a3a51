"""``torch.func.functional_call`` for a module called every step: :func:`call` swaps the given tensors into the
module's ``_parameters`` and ``_buffers`` entries for one call and back, strictly (every name, no other), as
``functional_call(module, (params, buffers), args, kwargs, strict=True)`` does, but finds those entries once and keeps
them on the module (:func:`slots`) instead of walking every submodule three times a call: about 1 ms of a tiny Wan's
21 ms step on 2 CPU threads (design §3). Code being compiled gets torch's own ``functional_call`` (dynamo traces it;
a swap inside a traced activation checkpoint would be a side effect), as does a module that holds one tensor under two
names (tied weights), which torch unties.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch
from torch import nn
from torch.func import functional_call

_SLOTS = "fvx_tensor_slots"  # the module attribute holding its Slots


class Slot(NamedTuple):
    """Where one named tensor lives: its owner's ``_parameters`` or ``_buffers`` dict and the key in it."""

    store: dict
    key: str
    buffer: bool


def find_slots(module: nn.Module) -> dict[str, Slot] | None:
    """Every param and buffer of ``module`` by its full name, or None when a tensor has two names (tied)."""
    found, seen = {}, set()
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for kind, buffer in (("_parameters", False), ("_buffers", True)):
            store = getattr(owner, kind)
            for key, tensor in store.items():
                if tensor is None:
                    continue
                if id(tensor) in seen:
                    return None
                seen.add(id(tensor))
                found[f"{prefix}.{key}" if prefix else key] = Slot(store, key, buffer)
    return found


def slots(module: nn.Module, *, refresh: bool = False) -> dict[str, Slot] | None:
    """``module``'s :func:`find_slots`, found on the first call and kept on the module (``refresh``: found again)."""
    if refresh or _SLOTS not in vars(module):
        object.__setattr__(module, _SLOTS, find_slots(module))
    return vars(module)[_SLOTS]


def held(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The params and the buffers ``module`` holds now, by name (under an enclosing :func:`call`, the caller's):
    ``named_parameters``/``named_buffers`` without the walk."""
    table = None if torch.compiler.is_compiling() else slots(module)
    if table is None:
        return (dict(module.named_parameters(remove_duplicate=False)),
                dict(module.named_buffers(remove_duplicate=False)))
    params, buffers = {}, {}
    for name, slot in table.items():
        (buffers if slot.buffer else params)[name] = slot.store[slot.key]
    return params, buffers


def call(module: nn.Module, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
         args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> Any:
    """``module(*args, **kwargs)`` with exactly ``params`` and ``buffers`` (module docstring)."""
    if torch.compiler.is_compiling():
        return functional_call(module, (dict(params), dict(buffers)), args, dict(kwargs or {}), strict=True)
    tensors = {**params, **buffers}
    table = slots(module)
    if table is not None and tensors.keys() != table.keys():
        table = slots(module, refresh=True)  # (a module changed since: found again)
    if table is None or tensors.keys() != table.keys():
        return functional_call(module, (dict(params), dict(buffers)), args, dict(kwargs or {}), strict=True)
    saved = []
    try:
        for name, tensor in tensors.items():
            slot = table[name]
            saved.append((slot, slot.store[slot.key]))
            slot.store[slot.key] = tensor
        return module(*args, **(kwargs or {}))
    finally:
        for slot, tensor in reversed(saved):
            slot.store[slot.key] = tensor
