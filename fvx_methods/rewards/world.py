"""The toy world's own reward, for CPU runs and tests of online RL: how close a clip is to a true clip of its prompt."""
from __future__ import annotations

from typing import Sequence

import torch

from fvx.data import toy_world


class WorldReward:
    """``exp(-MSE / HIT)`` of a clip ``[B, 3, T, H, W]``, MSE its pixel MSE to the nearest true clip of its prompt and
    HIT the world's hit threshold: 1 for a true clip, 1/e at the threshold, towards 0 far away. Minus the MSE itself
    would prefer a blur (it lies between the clips a prompt allows) to a sharp clip of the wrong phase; this prefers
    the hits. Prompts are the world's captions; scores the whole clip."""

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
        return torch.exp(-mse[torch.arange(len(index)), index].min(-1).values / toy_world.HIT)
