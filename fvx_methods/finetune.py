"""Flow-matching fine-tuning (FastVideo's FineTuneMethod, spec §2.1) as pure functions.

Per sample b of the global batch: ``x0`` the normalised latents, ``noise ~ N(0, I)``, ``u ~ density``, ``sigma`` the
training-grid entry at ``floor(1000 u)``, ``x_t = (1 - sigma) x0 + sigma noise``, ``v = model(x_t, 1000 sigma)``, and

    loss = mean((v - (noise - x0))^2)              (default)
    loss = mean((x_t - sigma v - x0)^2)            (precondition_outputs: the loss on the implied x0)
    loss = mean_b(w(sigma_b) mean((v_b - (noise_b - x0_b))^2))   (loss_weighting=bell: DiffSynth-Studio's weight)

Noise and timesteps come from ``fold_in(step_key, global_sample_index)``, so a sample draws the same numbers whatever
the number of ranks or micro-batches. A model with its own training noise levels (``Model.rules.sigma_sampler``: LTX-2's
stretched and LTX-Video's shifted logit-normal, MiniMax-H3's coupled draws, CogVideoX's uniform DDPM timesteps) draws
``sigma`` with it instead of the density and grid (:func:`draw_sigmas`); one trained with another objective weighs each
sample's error by ``Model.rules.loss_weight(sigma)`` (CogVideoX's v-prediction x0 loss, as the flow's). A model that
trains one timestep range per step (``Model.rules.step_ranges``: Wan 2.2 A14B, one expert per step) draws the step's
range from the step key and its samples' levels in it (:func:`step_range_sigmas`). A family that corrupts its cond in
training (``Model.rules.corrupt_cond``: Helios's noised and dropped history) gets each sample's own draw.

A joint model (``Model.joint``: MiniMax-H3's and Kandinsky 6's video and audio) takes every modality at its own noise
and level (MiniMax-H3's coupled ones; one shared level without a sampler of its own: Kandinsky 6), and the loss is the
sum of the modalities' losses, each logged (FastVideo's ``video_finetune_loss``, ``audio_finetune_loss``):

    loss = sum_m mean((v_m - (noise_m - x0_m))^2)

The role ``student`` is a model of any family (``roles.student`` names it);
its ``cond`` comes with the batch. The rest is the one-role program (``fvx_methods.library.one_role``): the update
(global norm, finite check, clip, AdamW, EMA), the frozen base of a LoRA model, and on a mesh local shards with
global norms and the logged loss averaged over ranks.
"""
from __future__ import annotations

import functools
import itertools
from typing import Annotated, Any, ClassVar, Literal, Mapping

import msgspec
import torch

from fvx.config import Config
from fvx.core import flow, random, role, tree
from fvx.core.state import Batch, Program
from fvx_methods.library import one_role
from fvx_models.model import Model, StepRange

STUDENT = one_role.STUDENT
CORRUPT_STREAM = 1  # fold_in(timestep key, 1): a sample's draws of the family's cond corruption


# ---------------------------------------------------------------------------------------------------------- the loss


def loss_fn(params: dict, batch: Batch, key: torch.Tensor, *, model: Model,
            config: Finetune) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The fine-tuning loss of ``batch`` (latents ``[B, C, T, H, W]``, the model's cond, sample_index ``[B]``)
    under the step key ``key``; aux holds the mean drawn ``sigma``. A joint model's latents are a dict of modalities
    (module docstring): the loss is the sum of theirs, each in aux as ``<modality>_finetune_loss``."""
    x0 = model.normalize(tree.map_tensors(torch.Tensor.float, batch["latents"]))
    noise, t_keys = flow.per_sample_noise(key, batch["sample_index"], _sample_shapes(x0), _device(x0))
    sigma, t = (step_range_sigmas(key, t_keys, model.rules.step_ranges, config, _device(x0)) if model.rules.step_ranges
                else draw_sigmas(t_keys, x0, model=model, config=config))
    x_t = flow.add_noise(x0, noise, sigma)
    cond = batch["cond"]
    if model.rules.corrupt_cond is not None:  # the family's own corruption, from a stream of each sample's key
        cond = model.rules.corrupt_cond(torch.vmap(lambda k: random.fold_in(k, CORRUPT_STREAM))(t_keys), cond)
    v = model.apply(params, x_t, t, cond)
    if not model.joint:
        weight = None if model.rules.loss_weight is None else model.rules.loss_weight(sigma)
        if config.loss_weighting == "bell":
            bell = bell_weight(sigma, flow.training_sigmas(config.flow_shift, device=sigma.device))
            weight = bell if weight is None else weight * bell
        return _loss(v.float(), x_t, x0, noise, sigma, config, weight), {"sigma": sigma.mean()}
    losses = {name: _loss(v[name].float(), x_t[name], x0[name], noise[name], sigma[name], config) for name in v}
    return (sum(losses.values()),
            {"sigma": sigma["video"].mean(), **{f"{name}_finetune_loss": loss for name, loss in losses.items()}})


def draw_sigmas(t_keys: torch.Tensor, x0: Any, *, model: Model, config: Finetune) -> tuple[Any, Any]:
    """Each sample's training noise level and model timestep ``(sigma [B], t [B])`` from its key ``t_keys [B, 2]``:
    the model's own sampler (``Model.rules.sigma_sampler``, which reads ``x0``'s shape; dicts keyed by modality for a
    joint model), else ``u ~ weighting_scheme`` looked up on the training grid at ``flow_shift`` (``t = 1000 sigma``);
    a joint model without its own sampler takes every modality at that one level (Kandinsky 6: one clock)."""
    if model.rules.sigma_sampler is not None:
        return model.rules.sigma_sampler(t_keys, x0)
    grid = flow.training_sigmas(config.flow_shift, device=_device(x0))
    sigma, t = flow.sample_training_sigmas(t_keys, grid, config.weighting_scheme, logit_mean=config.logit_mean,
                                           logit_std=config.logit_std, mode_scale=config.mode_scale)
    if model.joint:
        return {name: sigma for name in model.modalities}, {name: t for name in model.modalities}
    return sigma, t


def step_range_sigmas(step_key: torch.Tensor, t_keys: torch.Tensor, ranges: tuple[StepRange, ...], config: Finetune,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigma [B], t [B])`` for a model that trains one timestep range per step (``Model.rules.step_ranges``: Wan 2.2
    A14B's experts): the step's range from ``uniform(step_key)``, the first whose cumulative probability reaches it (the
    same on every rank and micro-batch), then each sample's ``u ~ weighting_scheme`` from its key ``t_keys [B, 2]``
    spread over that range's levels of the training grid, ``first + floor(u count)``: FastVideo's ``u -> (1 - b) + u
    b`` for its low-noise expert (``fastvideo/training/training_pipeline.py:334-343``), at the router's levels."""
    grid = flow.training_sigmas(config.flow_shift, device=device)
    first, count = range_levels(grid, ranges)
    edges = torch.tensor(list(itertools.accumulate(part.probability for part in ranges)), device=device)
    chosen = torch.searchsorted(edges, random.uniform(step_key, (1,), device=device)).clamp(max=len(ranges) - 1)
    u = flow.sample_u(t_keys, config.weighting_scheme, logit_mean=config.logit_mean, logit_std=config.logit_std,
                      mode_scale=config.mode_scale, device=device)
    sigma = grid[first[chosen] + torch.minimum(torch.floor(u * count[chosen]).long(), count[chosen] - 1)]
    return sigma, flow.to_timestep(sigma, grid.shape[0])


def bell_weight(sigma: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """DiffSynth-Studio's per-timestep loss weight ``[B]`` at levels ``sigma [B]`` of the training ``grid [N]``
    (``diffsynth/diffusion/flow_match.py`` ``set_training_weight``): ``y = exp(-2 ((t - 500) / 1000)^2)`` at each
    level's timestep ``t = 1000 sigma``, less its least value on the grid, scaled to sum to ``N`` over the grid (mean
    one), looked up at the nearest level."""
    y = torch.exp(-2 * ((grid * 1000 - 500) / 1000) ** 2)
    table = (y - y.min()) * (grid.shape[0] / (y - y.min()).sum())
    return table[(grid[None, :] - sigma[:, None]).abs().argmin(dim=1)]


def range_levels(grid: torch.Tensor, ranges: tuple[StepRange, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The index of the first level of the descending ``grid [N]`` in each range (``t_min <= t < t_max``, ``t`` the
    level's timestep) and how many it holds, ``[R]`` int64 each (the levels of a range are consecutive)."""
    t = flow.to_timestep(grid, grid.shape[0])
    inside = torch.stack([(t >= part.t_min) & (t < part.t_max) for part in ranges])
    return inside.int().argmax(dim=1), inside.sum(dim=1)


def check_step_ranges(model: Model, config: Finetune) -> None:
    """A ValueError when one of the model's step ranges holds no level of the training grid at ``flow_shift``."""
    _, count = range_levels(flow.training_sigmas(config.flow_shift), model.rules.step_ranges)
    for part, n in zip(model.rules.step_ranges, count.tolist()):
        if n == 0:
            raise ValueError(f"method.flow_shift={config.flow_shift}: the training grid has no level in model "
                             f"{model.name}'s step range {part.t_min} <= t < {part.t_max}")


def _loss(v: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor,
          config: Finetune, weight: torch.Tensor | None = None) -> torch.Tensor:
    """One modality's mean squared error: of the velocity, or of the implied x0 (``precondition_outputs``); with the
    model's per-sample ``weight [B]`` (``Model.rules.loss_weight``), the weighted mean of the samples' errors."""
    if config.precondition_outputs:
        error = flow.x0_from_velocity(x_t, v, sigma) - x0
    else:
        error = v - flow.velocity_target(x0, noise)
    if weight is None:
        return torch.mean(error ** 2)
    return torch.mean(weight * (error ** 2).flatten(1).mean(1))


def logged(loss: torch.Tensor, aux: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The metrics of a step: the loss, and a joint model's loss of each modality."""
    return {"loss": loss, **{name: value for name, value in aux.items() if name.endswith("_finetune_loss")}}


def _sample_shapes(x0: Any) -> Any:
    return {name: tuple(x.shape[1:]) for name, x in x0.items()} if isinstance(x0, Mapping) else tuple(x0.shape[1:])


def _device(x0: Any) -> torch.device:
    return x0["video"].device if isinstance(x0, Mapping) else x0.device


# -------------------------------------------------------------------------------------------------------- the build


class FinetuneRoles(Config):
    """Which of the experiment's models plays each role."""

    student: str = "student"


class Finetune(one_role.OneRoleConfig, tag="finetune"):
    """Knobs of fine-tuning: the timestep density, the loss form and the training grid's shift, beside the one-role
    knobs (optimizer, gradient accumulation, EMA: ``fvx_methods.library.one_role.OneRoleConfig``). ``loss_weighting``:
    ``bell`` weighs each sample's velocity loss by DiffSynth-Studio's weight of its timestep (:func:`bell_weight`;
    its Wan recipes), ``none`` not. Defaults that differ from FastVideo's are listed in docs/design.md."""

    joint_models: ClassVar[bool] = True  # trains models that denoise several modalities together (MiniMax-H3)

    roles: FinetuneRoles = FinetuneRoles()
    weighting_scheme: Literal["uniform", "logit_normal", "mode"] = "uniform"
    logit_mean: float = 0.0
    logit_std: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    mode_scale: float = 1.0
    precondition_outputs: bool = False
    flow_shift: Annotated[float, msgspec.Meta(gt=0)] = 3.0
    loss_weighting: Literal["none", "bell"] = "none"

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's program for the student's model (``models["student"]``) and the run length (the LR schedule
        spans it); ``ranks``: where its numbers combine (a mesh's group); ``before_update`` sees each role's clipped
        gradients before its optimizer step."""
        model = models[STUDENT]
        if model.rules.sigma_sampler is not None and self.weighting_scheme != "uniform":
            raise ValueError(f"method.weighting_scheme={self.weighting_scheme}: model {model.name} draws its training "
                             "noise levels with its own sampler (its family's); leave the weighting scheme unset")
        if model.rules.step_ranges:
            check_step_ranges(model, self)
        if self.loss_weighting != "none" and model.joint:
            raise ValueError(f"method.loss_weighting={self.loss_weighting}: model {model.name} trains several "
                             "modalities together, each at its own level; leave it none")
        return one_role.program(self, model, total_steps=total_steps, ranks=ranks, before_update=before_update,
                                loss=functools.partial(loss_fn, model=model, config=self), logged=logged,
                                check=lambda batch: one_role.check_latents(batch, model),
                                samplers=one_role.many_step_samplers(model))
