"""What online RL methods share (DiffusionNFT first, spec §2.11): K-repeat grouped prompt sampling across ranks, the
per-group advantages of rewards, the reward diagnostics and the old policy's decay schedule, as pure functions.

K-repeat sampling (DiffusionNFT's ``DistributedKRepeatSampler``, FastVideo's ``distributed_k_repeat_indices``): a
sampling batch of ``world x batch_size`` samples holds ``U = world x batch_size / K`` distinct prompt rows, each
``K`` times, shuffled, and rank ``r`` takes slice ``r``. FastVideo draws the rows and the shuffle from a CPU generator
seeded per batch; fvx from a key (``permutation(split(key)[0])[:U]``, then ``permutation(split(key)[1])``), so the
global set is the same for any split of it into ranks. Groups are identified by the prompt's row in the dataset
(FastVideo groups identical prompt strings: the same rows for a K-repeat batch).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from fvx.core import random

ADVANTAGE_EPS = 1e-4  # added to a group's (biased) std before dividing, as DiffusionNFT does


class KRepeat(NamedTuple):
    """One rank's prompt rows of a K-repeat sampling batch, and the batch's number of distinct prompts."""

    local_rows: list[int]
    unique_prompts: int


def k_repeat_rows(key: torch.Tensor, *, dataset_length: int, batch_size: int, repeats: int, world: int,
                  rank: int) -> KRepeat:
    """Rank ``rank``'s ``batch_size`` prompt rows of a K-repeat batch over ``world`` ranks (module docstring); a
    ValueError when ``world x batch_size`` is not a multiple of ``repeats`` or the dataset has fewer rows than the
    batch's distinct prompts."""
    for name, value in (("dataset_length", dataset_length), ("batch_size", batch_size), ("repeats", repeats),
                        ("world", world)):
        if value <= 0:
            raise ValueError(f"K-repeat sampling: {name} must be positive, got {value}")
    if not 0 <= rank < world:
        raise ValueError(f"K-repeat sampling: rank must be in [0, {world}), got {rank}")
    total = world * batch_size
    if total % repeats:
        raise ValueError(f"K-repeat sampling: {world} ranks x a batch of {batch_size} = {total} samples are not "
                         f"groups of {repeats} (FastVideo's rule: world x batch divisible by the group size)")
    unique = total // repeats
    if unique > dataset_length:
        raise ValueError(f"K-repeat sampling: a batch needs {unique} distinct prompts, the dataset has "
                         f"{dataset_length} rows")
    rows_key, order_key = random.split(key)
    rows = random.permutation(rows_key, dataset_length)[:unique].tolist()
    repeated = [row for row in rows for _ in range(repeats)]
    shuffled = [repeated[i] for i in random.permutation(order_key, total).tolist()]
    return KRepeat(shuffled[rank * batch_size:(rank + 1) * batch_size], unique)


def groups(group_ids: Sequence[int]) -> list[torch.Tensor]:
    """The positions of each group (identical ids), in order of first appearance."""
    by_id: dict[int, list[int]] = {}
    for position, group in enumerate(group_ids):
        by_id.setdefault(int(group), []).append(position)
    return [torch.tensor(positions) for positions in by_id.values()]


def group_advantages(rewards: torch.Tensor, group_ids: Sequence[int]) -> torch.Tensor:
    """``[N]`` advantages of every rank's rewards ``[N]``: per group, ``(r - mean_g) / (std_g + 1e-4)`` with the
    biased std (a group of one, or of equal rewards, gets 0)."""
    if len(group_ids) != len(rewards):
        raise ValueError(f"group_advantages: {len(rewards)} rewards but {len(group_ids)} group ids")
    rewards = rewards.float()
    out = torch.empty_like(rewards)
    for positions in groups(group_ids):
        positions = positions.to(rewards.device)
        group = rewards[positions]
        out[positions] = (group - group.mean()) / (group.std(unbiased=False) + ADVANTAGE_EPS)
    return out


def reward_diagnostics(rewards: torch.Tensor, group_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """DiffusionNFT's per-step reward figures over every rank's rewards: the mean group size, the fraction of groups
    whose rewards are all equal (no signal), the groups' mean std, and ``mean_reward_<p>``: the mean over groups of
    the mean of each group's rewards at or above its ``1 - p/100`` quantile (p in 100, 75, 50, 25, 10)."""
    grouped = [rewards.float()[positions.to(rewards.device)] for positions in groups(group_ids)]
    stds = torch.stack([g.std(unbiased=False) for g in grouped])
    out = {"group_size": torch.tensor(sum(len(g) for g in grouped) / len(grouped)),
           "zero_std_ratio": (stds == 0).float().mean(), "reward_std_mean": stds.mean()}
    for p in (100, 75, 50, 25, 10):
        tops = [g if p == 100 else g[g >= torch.quantile(g, (100 - p) / 100)] for g in grouped]
        out[f"mean_reward_{p}"] = torch.stack([t.mean() for t in tops]).mean()
    return out


def old_policy_decay(iteration: int, decay_type: int) -> float:
    """The old policy's EMA decay at 1-based outer ``iteration`` (``old <- d old + (1 - d) student``): type 0
    always 0 (the old policy is the student), type 1 ``min(0.001 it, 0.5)``, type 2 0 before iteration 75, then
    ``min(0.0075 (it - 75), 0.999)``."""
    schedules = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}
    if decay_type not in schedules:
        raise ValueError(f"decay_type must be 0, 1 or 2, got {decay_type!r}")
    flat, rate, cap = schedules[decay_type]
    return 0.0 if iteration < flat else min((iteration - flat) * rate, cap)
