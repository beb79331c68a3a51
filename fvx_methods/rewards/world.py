"""The toy world's own reward, for CPU runs and tests of online RL: how close a clip is to a true clip of its prompt."""
from __future__ import annotations

from typing import Sequence

import torch

from fvx.data import toy_world


class WorldReward:
    """Minus the pixel MSE of a clip ``[B, 3, T, H, W]`` to the nearest true clip of its prompt, in units of the
    world's hit threshold (0: a true clip; -1: at the threshold a hit must be within); prompts are the world's
    captions. Scores the whole clip."""

    frames = "whole"

    def __init__(self, config: toy_world.WorldConfig):
        self.references = toy_world.references(config)
        self.prompt_of = {toy_world.caption(config, c, d): i for i, (c, d) in enumerate(config.prompts)}

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        unknown = sorted({p for p in prompts if p not in self.prompt_of})
        if unknown:
            raise ValueError(f"world reward: prompts {unknown} are not the world's; known: {', '.join(self.prompt_of)}")
        index = torch.tensor([self.prompt_of[p] for p in prompts])
        mse = toy_world.clip_mse(videos, self.references)  # [B, P, S]
        return -mse[torch.arange(len(index)), index].min(-1).values / toy_world.HIT
