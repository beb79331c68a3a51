"""Flow-matching fine-tuning (FastVideo's FineTuneMethod, spec §2.1) as pure functions.

Per sample b of the global batch: ``x0`` the normalised latents, ``noise ~ N(0, I)``, ``u ~ density``, ``sigma`` the
training-grid entry at ``floor(1000 u)``, ``x_t = (1 - sigma) x0 + sigma noise``, ``v = model(x_t, 1000 sigma)``, and

    loss = mean((v - (noise - x0))^2)              (default)
    loss = mean((x_t - sigma v - x0)^2)            (precondition_outputs: the loss on the implied x0)

Noise and timesteps come from ``fold_in(step_key, global_sample_index)``, so a sample draws the same numbers whatever
the number of ranks or micro-batches. The role ``student`` is a model of any family (``roles.student`` names it);
its ``cond`` comes with the batch. The role's state holds the params the model trains (``Model.initial_params``:
all of them, or the adapters of a LoRA model, or the part a family config leaves trainable); what the model holds
frozen (a LoRA base) is a frozen argument of the step, never saved. The update is ``fvx.role``'s: global norm,
finite check, clip, AdamW, EMA.

Data parallel (``build(..., mesh=...)``): params, gradients and AdamW state are this rank's local shards; each rank's
loss is the plain mean over its own slice of the global batch (the gathers' backward averages gradients over ranks),
the gradient norm is global (one all-reduce), and the logged loss is the mean over ranks.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping

import msgspec
import torch

from fvx import ema, flow, random, role, sharding, validation
from fvx.config import Config
from fvx.optim_config import AdamWConfig
from fvx.state import Batch, Metrics, Program, TrainState
from fvx_models.model import Model, Params

STUDENT = "student"


# ---------------------------------------------------------------------------------------------------------- the loss


def per_sample_noise(key: torch.Tensor, sample_index: torch.Tensor, shape: tuple[int, ...],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample keys ``fold_in(key, index)`` split into (noise ``[B, *shape]``, timestep keys ``[B, 2]``)."""
    sample_keys = torch.vmap(random.split)(random.fold_in(key, sample_index))
    return random.normal_each(sample_keys[:, 0], shape, device=device), sample_keys[:, 1]


def loss_fn(params: dict, batch: Batch, key: torch.Tensor, *, model: Model,
            config: Finetune) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The fine-tuning loss of ``batch`` (latents ``[B, C, T, H, W]``, the model's cond, sample_index ``[B]``)
    under the step key ``key``; aux holds the mean drawn ``sigma``."""
    x0 = model.normalize(batch["latents"].float())
    noise, t_keys = per_sample_noise(key, batch["sample_index"], tuple(x0.shape[1:]), x0.device)
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


# ---------------------------------------------------------------------------------------------------------- the step


def step_(state: TrainState, batch: Batch, *, model: Model, config: Finetune, opt: role.RoleOptimizer,
          base: Params | None = None, before: role.BeforeUpdate | None = None) -> tuple[TrainState, Metrics]:
    """One optimizer step over ``config.grad_accum`` micro-batches, donating ``state`` (see fvx.state.Program).

    Metrics: ``loss`` (mean over micro-batches and ranks), ``grad_norm`` (before clipping), ``lr`` (the one applied).
    A non-finite loss or gradient applies nothing and adds ``nonfinite = 1`` (see fvx.state.skipped); every rank
    decides alike, from the rank-mean loss and the global norm.
    """
    return role.step_one_(state, batch, loss_fn, opt=opt, name=STUDENT, grad_accum=config.grad_accum, base=base,
                          before=before, model=model, config=config)


# -------------------------------------------------------------------------------------------------------- the build


class FinetuneRoles(Config):
    """Which of the experiment's models plays each role."""

    student: str = "student"


class Finetune(Config, tag="finetune"):
    """Knobs of fine-tuning: the optimizer, the timestep density, the loss form, gradient accumulation, and an EMA of
    the params (``ema_decay``, None or 0 for none): a copy at update ``max(ema_start_step, 1)``, then
    ``ema <- d ema + (1 - d) params`` after every update; validation and ``export --ema`` use it. Defaults that
    differ from FastVideo's are listed in docs/design.md."""

    roles: FinetuneRoles = FinetuneRoles()
    optim: AdamWConfig = AdamWConfig()
    weighting_scheme: Literal["uniform", "logit_normal", "mode"] = "uniform"
    logit_mean: float = 0.0
    logit_std: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    mode_scale: float = 1.0
    precondition_outputs: bool = False
    flow_shift: Annotated[float, msgspec.Meta(gt=0)] = 3.0
    grad_accum: Annotated[int, msgspec.Meta(ge=1)] = 1
    ema_decay: float | None = None
    ema_start_step: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if self.optim.lr <= 0:
            raise ValueError(f"fine-tuning needs optim.lr > 0, got {self.optim.lr}")
        if self.ema_decay:
            ema.check_decay(self.ema_decay)

    def build(self, models: Mapping[str, Model], *, total_steps: int, mesh: Any = None,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's program for this config, the student's model (``models["student"]``) and run length (the LR
        schedule needs it); on a device mesh (a model built on the same mesh) the step runs on local shards with
        global norms. ``before_update`` sees each role's clipped gradients before its optimizer step."""
        model = models[STUDENT]
        group = sharding.Group() if mesh is None else sharding.group_of(mesh)
        opt = self.optim.role(total_steps, group, ema_decay=self.ema_decay, ema_start_step=self.ema_start_step)
        return Program(
            model=model,
            init=lambda run_key: init(run_key, model, opt),
            frozen=lambda run_key: role.frozen_params(random.split(run_key)[0], {STUDENT: (model, False)}),
            step_=lambda state, frozen, batch: step_(state, batch, model=model, config=self, opt=opt,
                                                     base=frozen.get(STUDENT), before=before_update),
            check=lambda batch: check_batch(batch, model),
            validate=lambda state, frozen, validation_config: validate(state, validation_config, model=model,
                                                                       base=frozen.get(STUDENT)),
        )

    def memory_plan(self, specs: Mapping[str, Any]) -> Any:
        """For ``--dry-run``: one trainable fp32 role with AdamW; a rank's batch runs in ``grad_accum`` pieces."""
        from fvx import dry_run, memory  # the dry run only

        return dry_run.Plan(roles=(memory.Role(STUDENT, specs[STUDENT], trainable=True, ema=bool(self.ema_decay)),),
                            micro_batches=self.grad_accum)


def init(run_key: torch.Tensor, model: Model, opt: role.RoleOptimizer) -> TrainState:
    """The initial state: the params the model trains (loaded or drawn from the first half of ``split(run_key)``,
    which also draws its frozen base), a fresh optimizer state and, when kept, an EMA copy; step 0."""
    params_key, steps_key = random.split(run_key)
    student = role.init(opt, model.initial_params(params_key))
    return TrainState(step=torch.zeros((), dtype=torch.int64), key=steps_key, roles={STUDENT: student})


def check_batch(batch: Batch, model: Model) -> None:
    """Raise a ValueError naming both shapes when the batch's latents do not fit ``model`` (its cond was checked
    when the model made it)."""
    if "latents" not in batch:
        raise ValueError("fine-tuning needs latents, but the batch has none (text_only data?)")
    model.check_latents(tuple(batch["latents"].shape), where="batch latents")


def validate(state: TrainState, config: validation.ValidationConfig, *, model: Model,
             base: Params | None = None) -> list[validation.Sampler]:
    """The model to sample at a validation: the EMA params when kept, else the params (with the frozen ``base``),
    on the many-step ODE with the validation's classifier-free guidance (``validation.guidance_scale``)."""
    student = state.roles[STUDENT]
    sigmas = validation.many_step_sigmas(config.num_steps, config.flow_shift)
    params = role.with_trained(base, student.params if student.ema is None else student.ema)
    return [validation.Sampler("model" if student.ema is None else "model_ema", model.apply, params, sigmas, "ode",
                               guided=True)]
