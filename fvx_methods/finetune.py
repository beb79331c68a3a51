"""Flow-matching fine-tuning (FastVideo's FineTuneMethod, spec §2.1) as pure functions.

Per sample b of the global batch: ``x0`` the normalised latents, ``noise ~ N(0, I)``, ``u ~ density``, ``sigma`` the
training-grid entry at ``floor(1000 u)``, ``x_t = (1 - sigma) x0 + sigma noise``, ``v = model(x_t, 1000 sigma)``, and

    loss = mean((v - (noise - x0))^2)              (default)
    loss = mean((x_t - sigma v - x0)^2)            (precondition_outputs: the loss on the implied x0)

Noise and timesteps come from ``fold_in(step_key, global_sample_index)``, so a sample draws the same numbers whatever
the number of ranks or micro-batches. A model with its own training noise levels (``Model.sigma_sampler``: LTX-2's
shifted logit-normal, MiniMax-H3's coupled draws) draws ``sigma`` with it instead of the density and grid.

A joint model (``Model.joint``: MiniMax-H3's video and audio) takes every modality at its own noise and level, and the
loss is the sum of the modalities' losses, each logged (FastVideo's ``video_finetune_loss``, ``audio_finetune_loss``):

    loss = sum_m mean((v_m - (noise_m - x0_m))^2)

The role ``student`` is a model of any family (``roles.student`` names it);
its ``cond`` comes with the batch. The rest is the one-role program (``fvx_methods.library.one_role``): the update
(global norm, finite check, clip, AdamW, EMA), the frozen base of a LoRA model, and on a mesh local shards with
global norms and the logged loss averaged over ranks.
"""
from __future__ import annotations

import functools
from typing import Annotated, Any, ClassVar, Literal, Mapping

import msgspec
import torch

from fvx.config import Config
from fvx.core import flow, role, tree
from fvx.core.state import Batch, Program
from fvx_methods.library import one_role
from fvx_models.model import Model

STUDENT = one_role.STUDENT


# ---------------------------------------------------------------------------------------------------------- the loss


def loss_fn(params: dict, batch: Batch, key: torch.Tensor, *, model: Model,
            config: Finetune) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The fine-tuning loss of ``batch`` (latents ``[B, C, T, H, W]``, the model's cond, sample_index ``[B]``)
    under the step key ``key``; aux holds the mean drawn ``sigma``. A joint model's latents are a dict of modalities
    (module docstring): the loss is the sum of theirs, each in aux as ``<modality>_finetune_loss``."""
    x0 = model.normalize(tree.map_tensors(torch.Tensor.float, batch["latents"]))
    noise, t_keys = flow.per_sample_noise(key, batch["sample_index"], _sample_shapes(x0), _device(x0))
    if model.sigma_sampler is not None:
        sigma, t = model.sigma_sampler(t_keys, x0)
    else:
        grid = flow.training_sigmas(config.flow_shift, device=_device(x0))
        sigma, t = flow.sample_training_sigmas(t_keys, grid, config.weighting_scheme, logit_mean=config.logit_mean,
                                               logit_std=config.logit_std, mode_scale=config.mode_scale)
    x_t = flow.add_noise(x0, noise, sigma)
    v = model.apply(params, x_t, t, batch["cond"])
    if not model.joint:
        return _loss(v.float(), x_t, x0, noise, sigma, config), {"sigma": sigma.mean()}
    losses = {name: _loss(v[name].float(), x_t[name], x0[name], noise[name], sigma[name], config) for name in v}
    return (sum(losses.values()),
            {"sigma": sigma["video"].mean(), **{f"{name}_finetune_loss": loss for name, loss in losses.items()}})


def _loss(v: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor,
          config: Finetune) -> torch.Tensor:
    """One modality's mean squared error: of the velocity, or of the implied x0 (``precondition_outputs``)."""
    if config.precondition_outputs:
        return torch.mean((flow.x0_from_velocity(x_t, v, sigma) - x0) ** 2)
    return torch.mean((v - flow.velocity_target(x0, noise)) ** 2)


def logged(loss: torch.Tensor, aux: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The metrics of a step: the loss, and a joint model's loss of each modality."""
    return {"loss": loss, **{name: value for name, value in aux.items() if name.endswith("_finetune_loss")}}


def _check(batch: Batch, model: Model, grad_accum: int) -> None:
    one_role.check_latents(batch, model)
    one_role.check_micro_batch(batch, model, grad_accum)


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
    knobs (optimizer, gradient accumulation, EMA: ``fvx_methods.library.one_role.OneRoleConfig``). Defaults that
    differ from FastVideo's are listed in docs/design.md."""

    joint_models: ClassVar[bool] = True  # trains models that denoise several modalities together (MiniMax-H3)

    roles: FinetuneRoles = FinetuneRoles()
    weighting_scheme: Literal["uniform", "logit_normal", "mode"] = "uniform"
    logit_mean: float = 0.0
    logit_std: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    mode_scale: float = 1.0
    precondition_outputs: bool = False
    flow_shift: Annotated[float, msgspec.Meta(gt=0)] = 3.0

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's program for the student's model (``models["student"]``) and the run length (the LR schedule
        spans it); ``ranks``: where its numbers combine (a mesh's group); ``before_update`` sees each role's clipped
        gradients before its optimizer step."""
        model = models[STUDENT]
        if model.sigma_sampler is not None and self.weighting_scheme != "uniform":
            raise ValueError(f"method.weighting_scheme={self.weighting_scheme}: model {model.name} draws its training "
                             "noise levels with its own sampler (its family's); leave the weighting scheme unset")
        return one_role.program(self, model, total_steps=total_steps, ranks=ranks, before_update=before_update,
                                loss=functools.partial(loss_fn, model=model, config=self), logged=logged,
                                check=lambda batch: _check(batch, model, self.grad_accum),
                                samplers=one_role.many_step_samplers(model))
