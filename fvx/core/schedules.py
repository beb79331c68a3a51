"""Learning-rate schedules: pure functions of the step, with FastVideo's formulas.

A schedule is ``fn(step) -> lr``, where ``step`` counts the updates already applied (0 for the first update, like
``LambdaLR``). A Python int step gives a Python float; a 0-dim tensor step gives a 0-dim tensor on the same device
(float32 for an integer step, else the step's dtype), computed in float64 (1 + cos near the end of a cosine loses
most float32 digits) without Python branches on its value, so a compiled training step sees the learning rate as
data and never recompiles when it changes.

With ``s`` the step, ``W`` the warmup steps, ``N`` the total steps and ``p = (s - W) / max(1, N - W)``, every schedule
but ``constant`` and ``constant_factor`` ramps ``base_lr * s / max(1, W)`` while ``s < W`` and then follows its decay;
``constant_factor`` (torch's ``ConstantLR``, DiffSynth-Studio's trainer's) holds ``base_lr * factor`` while ``s < W``. Unlike FastVideo,
``num_cycles`` is honoured by ``cosine`` and ``min_lr_ratio = 0`` means a floor of 0.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Union

import torch

Step = Union[int, torch.Tensor]
LR = Union[float, torch.Tensor]
Schedule = Callable[[Step], LR]


# ---------------------------------------------------------------------------------------------------------------------
# Argument checks


def _check_real(name: str, value, *, low: float | None = None, high: float | None = None, open_low: bool = False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (value <= low if open_low else value < low):
        raise ValueError(f"{name} must be {'>' if open_low else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
    return float(value)


def _check_int(name: str, value, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return int(value)


def _check_steps(warmup_steps, total_steps) -> tuple[int, int]:
    warmup_steps = _check_int("warmup_steps", warmup_steps, low=0)
    if total_steps is None:
        raise ValueError("total_steps is required by this schedule")
    total_steps = _check_int("total_steps", total_steps, low=1)
    return warmup_steps, total_steps  # a warmup longer than the run is legal: the lr never finishes warming up


# ---------------------------------------------------------------------------------------------------------------------
# One implementation in torch ops for both step kinds


def _check_step(step: Step) -> None:
    if isinstance(step, torch.Tensor):
        if step.dim() != 0:
            raise ValueError(f"step must be a 0-dim tensor, got shape {tuple(step.shape)}")
        return
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int or a 0-dim tensor, got {step!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")


def _schedule(lr_of_step: Callable[[torch.Tensor], torch.Tensor]) -> Schedule:
    """Wrap ``lr_of_step`` (float64 0-dim step -> lr) into a schedule taking an int or a 0-dim tensor."""

    def schedule(step: Step) -> LR:
        _check_step(step)
        if not isinstance(step, torch.Tensor):
            return lr_of_step(torch.tensor(float(step), dtype=torch.float64)).item()
        out_dtype = step.dtype if step.is_floating_point() else torch.float32
        return lr_of_step(step.to(torch.float64)).to(out_dtype)

    return schedule


def _with_warmup(base_lr: float, warmup_steps: int, decay: Callable[[torch.Tensor], torch.Tensor]) -> Schedule:
    """``base_lr * s / max(1, W)`` while ``s < W``, then ``decay(s)`` (an absolute lr)."""

    def lr_of_step(s: torch.Tensor) -> torch.Tensor:
        after = decay(s)
        if warmup_steps == 0:
            return after
        return torch.where(s < warmup_steps, base_lr * s / max(1, warmup_steps), after)

    return _schedule(lr_of_step)


def _progress(s: torch.Tensor, warmup_steps: int, total_steps: int) -> torch.Tensor:
    """p = (s - W) / max(1, N - W): 0 at the end of warmup, 1 at the last step."""
    return (s - warmup_steps) / max(1, total_steps - warmup_steps)


def _half_cosine(p: torch.Tensor, num_cycles: float) -> torch.Tensor:
    """0.5 (1 + cos(2 pi C p)): from 1 at p = 0 down to 0 at p = 1 for C = 0.5. Never negative."""
    return 0.5 * (1.0 + torch.cos(2.0 * math.pi * num_cycles * p))


# ---------------------------------------------------------------------------------------------------------------------
# Schedules


def constant(base_lr: float) -> Schedule:
    """lr = base_lr at every step (no warmup, as in FastVideo's ``constant``)."""
    base_lr = _check_real("base_lr", base_lr, low=0.0)
    return _schedule(lambda s: torch.full_like(s, base_lr))


def constant_with_warmup(base_lr: float, *, warmup_steps: int = 0) -> Schedule:
    """Linear warmup ``base_lr * s / max(1, W)`` for ``s < W``, then ``base_lr``."""
    base_lr = _check_real("base_lr", base_lr, low=0.0)
    warmup_steps = _check_int("warmup_steps", warmup_steps, low=0)
    return _with_warmup(base_lr, warmup_steps, lambda s: torch.full_like(s, base_lr))


def constant_factor(base_lr: float, *, warmup_steps: int = 0, factor: float = 1 / 3) -> Schedule:
    """``base_lr * factor`` for ``s < W``, then ``base_lr``: torch's ``ConstantLR(factor, total_iters=W)`` (its
    defaults: a third for 5 steps)."""
    base_lr = _check_real("base_lr", base_lr, low=0.0)
    warmup_steps = _check_int("warmup_steps", warmup_steps, low=0)
    factor = _check_real("factor", factor, low=0.0, high=1.0)
    return _schedule(lambda s: torch.where(s < warmup_steps, torch.full_like(s, base_lr * factor),
                                           torch.full_like(s, base_lr)))


def linear(base_lr: float, *, warmup_steps: int = 0, total_steps: int) -> Schedule:
    """Warmup, then ``base_lr * max(0, (N - s) / max(1, N - W))``: linear decay to 0 at step N."""
    base_lr = _check_real("base_lr", base_lr, low=0.0)
    warmup_steps, total_steps = _check_steps(warmup_steps, total_steps)
    span = max(1, total_steps - warmup_steps)
    return _with_warmup(base_lr, warmup_steps, lambda s: base_lr * torch.clamp((total_steps - s) / span, min=0.0))


def cosine(base_lr: float, *, warmup_steps: int = 0, total_steps: int, num_cycles: float = 0.5) -> Schedule:
    """Warmup, then ``base_lr * 0.5 (1 + cos(2 pi C p))``; C = 0.5 is one half-cosine from base_lr to 0 at step N."""
    base_lr = _check_real("base_lr", base_lr, low=0.0)
    warmup_steps, total_steps = _check_steps(warmup_steps, total_steps)
    num_cycles = _check_real("num_cycles", num_cycles, low=0.0, open_low=True)
    return _with_warmup(
        base_lr, warmup_steps, lambda s: base_lr * _half_cosine(_progress(s, warmup_steps, total_steps), num_cycles)
    )


def cosine_with_min_lr(
    base_lr: float, *, warmup_steps: int = 0, total_steps: int, min_lr_ratio: float, num_cycles: float = 0.5
) -> Schedule:
    """Warmup, then ``base_lr * max(min_lr_ratio, 0.5 (1 + cos(2 pi C p)))``: the cosine floored at a fraction of
    base_lr (a floor, not a rescale: FastVideo's formula). ``min_lr_ratio`` in [0, 1]; 0 means no floor."""
    base_lr = _check_real("base_lr", base_lr, low=0.0)
    warmup_steps, total_steps = _check_steps(warmup_steps, total_steps)
    min_lr_ratio = _check_real("min_lr_ratio", min_lr_ratio, low=0.0, high=1.0)
    num_cycles = _check_real("num_cycles", num_cycles, low=0.0, open_low=True)

    def decay(s: torch.Tensor) -> torch.Tensor:
        factor = _half_cosine(_progress(s, warmup_steps, total_steps), num_cycles)
        return base_lr * torch.clamp(factor, min=min_lr_ratio)

    return _with_warmup(base_lr, warmup_steps, decay)


def cosine_with_restarts(
    base_lr: float, *, warmup_steps: int = 0, total_steps: int, num_cycles: float = 1.0
) -> Schedule:
    """Warmup, then ``num_cycles`` half-cosines from base_lr to 0, each restarting at base_lr
    (``base_lr * 0.5 (1 + cos(pi ((C p) mod 1)))``), and 0 from step N on."""
    base_lr = _check_real("base_lr", base_lr, low=0.0)
    warmup_steps, total_steps = _check_steps(warmup_steps, total_steps)
    num_cycles = _check_real("num_cycles", num_cycles, low=0.0, open_low=True)

    def decay(s: torch.Tensor) -> torch.Tensor:
        p = _progress(s, warmup_steps, total_steps)
        factor = 0.5 * (1.0 + torch.cos(math.pi * torch.remainder(num_cycles * p, 1.0)))
        return base_lr * torch.where(p >= 1.0, torch.zeros_like(factor), factor)

    return _with_warmup(base_lr, warmup_steps, decay)


def polynomial(
    base_lr: float, *, warmup_steps: int = 0, total_steps: int, power: float = 1.0, lr_end: float = 1e-7
) -> Schedule:
    """Warmup, then ``(base_lr - lr_end) (1 - p)^power + lr_end``, and ``lr_end`` after step N.
    ``power = 1`` is a linear decay to lr_end; ``power = 0`` keeps base_lr until step N."""
    base_lr = _check_real("base_lr", base_lr, low=0.0)
    warmup_steps, total_steps = _check_steps(warmup_steps, total_steps)
    power = _check_real("power", power, low=0.0)
    lr_end = _check_real("lr_end", lr_end, low=0.0)
    if lr_end > base_lr:
        raise ValueError(f"lr_end ({lr_end}) must be <= base_lr ({base_lr})")

    def decay(s: torch.Tensor) -> torch.Tensor:
        remaining = torch.clamp(1.0 - _progress(s, warmup_steps, total_steps), min=0.0)
        lr = (base_lr - lr_end) * remaining**power + lr_end
        return torch.where(s > total_steps, torch.full_like(lr, lr_end), lr)

    return _with_warmup(base_lr, warmup_steps, decay)


# ---------------------------------------------------------------------------------------------------------------------
# By name

SCHEDULES = (
    "constant",
    "constant_with_warmup",
    "constant_factor",
    "linear",
    "cosine",
    "cosine_with_min_lr",
    "cosine_with_restarts",
    "polynomial",
)


def get_schedule(
    name: str,
    *,
    base_lr: float,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    num_cycles: float | None = None,
    min_lr_ratio: float = 0.0,
    power: float = 1.0,
    lr_end: float = 1e-7,
    factor: float = 1 / 3,
) -> Schedule:
    """The schedule called ``name`` (one of ``SCHEDULES``), given every knob a config carries; each schedule takes
    the knobs it uses and ignores the rest. ``num_cycles=None`` takes the schedule's own default (0.5 for the cosines,
    1 for restarts)."""
    cycles = {} if num_cycles is None else {"num_cycles": num_cycles}
    steps = {"warmup_steps": warmup_steps, "total_steps": total_steps}
    if name == "constant":
        return constant(base_lr)
    if name == "constant_with_warmup":
        return constant_with_warmup(base_lr, warmup_steps=warmup_steps)
    if name == "constant_factor":
        return constant_factor(base_lr, warmup_steps=warmup_steps, factor=factor)
    if name == "linear":
        return linear(base_lr, **steps)
    if name == "cosine":
        return cosine(base_lr, **steps, **cycles)
    if name == "cosine_with_min_lr":
        return cosine_with_min_lr(base_lr, **steps, min_lr_ratio=min_lr_ratio, **cycles)
    if name == "cosine_with_restarts":
        return cosine_with_restarts(base_lr, **steps, **cycles)
    if name == "polynomial":
        return polynomial(base_lr, **steps, power=power, lr_end=lr_end)
    raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULES)}")
