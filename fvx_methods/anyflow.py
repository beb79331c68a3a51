"""AnyFlow stage 2: distil a two-time flow-map student on its own samples (FastVideo's AnyFlowMethod, spec §2.6):
DMD2 (``fvx_methods.dmd2``: its critic, DMD loss, cadence and knobs) with the student's flow-map rollout.

Rollout over the schedule ``s_0 > ... > s_K`` (``t_list_override``, or the DMD2 denoising steps, warped as DMD2 warps
them, with 0 appended; longer than ``student_sample_steps`` jumps: its first ones and the last level): from
``x ~ N(0, I)`` (per sample), for ``i < K``: ``u = student(x, s_i, r)`` with ``r = s_{i+1}`` (``use_mean_velocity``,
else ``r = s_i``) and ``x <- x - ((s_i - s_{i+1}) / 1000) u``. The generator's path records a graph on one jump ``g``
(drawn from the step key, the same for every sample and rank) and returns the state after it (not necessarily at
level 0, as FastVideo); the critic's path runs every jump without a graph. The teacher and critic score ``x0_gen`` as
DMD2's do (``predict_x0`` on their grids).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from fvx.core import flow, random, role
from fvx.core.state import Batch, Metrics, Program, TrainState
from fvx.training import validation
from fvx_methods import dmd2
from fvx_methods.library import distribution_matching as dm, flow_map
from fvx_models.model import Cond, Model, Params

STUDENT, CRITIC, TEACHER = dm.STUDENT, dm.CRITIC, dm.TEACHER


def schedule(config: AnyFlow) -> torch.Tensor:
    """The rollout's levels ``[K + 1]`` in timesteps, descending to 0 (module docstring)."""
    if config.t_list_override is not None:
        levels = torch.tensor(config.t_list_override, dtype=torch.float32)
    else:
        levels = dm.denoising_timesteps(config.denoising_steps, config.warp_denoising_step,
                                        flow.training_sigmas(config.flow_shift))
        if float(levels[-1]) != 0.0:
            levels = torch.cat([levels, torch.zeros(1)])
    if len(levels) - 1 > config.student_sample_steps:
        levels = torch.cat([levels[:config.student_sample_steps], levels[-1:]])
    return levels


# ------------------------------------------------------------------------------------------------------ the rollout


def rollout(params: Params, batch: Batch, key: torch.Tensor, with_grad: bool, *, model: Model,
            config: AnyFlow) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x0_gen [B, C, T, H, W] fp32, the graded jump's level [B])`` (module docstring). ``split(key)``: the graded
    jump (one draw) and the noise (per sample, ``dm.per_sample_normal``)."""
    jump_key, noise_key = random.split(key)
    index, device = batch["sample_index"], batch["sample_index"].device
    levels = schedule(config).to(device)
    graded = int(random.randint(jump_key, (), 0, len(levels) - 1)) if with_grad else -1
    x = dm.per_sample_normal(noise_key, index, 0, dm.sample_shape(batch, config), device)
    for i in range(len(levels) - 1):
        t, t_next = levels[i].expand(len(x)), levels[i + 1].expand(len(x))
        with torch.set_grad_enabled(i == graded and torch.is_grad_enabled()):
            u = model.apply(params, x, t, batch["cond"], r=t_next if config.use_mean_velocity else t)
            x = x - ((t - t_next) / flow.NUM_TRAIN_TIMESTEPS).view(-1, 1, 1, 1, 1) * u
        if i == graded:
            return x.float(), t
    return x.float(), levels[-2].expand(len(x))


# --------------------------------------------------------------------------------------------------------- the step


def step_(state: TrainState, batch: Batch, *, roles: dm.Roles, config: AnyFlow, frozen: Mapping[str, Params],
          negative: Cond | None = None, before: role.BeforeUpdate | None = None) -> tuple[TrainState, Metrics]:
    """One AnyFlow step, donating ``state``: the distribution-matching step with the flow-map rollout."""
    score = config.score()

    def rollout_(params: Params, micro: Batch, key: torch.Tensor, with_grad: bool):
        return rollout(params, micro, key, with_grad, model=roles.student, config=config)

    return dm.step_(state, batch, roles=roles, frozen=frozen, score=score, rollout=rollout_,
                    interval=config.generator_update_interval, grad_accum=config.grad_accum,
                    student_grads=dm.generator_grads(rollout_, roles, score, negative), before=before)


# -------------------------------------------------------------------------------------------------------- the build


class AnyFlow(dmd2.DMD2, tag="anyflow"):
    """FastVideo's AnyFlow knobs: DMD2's (``fvx_methods.dmd2.DMD2``; ``rollout_mode`` must be ``simulate``: the
    flow-map rollout starts from noise) and ``student_sample_steps`` (at most this many jumps), ``use_mean_velocity``
    (``r`` the next level; False: ``r = t``, the instantaneous velocity) and ``t_list_override`` (the levels
    themselves, descending timesteps). FastVideo's ``dmd_score_r_value`` is parsed there and never used (spec §7.3):
    fvx has no such knob."""

    student_sample_steps: dm.PositiveInt = 4
    use_mean_velocity: bool = True
    t_list_override: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollout_mode != "simulate":
            raise ValueError("AnyFlow rolls the student out from noise (its flow-map jumps); rollout_mode="
                             f"{self.rollout_mode!r} would be ignored: use method.rollout_mode=simulate")
        levels = self.t_list_override
        if levels is not None and (len(levels) < 2 or any(a <= b for a, b in zip(levels, levels[1:]))
                                   or levels[0] > flow.NUM_TRAIN_TIMESTEPS or levels[-1] < 0):
            raise ValueError(f"method.t_list_override must be at least 2 strictly descending timesteps in [0, 1000], "
                             f"got {list(levels)}")

    def sampling(self, role_name: str) -> dict | None:
        """How the student is sampled as trained (recorded on export): its jumps over the schedule."""
        if role_name != STUDENT:
            return None
        return {"sampler": "flow map: x_r = x_t - ((t - r) / 1000) u(x_t, t, r), r the next level"
                           + ("" if self.use_mean_velocity else " (r = t: Euler)"),
                "timesteps": schedule(self).tolist()}

    def check_models(self, models: Mapping[str, Model]) -> None:
        """``dm``'s refusals, and a student without the r input its jumps need: ``dm.program`` and the dry run call
        it."""
        super().check_models(models)
        if self.use_mean_velocity:
            flow_map.check_two_time(models[STUDENT], self.roles.student, "AnyFlow")

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's Program (``dm.program``); a student without the r input fails before any weights load
        (:meth:`check_models`)."""
        return dm.program(self, models, total_steps=total_steps, ranks=ranks, before_update=before_update,
                          step_=step_, check=dm.check_batch, validate=validate)


def validate(state: TrainState, validation_config: Any, *, roles: dm.Roles, config: AnyFlow,
             frozen: Mapping[str, Params], negative: Cond | None = None) -> list[validation.Sampler]:
    """The student (its EMA when kept) by its jumps over the schedule, unguided; ``validate_teacher``: the guided
    many-step teacher."""
    student = state.roles[STUDENT]
    params = role.with_trained(frozen.get(STUDENT), student.params if student.ema is None else student.ema)
    sigmas = schedule(config) / flow.NUM_TRAIN_TIMESTEPS

    def draw(p: Params, noise: torch.Tensor, cond: Any, key: torch.Tensor, guidance: Any = None) -> torch.Tensor:
        return flow_map.sample(roles.student, p, noise, sigmas, cond, mean_velocity=config.use_mean_velocity)

    samplers = [validation.Sampler("student" if student.ema is None else "student_ema", roles.student.apply, params,
                                   sigmas, draw=draw)]
    if config.validate_teacher:
        samplers.append(dm.teacher_sampler(roles, frozen[TEACHER], config, validation_config, negative))
    return samplers

