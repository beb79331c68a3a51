"""The optimizer knobs of a trainable role, as a config, and the role optimizer they build (``fvx.core.role``)."""
from __future__ import annotations

from typing import Annotated, Any, Callable, Literal

import msgspec
import torch

from fvx.config import Config
from fvx.core import ema, optim, role, schedules, tree

ScheduleName = Literal[
    "constant", "constant_with_warmup", "constant_factor", "linear", "cosine", "cosine_with_min_lr",
    "cosine_with_restarts", "polynomial",
]


class AdamWConfig(Config):
    """AdamW with gradient clipping and a learning-rate schedule (FastVideo's ``training.optimizer``/``scheduler``).

    ``max_grad_norm`` 0 turns clipping off. ``num_cycles`` None takes the schedule's own default (0.5 for the
    cosines, FastVideo's fixed value; 1 for restarts: FastVideo's default 0 makes restarts a constant lr after
    warmup, which is ``constant_with_warmup``, so fvx refuses 0). ``decay_norms_and_biases`` False leaves every
    1-D param (norm weights, biases) undecayed. ``warmup_factor``: the share of ``lr`` that ``constant_factor`` holds
    for the ``warmup_steps`` (torch's ``ConstantLR``; the other schedules ramp up from 0). A schedule spans the run's
    ``run.steps``: a warmup longer than the run is legal (the lr never finishes warming up). Defaults that differ from FastVideo's when a recipe omits the key are
    listed with their reasons in docs/design.md.
    """

    lr: Annotated[float, msgspec.Meta(ge=0)] = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: Annotated[float, msgspec.Meta(ge=0)] = 1e-8
    weight_decay: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    decay_norms_and_biases: bool = True
    max_grad_norm: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    schedule: ScheduleName = "constant"
    warmup_steps: Annotated[int, msgspec.Meta(ge=0)] = 0
    num_cycles: float | None = None
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    power: float = 1.0
    lr_end: float = 1e-7
    warmup_factor: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1 / 3

    def __post_init__(self) -> None:
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] = {beta} must lie in [0, 1)")

    def warmup_warning(self, field: str, updates: int) -> str | None:
        """A warning line (``field``: where these knobs sit, e.g. ``method.optim``) when the schedule warms up and its
        warmup does not end within the ``updates`` optimizer updates of the run: every update then runs below ``lr``.
        A warning, not a refusal: the warmup's ramp ``lr * s / warmup_steps`` does not depend on the run's length,
        so a run resumed with a larger ``run.steps`` continues it and finishes it (fvx.core.schedules)."""
        if self.schedule == "constant" or self.warmup_steps < updates:  # constant has no warmup (FastVideo's too)
            return None
        plural = "s" if updates != 1 else ""
        return (f"{field}.warmup_steps = {self.warmup_steps} is not shorter than the run's {updates} optimizer "
                f"update{plural} (run.steps): the learning rate never reaches {field}.lr = {self.lr:g} (legal: a run "
                "resumed with a larger run.steps finishes the warmup)")

    def schedule_fn(self, total_steps: int) -> Callable[[int | torch.Tensor], float | torch.Tensor]:
        """The learning rate as a function of the number of updates applied so far."""
        return schedules.get_schedule(
            self.schedule, base_lr=self.lr, warmup_steps=self.warmup_steps, total_steps=total_steps,
            num_cycles=self.num_cycles, min_lr_ratio=self.min_lr_ratio, power=self.power, lr_end=self.lr_end,
            factor=self.warmup_factor,
        )

    def build(self, total_steps: int) -> optim.GradientTransformation:
        """AdamW on the schedule (clipping is the role update's, :meth:`role`)."""
        b1, b2 = self.betas
        mask = None if self.decay_norms_and_biases else _matrices
        return optim.adamw(self.schedule_fn(total_steps), b1=b1, b2=b2, eps=self.eps, weight_decay=self.weight_decay,
                           weight_decay_mask=mask)

    def role(self, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS, *, ema_decay: float | None = None,
             ema_start_step: int = 0, ema_start: ema.Start = "reset") -> role.RoleOptimizer:
        """The :class:`fvx.core.role.RoleOptimizer` of a role trained with these knobs (its norm and metrics over
        ``ranks``; its EMA's start rule ``ema_start``, ``fvx.core.ema.ema_step_``)."""
        return role.RoleOptimizer(self.build(total_steps), self.max_grad_norm, ranks, ema_decay or None,
                                  ema_start_step, ema_start)


def _matrices(params: Any) -> Any:
    """True for params of two or more dimensions: the decay mask without norms and biases."""
    return tree.map_tensors(lambda p: p.dim() >= 2, params)
