"""DMD2 distribution-matching distillation (FastVideo's DMD2Method, spec §2.4): the student's rollout, the cadence and
the build over the distribution-matching core (``fvx_methods.library.distribution_matching``: the losses and formulas).

Roles (``roles`` names the experiment's model of each): the **student** (trainable, few-step), the **critic**
(trainable, the fake score) and the **teacher** (frozen, the real score: made once by the loop in its config's
``frozen_dtype``, never saved, called under ``torch.no_grad``). A LoRA student or critic trains adapters on a frozen
base; roles of one base (the teacher's architecture and weights) hold one copy of it (``fvx.core.role.frozen_params``).

Rollout, per sample with ``k ~ randint[0, K)`` over the student's steps ``s_0 > ... > s_{K-1}``: ``simulate`` makes
``k`` no-grad hops ``x <- add_noise(x0(x, s_j), eps_{j+1}, s_{j+1})`` from ``eps_0`` (hop ``j`` runs on the samples with
``k > j``, for as many hops as the largest ``k`` of any rank); ``data_latent`` noises the data latents to ``s_k``; then
one graded call ``x0_gen = x0(x, s_k)``. Draws come from the global sample index (world-size invariant).

Cadence (iteration ``i = step + 1``): the critic updates every step, the student iff ``i % generator_update_interval
== 0`` (always when ``<= 0``), both from the params before the step; the student's EMA steps every step. Deviations
from FastVideo are listed in docs/design.md.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from fvx.config import Config
from fvx.core import flow, random, role
from fvx.core.state import Batch, Metrics, Program, TrainState
from fvx.training import validation
from fvx_methods.library import distribution_matching as dm
from fvx_models.model import Cond, Model, Params

STUDENT, CRITIC, TEACHER = dm.STUDENT, dm.CRITIC, dm.TEACHER
Positive = dm.Positive


# ------------------------------------------------------------------------------------------------------ the rollout


def rollout(params: Params, batch: Batch, key: torch.Tensor, with_grad: bool, *, model: Model, config: DMD2,
            ranks: role.Ranks = role.ONE_PROCESS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x0_gen [B, C, T, H, W] fp32, the graded timesteps [B])`` (module docstring). ``split(key)``: the exit
    indices ``k`` (per sample) and the noise (draw ``j`` of a sample by ``dm.per_sample_normal``). Only the last
    call records a graph, and only when ``with_grad``."""
    index_key, noise_key = random.split(key)
    index, device = batch["sample_index"], batch["sample_index"].device
    grid = flow.training_sigmas(config.flow_shift, device=device)
    steps = dm.denoising_timesteps(config.denoising_steps, config.warp_denoising_step, grid).to(device)
    k = dm.per_sample_randint(index_key, index, len(steps)).to(device)
    if config.rollout_mode == "data_latent":
        x0 = model.normalize(batch["latents"].float())
        x = flow.add_noise(x0, dm.per_sample_normal(noise_key, index, 0, tuple(x0.shape[1:]), device),
                           flow.nearest_grid_sigma(grid, steps[k]))
    else:
        shape = dm.sample_shape(batch, config)
        x = dm.per_sample_normal(noise_key, index, 0, shape, device)
        with torch.no_grad():
            for j in range(ranks.max(int(k.max()))):
                hopping = torch.nonzero(j < k).squeeze(1)  # the samples not yet at their k
                rows = hopping if len(hopping) else hopping.new_zeros(1)  # a rank with none still calls (gathers)
                cond = {name: c[rows] for name, c in batch["cond"].items()}
                x0_j = dm.predict_x0(model, params, x[rows], steps[j].expand(len(rows)), cond, grid)
                hop = flow.add_noise(x0_j, dm.per_sample_normal(noise_key, index[rows], j + 1, shape, device),
                                     flow.nearest_grid_sigma(grid, steps[j + 1]))
                x = x.index_copy(0, hopping, hop[:len(hopping)])
    with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
        return dm.predict_x0(model, params, x, steps[k], batch["cond"], grid).float(), steps[k]


# --------------------------------------------------------------------------------------------------------- the step


def step_(state: TrainState, batch: Batch, *, roles: dm.Roles, config: DMD2, frozen: Mapping[str, Params],
          negative: Cond | None = None, before: role.BeforeUpdate | None = None) -> tuple[TrainState, Metrics]:
    """One DMD2 step, donating ``state``: the distribution-matching step (``dm.step_``: the critic every step, the
    student on its cadence) with the rollout above."""
    score = config.score()

    def rollout_(params: Params, micro: Batch, key: torch.Tensor, with_grad: bool):
        return rollout(params, micro, key, with_grad, model=roles.student, config=config,
                       ranks=roles.critic_opt.ranks)

    return dm.step_(state, batch, roles=roles, frozen=frozen, score=score, rollout=rollout_,
                    interval=config.generator_update_interval, grad_accum=config.grad_accum,
                    student_grads=dm.generator_grads(rollout_, roles, score, negative), before=before)


# -------------------------------------------------------------------------------------------------------- the build


class DMD2Roles(Config):
    """Which of the experiment's models plays each role (the critic is a copy of the student's model by default)."""

    student: str = "student"
    critic: str = "student"
    teacher: str = "teacher"


class DMD2(dm.DistributionMatchingConfig, tag="dmd2"):
    """Every knob of FastVideo's DMD2 (spec §2.4), flat as in its YAML: the distribution-matching ones
    (``dm.DistributionMatchingConfig``: rollout mode, steps, cadence, guidance, optimizers, EMA, ...) and:

    min_timestep_ratio / max_timestep_ratio, timestep_shift: the score timesteps' window and shift
        (``pipeline.flow_shift``); flow_shift is the models' training-grid shift.
    sampling_shift: the shift of the grid whose levels the student's few-step sampling (validation, the export's
        record) converts with; None: ``flow_shift``, the grid the rollout trains on. FastVideo's DMD validation and
        inference stage uses 8 whatever its shifts (:func:`student_schedule`).
    """

    roles: DMD2Roles = DMD2Roles()
    min_timestep_ratio: float = 0.0
    max_timestep_ratio: float = 1.0
    timestep_shift: Positive = 3.0
    sampling_shift: Positive | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.min_timestep_ratio <= self.max_timestep_ratio <= 1.0:
            raise ValueError(f"need 0 <= min_timestep_ratio <= max_timestep_ratio <= 1, got "
                             f"min={self.min_timestep_ratio}, max={self.max_timestep_ratio}")

    def score(self) -> dm.Score:
        return dm.Score(self.flow_shift, self.timestep_shift, self.min_timestep_ratio, self.max_timestep_ratio,
                        self.guidance_scale, self.cfg_uncond)

    def sampling(self, role: str) -> dict | None:
        """How a role is sampled as trained (recorded on export): the student with its few-step SDE, unguided, as
        validation samples it (:func:`student_schedule`: the model at each timestep, the grid sigma nearest it)."""
        if role != STUDENT:
            return None
        steps, sigmas = student_schedule(self)
        return {"timesteps": steps.tolist(), "sigmas": sigmas.tolist(), "sampler": "sde (x0, re-noised)"}

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's Program for the role -> model mapping and a ``total_steps`` run (``dm.program``); bad input
        fails before any weights load."""
        return dm.program(self, models, total_steps=total_steps, ranks=ranks, before_update=before_update,
                          step_=step_, check=dm.check_batch, validate=validate)


def student_schedule(config: DMD2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(timesteps [K], sigmas [K])`` of the student's few-step sampling: the model is called at each denoising
    timestep ``s_k`` and converts with the level nearest it of the grid at ``sampling_shift`` (default
    ``flow_shift``), ``nearest_grid_sigma(training_sigmas(shift), s_k)``: with the default, as the rollout trains
    it; with 8, as FastVideo's ``DmdDenoisingStage`` samples (its scheduler at a fixed shift 8)."""
    steps = dm.denoising_timesteps(config.denoising_steps, config.warp_denoising_step,
                                   flow.training_sigmas(config.flow_shift))
    shift = config.flow_shift if config.sampling_shift is None else config.sampling_shift
    return steps, flow.nearest_grid_sigma(flow.training_sigmas(shift), steps)


def few_step_draw(apply_fn: Any, steps: torch.Tensor, sigmas: torch.Tensor) -> Any:
    """``draw(params, noise, cond, key, guidance=None)`` for ``validation.Sampler``: ``flow.sde_sample`` on
    ``sigmas`` with the model at ``steps`` (unguided: ``guidance`` is unused)."""
    def draw(params: Any, noise: torch.Tensor, cond: Any, key: torch.Tensor, guidance: Any = None) -> torch.Tensor:
        return flow.sde_sample(apply_fn, params, noise, sigmas, key, cond=cond, timesteps=steps)
    return draw


def validate(state: TrainState, validation_config: Any, *, roles: dm.Roles, config: DMD2, frozen: Mapping[str, Params],
             negative: Cond | None = None) -> list[validation.Sampler]:
    """The student (its EMA when kept), few-step SDE on :func:`student_schedule`, unguided; ``validate_teacher``:
    the guided many-step teacher."""
    student, teacher = state.roles[STUDENT], frozen[TEACHER]
    steps, sigmas = student_schedule(config)
    params = role.with_trained(frozen.get(STUDENT), student.params if student.ema is None else student.ema)
    samplers = [validation.Sampler("student" if student.ema is None else "student_ema", roles.student.apply,
                                   params, sigmas, "sde", draw=few_step_draw(roles.student.apply, steps, sigmas))]
    if config.validate_teacher:
        samplers.append(dm.teacher_sampler(roles, teacher, config, validation_config, negative))
    return samplers
