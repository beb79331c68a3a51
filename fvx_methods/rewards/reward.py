"""The reward protocol of online RL methods and their weighted sum (spec §2.11; the seed's RL rules).

A reward receives decoded media in [0, 1] and the samples' prompts and returns one scalar per sample; it declares
which frames it scores (``frames``): ``first`` (images ``[B, C, H, W]``: the first frame), ``sampled`` (the mean of
its scores of ``count`` frames spaced evenly over the clip, first and last included) or ``whole`` (videos
``[B, C, T, H, W]``). :func:`scores` runs each, checks what it returns (``[B]``: a RewardError names the reward) and
adds ``avg``, the weighted **sum** ``sum_k w_k score_k`` (FastVideo's
``MultiRewardScorer``).
"""
from __future__ import annotations

import math
from typing import Literal, Mapping, Protocol, Sequence

import torch

Frames = Literal["first", "sampled", "whole"]
SAMPLED_FRAMES = 4  # frames a ``sampled`` reward scores per clip


class Reward(Protocol):
    """``reward(media, prompts) -> [B]``; ``frames``: which frames of a clip it is given."""

    frames: Frames

    def __call__(self, media: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor: ...


class RewardError(ValueError):
    """A reward returned something other than one finite score per sample."""


def frame_indices(frames: int, count: int) -> list[int]:
    """``count`` frame indices spaced evenly over ``frames`` (first and last included; all when fewer)."""
    if frames <= count:
        return list(range(frames))
    return [round(i * (frames - 1) / (count - 1)) for i in range(count)]


def score(reward: Reward, videos: torch.Tensor, prompts: Sequence[str], count: int = SAMPLED_FRAMES) -> torch.Tensor:
    """A reward's scores ``[B]`` of clips ``videos [B, C, T, H, W]`` in [0, 1], given the frames it declares."""
    if reward.frames == "first":
        return reward(videos[:, :, 0], prompts)
    if reward.frames == "sampled":
        return torch.stack([reward(videos[:, :, i], prompts) for i in frame_indices(videos.shape[2], count)]).mean(0)
    if reward.frames == "whole":
        return reward(videos, prompts)
    raise ValueError(f"a reward's frames must be first, sampled or whole, got {reward.frames!r}")


def scores(rewards: Mapping[str, Reward], weights: Mapping[str, float], videos: torch.Tensor,
           prompts: Sequence[str]) -> dict[str, torch.Tensor]:
    """Each reward's scores ``[B]`` fp32 by name, and ``avg``: their weighted sum; a RewardError names a reward that
    returns another shape. A non-finite score is returned as it is: a method applies no update then, and its metrics
    (``reward/<name>``) name the reward."""
    batch, out = videos.shape[0], {}
    if len(prompts) != batch:
        raise ValueError(f"rewards: {batch} clips but {len(prompts)} prompts")
    for name, reward in rewards.items():
        with torch.no_grad():
            value = score(reward, videos, prompts)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (batch,):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise RewardError(f"reward {name!r} returned {shape} for {batch} clips; a reward returns one score per "
                              f"clip, [{batch}]")
        out[name] = value.float()
    out["avg"] = sum(float(weights[name]) * out[name] for name in rewards)
    return out


def check_weights(weights: Mapping[str, float], known: Sequence[str], where: str = "method.reward_fn") -> None:
    """A ValueError unless ``weights`` names at least one reward, every name is known and every weight finite."""
    if not weights:
        raise ValueError(f"{where} names no reward; give one or more of {', '.join(known)} with a weight")
    for name, weight in weights.items():
        if name not in known:
            raise ValueError(f"{where}: unknown reward {name!r}; known: {', '.join(known)}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"{where}.{name}: the weight must be a finite number, got {weight!r}")
