"""Exponential moving averages of params, on batched ``torch._foreach_*`` kernels.

The shadow follows ``shadow <- decay * shadow + (1 - decay) * param`` (computed as ``lerp(shadow, param, 1 - decay)``,
one kernel over all leaves). :func:`ema_step_` adds a start rule, one of FastVideo's two (:data:`STARTS`): ``reset``
(its EMACallback, spec §4.3): before the start step the shadow is left alone; at the start step it is re-initialised
from the current params; after it, it blends. ``blend`` (causal consistency distillation's EMA target, spec §2.10):
the shadow keeps the copy it was made as (the initial params) until the start step and blends from then on, that
step included. The shadow keeps each param's dtype and device (fvx params are fp32 masters), so it checkpoints with the
state.

Donation contract as in ``fvx.core.optim``: a function ending in ``_`` updates ``ema``'s tensors in place and returns
them; ``params`` is only read.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Literal

import torch

from fvx.core import tree

Params = Any  # a pytree of tensors
Start = Literal["reset", "blend"]
STARTS = ("reset", "blend")


def check_decay(decay: float) -> float:
    """``decay`` as a float in [0, 1], or a ValueError naming it."""
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not math.isfinite(decay):
        raise ValueError(f"EMA decay must be a finite number in [0, 1], got {decay!r}")
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"EMA decay must lie in [0, 1], got {decay!r}")
    return float(decay)


def ema_init(params: Params) -> Params:
    """A shadow of ``params``: a copy of every tensor (same structure, dtypes and devices)."""
    return tree.map_tensors(lambda p: p.detach().clone(), params)


def _aligned(ema: Params, params: Params) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensor leaves of ``ema`` and of ``params``, position by position; a ValueError if the trees differ."""
    ema_leaves, spec = tree.flatten(ema)
    try:
        param_leaves = spec.flatten_up_to(params)
    except ValueError as error:
        raise ValueError(f"EMA: params do not have the structure of the EMA shadow: {error}") from None
    pairs = [(e, p) for e, p in zip(ema_leaves, param_leaves) if isinstance(e, torch.Tensor)]
    for e, p in pairs:
        if not isinstance(p, torch.Tensor) or p.shape != e.shape:
            got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"EMA: a param of shape {got} does not match its shadow of shape {tuple(e.shape)}")
    return [e for e, _ in pairs], [p.detach() for _, p in pairs]


def ema_update_(ema: Params, params: Params, decay: float) -> Params:
    """``ema <- decay * ema + (1 - decay) * params`` in place (donates ``ema``); returns ``ema``."""
    decay = check_decay(decay)
    shadows, values = _aligned(ema, params)
    if shadows:
        torch._foreach_lerp_(shadows, values, 1.0 - decay)
    return ema


def ema_update(ema: Params, params: Params, decay: float) -> Params:
    """``decay * ema + (1 - decay) * params`` as new tensors: :func:`ema_update_` on a copy of ``ema``."""
    return ema_update_(ema_init(ema), params, decay)


def ema_copy_(ema: Params, params: Params) -> Params:
    """Re-initialise the shadow from ``params`` in place (donates ``ema``); returns ``ema``."""
    shadows, values = _aligned(ema, params)
    if shadows:
        torch._foreach_copy_(shadows, values)
    return ema


def ema_step_(ema: Params, params: Params, step: int, *, decay: float, start_step: int = 0,
              start: Start = "reset") -> Params:
    """The EMA of one training step, in place: left alone while ``step < start_step``; at ``step == start_step``
    re-initialised from ``params`` (``start="reset"``) or blended (``"blend"``); blended with ``decay`` after.
    ``step`` is a Python int (cadence is plain Python on the step, so a resumed run does what the uninterrupted run
    did without saving a "started" flag)."""
    if start not in STARTS:
        raise ValueError(f"EMA start must be one of {', '.join(map(repr, STARTS))}, got {start!r}")
    if step < start_step:
        return ema
    if step == start_step and start == "reset":
        return ema_copy_(ema, params)
    return ema_update_(ema, params, decay)
