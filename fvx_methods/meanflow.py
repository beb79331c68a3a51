"""MeanFlow (Geng et al. 2025, arXiv 2505.13447): train a two-time student ``u(x_t, t, r)`` to be the average velocity
from ``t`` to ``r``, by the MeanFlow identity ``u = v - (t - r) du/dt`` (``sigma = t / 1000``), as pure functions.

Per sample (keys ``fold_in(step_key, sample_index)``): a pair ``sigma_t >= sigma_r`` (``flow_map.time_pairs``: two
draws of ``density``, sorted; a ``diagonal_fraction`` with ``r = t``, an ``endpoint_fraction`` with ``r = 0``),
``x_t = (1 - sigma_t) x0 + sigma_t noise``, the velocity ``v`` (``noise - x0`` on data; the teacher's, guided, when
distilling) and

    du/dsigma = sg(d/dh u(x_t + h v, 1000 (sigma_t + h), 1000 sigma_r) at h = 0)    tangents (v, 1000, 0)
    u_tgt     = v - (sigma_t - sigma_r) du/dsigma
    e_b       = sum((u(x_t, t, r) - sg(u_tgt))^2)       over a sample's elements
    loss      = mean_b(e_b / sg(e_b + c)^p)              the paper's adaptive weight (p = 1, c = 1e-3)

The derivative is ``fvx.core.derivatives.directional`` (``dual`` by default, exact and sharding-safe;
``finite_difference`` runs compiled).
A one-step sample is ``x0 = noise - u(noise, 1000, 0)``; few-step samples jump between levels (``flow_map.sample``).
"""
from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, Mapping

import msgspec
import torch

from fvx.config import Config
from fvx.core import derivatives, flow, role
from fvx.core.state import Batch, HeldRole, Program, TrainState
from fvx.training import validation
from fvx_methods.library import flow_map, one_role
from fvx_models.model import Cond, Model, Params, check_shared_data

STUDENT, TEACHER = one_role.STUDENT, "teacher"


# ---------------------------------------------------------------------------------------------------------- the loss


def mean_velocity_target(model: Model, params: Params, x_t: torch.Tensor, sigma_t: torch.Tensor,
                         sigma_r: torch.Tensor, cond: Cond, v: torch.Tensor, config: MeanFlow) -> torch.Tensor:
    """``u_tgt = v - (sigma_t - sigma_r) du/dsigma`` along ``v`` (module docstring), no gradient."""
    r = sigma_r * flow.NUM_TRAIN_TIMESTEPS
    with torch.no_grad():
        du = derivatives.directional(lambda x, t: model.apply(params, x, t, cond, r=r),
                                     (x_t, sigma_t * flow.NUM_TRAIN_TIMESTEPS),
                                     (v, torch.full_like(sigma_t, float(flow.NUM_TRAIN_TIMESTEPS))),
                                     mode=config.derivative, step=config.fd_step)
        return v - flow_map.per_sample(sigma_t - sigma_r, x_t) * du


def loss_fn(params: Params, batch: Batch, key: torch.Tensor, *, model: Model, config: MeanFlow,
            velocity: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The MeanFlow loss of ``batch`` (latents ``[B, C, T, H, W]``, cond, sample_index ``[B]``) under the step key;
    ``velocity(x_t, t, cond) -> v`` replaces the data's ``noise - x0`` (a teacher's, when distilling)."""
    x0 = model.normalize(batch["latents"].float())
    noise, t_keys = flow.per_sample_noise(key, batch["sample_index"], tuple(x0.shape[1:]), x0.device)
    sigma_t, sigma_r, kind = flow_map.time_pairs(
        t_keys, diagonal=config.diagonal_fraction, endpoint=config.endpoint_fraction, shift=config.shift,
        density=config.density, logit_mean=config.logit_mean, logit_std=config.logit_std)
    x_t, cond = flow.add_noise(x0, noise, sigma_t), batch["cond"]
    t = sigma_t * flow.NUM_TRAIN_TIMESTEPS
    if velocity is None:
        v = flow.velocity_target(x0, noise)
    else:
        with torch.no_grad():
            v = velocity(x_t, t, cond)
    target = mean_velocity_target(model, params, x_t, sigma_t, sigma_r, cond, v, config)
    u = model.apply(params, x_t, t, cond, r=sigma_r * flow.NUM_TRAIN_TIMESTEPS)
    error = ((u - target) ** 2).flatten(1).sum(1)
    weight = 1.0 / (error.detach() + config.adaptive_c) ** config.adaptive_power
    return (weight * error).mean(), {"mse": ((u - target) ** 2).mean().detach(),
                                     "diagonal_fraction": (kind == flow_map.DIAGONAL).float().mean()}


def logged(loss: torch.Tensor, aux: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The unweighted mean squared error first (the weighted loss is near 1 whenever ``e_b >> c``)."""
    return {"mse": aux["mse"], "loss": loss, "diagonal_fraction": aux["diagonal_fraction"]}


# -------------------------------------------------------------------------------------------------------- the build


class MeanFlowRoles(Config):
    """Which of the experiment's models plays each role."""

    student: str = "student"


class MeanFlow(one_role.OneRoleConfig, tag="meanflow"):
    """Knobs of MeanFlow on data (module docstring), beside the one-role knobs: the time pairs (``density``,
    ``logit_mean``, ``logit_std``, ``shift``, ``diagonal_fraction`` with ``r = t``, ``endpoint_fraction`` with ``r =
    0``), the adaptive weight (``adaptive_power`` p, ``adaptive_c`` c), ``derivative`` (``dual``, ``ad``, or
    ``finite_difference`` with ``fd_step`` h in sigma) and ``sample_steps`` (the validation's jump counts). Defaults are
    the paper's ImageNet ones (logit-normal(-0.4, 1), 25 % of pairs with r != t, p = 1, c = 1e-3)."""

    roles: MeanFlowRoles = MeanFlowRoles()
    density: Literal["uniform", "logit_normal"] = "logit_normal"
    logit_mean: float = -0.4
    logit_std: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    shift: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    diagonal_fraction: float = 0.75
    endpoint_fraction: float = 0.0
    adaptive_power: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    adaptive_c: Annotated[float, msgspec.Meta(gt=0)] = 1e-3
    derivative: derivatives.Mode = "dual"
    fd_step: Annotated[float, msgspec.Meta(gt=0)] = 1e-4
    sample_steps: tuple[Annotated[int, msgspec.Meta(ge=1)], ...] = (1, 2, 4)

    def __post_init__(self) -> None:
        super().__post_init__()
        flow_map.check_fractions(self.diagonal_fraction, self.endpoint_fraction,
                                 ("diagonal_fraction", "endpoint_fraction"))

    @property
    def name(self) -> str:
        return "MeanFlow"

    def sampling(self, role_name: str) -> dict | None:
        """How the student is sampled as trained (recorded on export)."""
        return flow_map.sampling(self.sample_steps, self.shift) if role_name == STUDENT else None

    def check_models(self, models: Mapping[str, Model]) -> Model:
        """The student, once its r input and the derivative's mode are checked (before any weight loads)."""
        check_shared_data(models, data_role=STUDENT)
        model = models[STUDENT]
        flow_map.check_two_time(model, self.roles.student, self.name)
        derivatives.check_mode(self.derivative, compiled=model.kernels.compile_stats is not None,
                               sharded=model.weights.layout is not None, who="method.derivative",
                               no_forward_ad=model.rules.forward_ad_refusal)
        return model

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's program for the two-time student, trained on the data's velocity."""
        model = self.check_models(models)
        return one_role.program(self, model, total_steps=total_steps, ranks=ranks, before_update=before_update,
                                loss=functools.partial(loss_fn, model=model, config=self), logged=logged,
                                check=lambda batch: one_role.check_data(batch, model, self.grad_accum),
                                samplers=flow_map.samplers(model, self.sample_steps, self.shift))


class MeanFlowDistillRoles(Config):
    """Which of the experiment's models plays each role."""

    student: str = "student"
    teacher: str = "teacher"


class MeanFlowDistill(MeanFlow, tag="meanflow_distill"):
    """MeanFlow distilled from a frozen teacher: ``v`` is the teacher's velocity at ``(x_t, t)`` under
    classifier-free guidance ``guidance_scale`` (``uncond + g (cond - uncond)``, the unconditional cond
    ``cfg_uncond``; ``negative_prompt``: the cond file ``negative_prompt_path``) instead of ``noise - x0``."""

    roles: MeanFlowDistillRoles = MeanFlowDistillRoles()
    guidance_scale: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    cfg_uncond: Literal["negative_prompt", "zero", "keep"] = "negative_prompt"
    negative_prompt_path: str | None = None

    @property
    def name(self) -> str:
        return "MeanFlow distillation"

    def held_roles(self) -> tuple[HeldRole, ...]:
        return (*super().held_roles(), HeldRole(TEACHER, trainable=False))

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's program: the two-time student trained on the frozen teacher's guided velocity."""
        model, teacher = self.check_models(models), models[TEACHER]
        negative = (None if self.negative_prompt_path is None or self.guidance_scale == 1.0
                    else model.load_negative(self.negative_prompt_path, "method.negative_prompt_path"))

        guided = validation.guided(teacher.apply, lambda cond: teacher.uncond(cond, self.cfg_uncond, negative),
                                   self.guidance_scale)

        def loss(params: Params, batch: Batch, key: torch.Tensor, *, teacher_params: Params):
            velocity = functools.partial(guided, teacher_params)
            return loss_fn(params, batch, key, model=model, config=self, velocity=velocity)

        def check(batch: Batch) -> None:
            one_role.check_data(batch, model, self.grad_accum)
            if self.guidance_scale != 1.0:
                teacher.uncond(batch["cond"], self.cfg_uncond, negative)  # a negative prompt is there when needed

        return one_role.program(self, model, total_steps=total_steps, ranks=ranks, before_update=before_update,
                                loss=loss, logged=logged, check=check,
                                samplers=flow_map.samplers(model, self.sample_steps, self.shift),
                                frozen_roles={TEACHER: teacher}, loss_inputs=teacher_params)


def teacher_params(state: TrainState, frozen: Mapping[str, Params]) -> dict[str, Params]:
    return {"teacher_params": frozen[TEACHER]}

