"""Continuous-time consistency models, sCM (Lu & Song 2024, "Simplifying, Stabilizing and Scaling Continuous-Time
Consistency Models", arXiv 2410.11081), trained on data (consistency training) or from a frozen teacher (consistency
distillation), as pure functions over a flow-matching model.

TrigFlow with sigma_d = 1: ``x_t = cos(t) x0 + sin(t) z`` for ``t`` in [0, pi/2], the network ``F(x_t, t)`` the
velocity ``dx_t/dt`` and the consistency function ``f(x_t, t) = cos(t) x_t - sin(t) F(x_t, t)``. A flow-matching
model ``v`` (``x_s = (1 - s) x0 + s z``, ``s = sin t / (sin t + cos t)``, ``x_s = x_t / (sin t + cos t)``) is one
exactly: ``F = (cos t - sin t) x_s + v(x_s, 1000 s) / (sin t + cos t)``, and ``f`` is then its ``x0`` prediction.

Per sample (keys ``fold_in(step_key, sample_index)``): ``tau ~ N(p_mean, p_std^2)``, ``t = arctan(e^tau)``, and

    dx/dt  = cos(t) z - sin(t) x0                    (on data; a teacher's F(x_t, t), guided, when distilling)
    F-, J  = sg(F(x_t, t)), sg(d/dh F(x_t + h cs dx/dt, t + h cs))     cs = cos(t) sin(t): tangent warm-up-free scale
    g      = -cos(t)^2 (F- - dx/dt) - r (cs x_t + J)                    r = min(1, step / warmup_steps)
    g      = g / (||g|| + c)                                            tangent normalisation (c = 0.1)
    e_b    = mean((F(x_t, t) - F- - g)^2)                               over a sample's D elements
    loss   = mean_b(e_b / exp(w(tau_b)))

``w`` is the paper's learned weighting at its optimum, ``exp(w(tau)) = E[e | tau]``: fvx tracks it per bin of tau by
an EMA carried in the train state (``weight_bins`` bins over ``p_mean +- 4 p_std``, decay ``weight_decay``), where
the paper trains a small network beside the model (docs/design.md, "sCM"). Sampling: ``x0 = f(z, pi/2)`` in one step,
then re-noised to each next level and denoised again: the flow model's few-step re-noising sampler (:func:`samplers`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Annotated, Any, Literal, Mapping

import msgspec
import torch

from fvx.config import Config
from fvx.core import derivatives, flow, random, role
from fvx.core.state import Batch, HeldRole, Program, TrainState
from fvx.training import validation
from fvx_methods.library import flow_map, one_role
from fvx_models.model import Cond, Model, Params, check_shared_data

STUDENT, TEACHER = one_role.STUDENT, "teacher"


# ------------------------------------------------------------------------------------------------- TrigFlow of a model


def trig_velocity(model: Model, params: Params, x_t: torch.Tensor, t: torch.Tensor, cond: Cond) -> torch.Tensor:
    """``F(x_t, t)`` of a flow-matching model (module docstring), ``t [B]`` in radians."""
    cos, sin = flow_map.per_sample(torch.cos(t), x_t), flow_map.per_sample(torch.sin(t), x_t)
    x_s = x_t / (cos + sin)
    s = torch.sin(t) / (torch.sin(t) + torch.cos(t))
    return (cos - sin) * x_s + model.apply(params, x_s, s * flow.NUM_TRAIN_TIMESTEPS, cond) / (cos + sin)


# ---------------------------------------------------------------------------------------------------------- the loss


def bins(tau: torch.Tensor, config: SCM) -> torch.Tensor:
    """Each ``tau``'s bin of the weighting table ``[weight_bins]``."""
    low, high = config.p_mean - 4 * config.p_std, config.p_mean + 4 * config.p_std
    scaled = (tau - low) / (high - low) * config.weight_bins
    return scaled.floor().clamp(0, config.weight_bins - 1).long()


def loss_fn(params: Params, batch: Batch, key: torch.Tensor, *, model: Model, config: SCM, step: torch.Tensor,
            weights: torch.Tensor, velocity: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sCM loss of ``batch`` (latents ``[B, C, T, H, W]``, cond, sample_index ``[B]``) at train ``step``, with the
    carried per-bin mean errors ``weights``; ``velocity(x_t, t, cond) -> dx/dt`` replaces the data's (a teacher's).
    aux: the mean error, and the per-bin sums and counts of the errors (the carry's update)."""
    x0 = model.normalize(batch["latents"].float())
    z, t_keys = flow.per_sample_noise(key, batch["sample_index"], tuple(x0.shape[1:]), x0.device)
    tau = config.p_mean + config.p_std * torch.vmap(lambda k: random.normal(k, ()))(t_keys).to(x0.device)
    t = torch.atan(torch.exp(tau))
    cos, sin, cond = flow_map.per_sample(torch.cos(t), x0), flow_map.per_sample(torch.sin(t), x0), batch["cond"]
    x_t = cos * x0 + sin * z
    with torch.no_grad():
        dxdt = cos * z - sin * x0 if velocity is None else velocity(x_t, t, cond)
        f = functools.partial(trig_velocity, model, params, cond=cond)
        f_minus = f(x_t, t)
        cs = torch.cos(t) * torch.sin(t)
        jvp = derivatives.directional(f, (x_t, t), (flow_map.per_sample(cs, x_t) * dxdt, cs), mode=config.derivative,
                                      step=config.fd_step)
        ramp = torch.clamp(step.float() / config.warmup_steps, max=1.0) if config.warmup_steps else 1.0
        g = -cos ** 2 * (f_minus - dxdt) - ramp * (flow_map.per_sample(cs, x_t) * x_t + jvp)
        g = g / (flow_map.per_sample(g.flatten(1).norm(dim=1), g) + config.tangent_c)
    error = ((trig_velocity(model, params, x_t, t, cond) - f_minus - g) ** 2).flatten(1).mean(1)
    bin_ = bins(tau, config)
    loss = (error / weights.to(error.device)[bin_]).mean()
    one_hot = torch.nn.functional.one_hot(bin_, config.weight_bins).float()
    return loss, {"error": error.mean().detach(), "scm/error_sum": one_hot.T @ error.detach(),
                  "scm/count": one_hot.sum(0)}


def logged(loss: torch.Tensor, aux: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The weighted loss, the mean error, and the bin statistics the carry takes out (``weights_carry``)."""
    return {"loss": loss, **aux}


def weights_carry(config: SCM) -> one_role.Carry:
    """The per-bin mean error: a bin's first draw sets it, later ones blend ``ema <- d ema + (1 - d) mean``; ones
    (weight 1) in bins never drawn."""
    def update(carried: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        drawn = stats["scm/count"] > 0
        mean = stats["scm/error_sum"] / stats["scm/count"].clamp(min=1e-12)
        blended = torch.where(carried["seen"], config.weight_decay * carried["error_ema"]
                              + (1 - config.weight_decay) * mean, mean)
        return {"error_ema": torch.where(drawn, blended, carried["error_ema"]), "seen": carried["seen"] | drawn}
    return one_role.Carry(init=lambda batch: {"error_ema": torch.ones(config.weight_bins),
                                              "seen": torch.zeros(config.weight_bins, dtype=torch.bool)},
                          update=update, metrics=("scm/error_sum", "scm/count"))


def loss_inputs(state: TrainState, frozen: Mapping[str, Params]) -> dict[str, Any]:
    return {"step": state.step, "weights": state.carry["error_ema"]}


# -------------------------------------------------------------------------------------------------------- the build


class SCMRoles(Config):
    """Which of the experiment's models plays each role."""

    student: str = "student"


class SCM(one_role.OneRoleConfig, tag="scm"):
    """Knobs of sCM on data (module docstring), beside the one-role knobs: the time density (``p_mean``, ``p_std``:
    tau = log tan t ~ N), ``warmup_steps`` of the tangent's second term (0: none), ``tangent_c``, the weighting table
    (``weight_bins``, ``weight_decay``), ``derivative`` (``dual``, ``ad``, or ``finite_difference`` with
    ``fd_step``) and ``sample_steps`` with ``sample_shift`` (the validation's step counts and the levels they start
    from). Defaults: the paper's (p_mean -1, p_std 1.4, c 0.1)."""

    roles: SCMRoles = SCMRoles()
    p_mean: float = -1.0
    p_std: Annotated[float, msgspec.Meta(gt=0)] = 1.4
    warmup_steps: Annotated[int, msgspec.Meta(ge=0)] = 100
    tangent_c: Annotated[float, msgspec.Meta(gt=0)] = 0.1
    weight_bins: Annotated[int, msgspec.Meta(ge=1)] = 32
    weight_decay: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.99
    derivative: derivatives.Mode = "dual"
    fd_step: Annotated[float, msgspec.Meta(gt=0)] = 1e-4
    sample_steps: tuple[Annotated[int, msgspec.Meta(ge=1)], ...] = (1, 2, 4)
    sample_shift: Annotated[float, msgspec.Meta(gt=0)] = 3.0

    @property
    def name(self) -> str:
        return "sCM"

    def sampling(self, role_name: str) -> dict | None:
        """How the student is sampled as trained (recorded on export)."""
        if role_name != STUDENT:
            return None
        return {"sampler": "sde (consistency steps: x0 at each level, re-noised to the next)",
                "timesteps": {str(n): flow.to_timestep(flow_map.few_step_sigmas(n, self.sample_shift))[:-1].tolist()
                              for n in self.sample_steps}}

    def check_models(self, models: Mapping[str, Model]) -> None:
        """The student's refusals (:meth:`check_student`, which :meth:`build` calls): the dry run calls it."""
        self.check_student(models)

    def check_student(self, models: Mapping[str, Model]) -> Model:
        check_shared_data(models, data_role=STUDENT)
        model = models[STUDENT]
        derivatives.check_mode(self.derivative, compiled=model.kernels.compile_stats is not None,
                               sharded=model.weights.layout is not None, who="method.derivative",
                               no_forward_ad=model.rules.forward_ad_refusal)
        return model

    def program(self, model: Model, loss: Any, *, total_steps: int, ranks: role.Ranks,
                before_update: role.BeforeUpdate | None, check: Any = None, **more: Any) -> Program:
        return one_role.program(self, model, total_steps=total_steps, ranks=ranks, before_update=before_update,
                                loss=loss, logged=logged,
                                check=check or (lambda batch: one_role.check_data(batch, model, self.grad_accum)),
                                samplers=samplers(model, self), carry=weights_carry(self), **more)

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's program: the student trained by consistency training on the data."""
        model = self.check_student(models)
        return self.program(model, functools.partial(loss_fn, model=model, config=self), total_steps=total_steps,
                            ranks=ranks, before_update=before_update, loss_inputs=loss_inputs)


class SCMDistillRoles(Config):
    """Which of the experiment's models plays each role."""

    student: str = "student"
    teacher: str = "teacher"


class SCMDistill(SCM, tag="scm_distill"):
    """sCM distilled from a frozen teacher: ``dx/dt`` is the teacher's TrigFlow velocity at ``(x_t, t)`` under
    classifier-free guidance ``guidance_scale`` (its unconditional cond ``cfg_uncond``; ``negative_prompt``: the cond
    file ``negative_prompt_path``)."""

    roles: SCMDistillRoles = SCMDistillRoles()
    guidance_scale: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    cfg_uncond: Literal["negative_prompt", "zero", "keep"] = "negative_prompt"
    negative_prompt_path: str | None = None

    @property
    def name(self) -> str:
        return "sCM distillation"

    def held_roles(self) -> tuple[HeldRole, ...]:
        return (*super().held_roles(), HeldRole(TEACHER, trainable=False))

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's program: the student distilled from the frozen teacher's guided velocity."""
        model, teacher = self.check_student(models), models[TEACHER]
        negative = (None if self.negative_prompt_path is None or self.guidance_scale == 1.0
                    else model.load_negative(self.negative_prompt_path, "method.negative_prompt_path"))

        guided = dataclasses.replace(teacher, apply=validation.guided(
            teacher.apply, lambda cond: teacher.uncond(cond, self.cfg_uncond, negative), self.guidance_scale))

        def loss(params: Params, batch: Batch, key: torch.Tensor, *, teacher_params: Params, **carried: Any):
            velocity = functools.partial(trig_velocity, guided, teacher_params)
            return loss_fn(params, batch, key, model=model, config=self, velocity=velocity, **carried)

        def check(batch: Batch) -> None:
            one_role.check_data(batch, model, self.grad_accum)
            if self.guidance_scale != 1.0:
                teacher.uncond(batch["cond"], self.cfg_uncond, negative)  # a negative prompt is there when needed

        def inputs(state: TrainState, frozen: Mapping[str, Params]) -> dict[str, Any]:
            return {**loss_inputs(state, frozen), "teacher_params": frozen[TEACHER]}

        return self.program(model, loss, total_steps=total_steps, ranks=ranks, before_update=before_update,
                            check=check, frozen_roles={TEACHER: teacher}, loss_inputs=inputs)


def samplers(model: Model, config: SCM):
    """Validation of a consistency student: one sampler per entry of ``sample_steps`` (``student_<n>step``, ``_ema``
    when its EMA), unguided. A consistency step at TrigFlow time ``t`` is the flow model's ``x0`` prediction at level
    ``s``, and re-noising to ``t'`` is re-noising to ``s'``, so ``n`` steps are ``flow.sde_sample`` over
    ``few_step_sigmas(n, sample_shift)``."""
    def make(params: Params, is_ema: bool, validation_config: validation.ValidationConfig):
        return [validation.Sampler(f"student_{n}step" + ("_ema" if is_ema else ""), model.apply, params,
                                   flow_map.few_step_sigmas(n, config.sample_shift), "sde")
                for n in config.sample_steps]
    return make

