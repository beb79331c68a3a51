"""What online RL methods share (DiffusionNFT first, spec §2.11): K-repeat grouped prompt sampling across ranks (and
the program's ``batch_at`` that reads a step's sampling batches so), rollouts through fvx's samplers, the per-group
advantages of rewards over every rank, the reward diagnostics and the old policy's decay schedule.

K-repeat sampling (DiffusionNFT's ``DistributedKRepeatSampler``, FastVideo's ``distributed_k_repeat_indices``): a
sampling batch of ``world x batch_size`` samples holds ``U = world x batch_size / K`` distinct prompt rows, each
``K`` times, shuffled, and rank ``r`` takes slice ``r``. FastVideo draws the rows and the shuffle from a CPU generator
seeded per batch; fvx from a key (``permutation(split(key)[0])[:U]``, then ``permutation(split(key)[1])``), so the
global set is the same for any split of it into ranks. Groups are identified by the prompt's row in the dataset
(FastVideo groups identical prompt strings: the same rows for a K-repeat batch).
"""
from __future__ import annotations

from typing import Any, Literal, NamedTuple, Sequence

import torch

from fvx.core import flow, random

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


def k_repeat_batch_at(dataset: Any, key: torch.Tensor, step: int, *, batch_size: int, rank: int, world: int,
                      repeats: int, batches: int) -> dict[str, Any]:
    """This rank's rows of step ``step``'s ``batches`` K-repeat sampling batches of ``batch_size`` prompts each
    (global; ``repeats`` copies of each distinct prompt), batch ``b`` drawn from ``fold_in(fold_in(key, step), b)``, as
    one batch (a ``Program.batch_at``). ``sample_index``: each copy's own global index ``(step * batches + b) *
    batch_size + rank * n + i`` (``n = batch_size / world``), so each draws its own noise, the same for any world
    size; ``index``: the dataset rows (the groups)."""
    if batch_size % world:
        raise ValueError(f"a sampling batch of {batch_size} prompts does not split over {world} ranks")
    n, reads, indices = batch_size // world, [], []
    for b in range(batches):
        drawn = k_repeat_rows(random.fold_in(random.fold_in(key, step), b), dataset_length=len(dataset),
                              batch_size=n, repeats=repeats, world=world, rank=rank)
        reads += drawn.local_rows
        first = (step * batches + b) * batch_size + rank * n
        indices.append(torch.arange(first, first + n, dtype=torch.int64))
    batch = dataset.read(reads)
    batch["sample_index"] = torch.cat(indices)
    return batch


Trajectory = Literal["ode", "sde_reflow"]
SAMPLER = {"ode": "ode", "sde_reflow": "sde"}  # a trajectory's sampler in fvx.core.flow


def rollout(apply_fn: flow.ApplyFn, params: Any, cond: Any, shape: Sequence[int], sample_index: torch.Tensor,
            key: torch.Tensor, sigmas: torch.Tensor, trajectory: Trajectory = "ode") -> torch.Tensor:
    """Samples ``[B, *shape]`` (no grad) of the model ``apply_fn(params, x_t, t, cond)`` along ``sigmas``, from noise
    ``normal(fold_in(split(key)[0], index_b))`` per sample: the Euler ODE (``ode``) or, ``sde_reflow``, x0 predicted
    at each level and re-noised to the next with fresh noise from ``fold_in(split(key)[1], index_b)``
    (``fvx.core.flow.sde_sample``; FastVideo's DiffusionSampler trajectories)."""
    noise_key, step_key = random.split(key)
    index = sample_index.to(key.device)
    noise = random.normal_each(random.fold_in(noise_key, index), tuple(shape), device=sample_index.device)
    with torch.no_grad():
        return flow.sample(apply_fn, params, noise, sigmas, random.fold_in(step_key, index), cond=cond,
                           sampler=SAMPLER[trajectory])


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
