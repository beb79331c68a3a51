"""Flow-matching fine-tuning (FastVideo's FineTuneMethod, spec §2.1) as pure functions.

Per sample b of the global batch: ``x0`` the normalised latents, ``noise ~ N(0, I)``, ``u ~ density``, ``sigma`` the
training-grid entry at ``floor(1000 u)``, ``x_t = (1 - sigma) x0 + sigma noise``, ``v = model(x_t, 1000 sigma)``, and

    loss = mean((v - (noise - x0))^2)              (default)
    loss = mean((x_t - sigma v - x0)^2)            (precondition_outputs: the loss on the implied x0)

Noise and timesteps come from ``fold_in(step_key, global_sample_index)``, so a sample draws the same numbers whatever
the number of ranks or micro-batches. The role ``student`` is a model of any family (``roles.student`` names it);
its ``cond`` comes with the batch. The rest is the one-role program (``fvx_methods.library.one_role``): the update
(global norm, finite check, clip, AdamW, EMA), the frozen base of a LoRA model, and on a mesh local shards with
global norms and the logged loss averaged over ranks.
"""
from __future__ import annotations

import functools
from typing import Annotated, Literal, Mapping

import msgspec
import torch

from fvx.config import Config
from fvx.core import flow, role
from fvx.core.state import Batch, Program
from fvx_methods.library import one_role
from fvx_models.model import Model

STUDENT = one_role.STUDENT


# ---------------------------------------------------------------------------------------------------------- the loss


def loss_fn(params: dict, batch: Batch, key: torch.Tensor, *, model: Model,
            config: Finetune) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The fine-tuning loss of ``batch`` (latents ``[B, C, T, H, W]``, the model's cond, sample_index ``[B]``)
    under the step key ``key``; aux holds the mean drawn ``sigma``."""
    x0 = model.normalize(batch["latents"].float())
    noise, t_keys = flow.per_sample_noise(key, batch["sample_index"], tuple(x0.shape[1:]), x0.device)
    grid = flow.training_sigmas(config.flow_shift, device=x0.device)
    sigma, t = flow.sample_training_sigmas(t_keys, grid, config.weighting_scheme, logit_mean=config.logit_mean,
                                           logit_std=config.logit_std, mode_scale=config.mode_scale)
    x_t = flow.add_noise(x0, noise, sigma)
    v = model.apply(params, x_t, t, batch["cond"]).float()
    if config.precondition_outputs:
        loss = torch.mean((flow.x0_from_velocity(x_t, v, sigma) - x0) ** 2)
    else:
        loss = torch.mean((v - flow.velocity_target(x0, noise)) ** 2)
    return loss, {"sigma": sigma.mean()}


# -------------------------------------------------------------------------------------------------------- the build


class FinetuneRoles(Config):
    """Which of the experiment's models plays each role."""

    student: str = "student"


class Finetune(one_role.OneRoleConfig, tag="finetune"):
    """Knobs of fine-tuning: the timestep density, the loss form and the training grid's shift, beside the one-role
    knobs (optimizer, gradient accumulation, EMA: ``fvx_methods.library.one_role.OneRoleConfig``). Defaults that
    differ from FastVideo's are listed in docs/design.md."""

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
        return one_role.program(self, model, total_steps=total_steps, ranks=ranks, before_update=before_update,
                                loss=functools.partial(loss_fn, model=model, config=self),
                                check=lambda batch: one_role.check_latents(batch, model),
                                samplers=one_role.many_step_samplers(model))
