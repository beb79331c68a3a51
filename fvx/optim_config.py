"""The optimizer knobs of a trainable role, as a config, and the transformation they build."""
from __future__ import annotations

from typing import Annotated, Callable, Literal

import msgspec
import torch

from fvx import optim, schedules, sharding
from fvx.config import Config

ScheduleName = Literal[
    "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr", "cosine_with_restarts", "polynomial"
]


class AdamWConfig(Config):
    """AdamW with gradient clipping and a learning-rate schedule (FastVideo's ``training.optimizer``/``scheduler``).

    ``max_grad_norm`` 0 turns clipping off. ``num_cycles`` None takes the schedule's own default.
    """

    lr: Annotated[float, msgspec.Meta(ge=0)] = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: Annotated[float, msgspec.Meta(ge=0)] = 1e-8
    weight_decay: Annotated[float, msgspec.Meta(ge=0)] = 0.01
    max_grad_norm: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    schedule: ScheduleName = "constant"
    warmup_steps: Annotated[int, msgspec.Meta(ge=0)] = 0
    num_cycles: float | None = None
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    power: float = 1.0
    lr_end: float = 1e-7

    def __post_init__(self) -> None:
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] = {beta} must lie in [0, 1)")

    def schedule_fn(self, total_steps: int) -> Callable[[int | torch.Tensor], float | torch.Tensor]:
        """The learning rate as a function of the number of updates applied so far."""
        return schedules.get_schedule(
            self.schedule, base_lr=self.lr, warmup_steps=self.warmup_steps, total_steps=total_steps,
            num_cycles=self.num_cycles, min_lr_ratio=self.min_lr_ratio, power=self.power, lr_end=self.lr_end,
        )

    def build(self, total_steps: int, group: sharding.Group = sharding.Group()) -> optim.GradientTransformation:
        """``chain(clip_by_global_norm, adamw(schedule))``, or AdamW alone when clipping is off. Over the shards of
        a ``group`` of several ranks the clip takes the global norm (one all-reduce)."""
        b1, b2 = self.betas
        adamw = optim.adamw(self.schedule_fn(total_steps), b1=b1, b2=b2, eps=self.eps, weight_decay=self.weight_decay)
        if self.max_grad_norm == 0:
            return adamw
        clip = (optim.clip_by_global_norm(self.max_grad_norm) if group.dp_size == 1
                else sharding.clip_by_global_norm(self.max_grad_norm, group))
        return optim.chain(clip, adamw)
