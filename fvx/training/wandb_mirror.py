"""Weights & Biases as a second tracker beside TensorBoard (FastVideo's default): the same scalars, validation videos
and config, mirrored from ``fvx.training.tracking.Tracker`` on rank 0. ``mode="offline"`` (the default) writes the W&B
run under the run folder without a network (``wandb sync`` uploads it later). The ``wandb`` package is optional:
:func:`check_available` says how to install it, before a run writes anything.
"""
from __future__ import annotations

import hashlib
import pathlib
from typing import Any, Literal, Mapping

import numpy as np

from fvx.config import Config


class WandbConfig(Config):
    """``run.wandb``: the W&B project (and entity), ``offline`` or ``online``, and the run's display name (default:
    the run folder's name). The W&B run id derives from the run folder, so a resumed run continues the same W&B
    run."""

    project: str = "fvx"
    entity: str | None = None
    mode: Literal["offline", "online"] = "offline"
    name: str | None = None


def check_available() -> None:
    """A ValueError saying how to install ``wandb`` when it is not importable."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ValueError("run.wandb needs the wandb package: pip install wandb (or set run.wandb=null)") from None


class WandbMirror:
    """What ``fvx.training.tracking.Tracker`` mirrors to: one W&B run for one fvx run folder."""

    def __init__(self, config: WandbConfig, run_dir: pathlib.Path):
        import wandb

        self._wandb = wandb
        run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self._run = wandb.init(project=config.project, entity=config.entity, mode=config.mode, dir=str(run_dir),
                               name=config.name or run_dir.name, id=run_id, resume="allow")

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def video(self, step: int, tag: str, thwc: np.ndarray, fps: float) -> None:
        self._run.log({tag: self._wandb.Video(np.ascontiguousarray(thwc.transpose(0, 3, 1, 2)), fps=int(round(fps)),
                                              format="gif")}, step=step)

    def hparams(self, flat: Mapping[str, Any]) -> None:
        self._run.config.update(dict(flat), allow_val_change=True)

    def close(self) -> None:
        self._run.finish()
