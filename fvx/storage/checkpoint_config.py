"""When a run saves its state and which checkpoints it keeps: a config experiment files import without the checkpoint
manager (and so without orbax and JAX)."""
from __future__ import annotations

from typing import Annotated

import msgspec

from fvx.config import Config


class CheckpointConfig(Config):
    """When a run saves its state and which checkpoints it keeps.

    every: save after every ``every``-th step (0: no periodic saves); every_seconds: also save after the first step
    that ends that long after the last save (None: no timed saves). final: also save after the last step (once,
    even when it is a multiple of ``every``). keep_latest: keep the newest K checkpoints (None: keep all).
    keep_every: also keep, for good, each checkpoint whose step is a multiple of M (orbax's ``keep_period``).
    async_save: write in the background from a host copy of the state, while training goes on.
    """

    every: Annotated[int, msgspec.Meta(ge=0)] = 100
    every_seconds: Annotated[float, msgspec.Meta(gt=0)] | None = None
    final: bool = True
    keep_latest: Annotated[int, msgspec.Meta(ge=1)] | None = 3
    keep_every: Annotated[int, msgspec.Meta(ge=1)] | None = None
    async_save: bool = True


def due(config: CheckpointConfig, step: int, last_step: int) -> bool:
    """Whether a run saves after taking ``step`` steps (of ``last_step``): each multiple of ``every``, and the last."""
    return bool((config.every and step % config.every == 0) or (config.final and step == last_step))
