"""Causal consistency distillation (FastVideo's CausalConsistencyDistillationMethod, spec §2.10) as pure functions:
a block-causal student learns to give, from any level of an ``N``-level grid, the clean video its own EMA gives one
guided teacher Euler step later, with the clean history as context.

On the grid ``sigma_0 = 1 > ... > sigma_{N-1} > 0`` (``fvx.core.flow.self_forcing_sigmas(flow_shift, N)``, FastVideo's
``SelfForcingFlowMatchScheduler``; timesteps ``t_j = 1000 sigma_j``), per sample ``b`` of the global batch with ``x0``
its normalised latents ``[C, T, H, W]``:

    j       ~ randint[0, N - 1)                                    from fold_in(step_key, index_b), as its noise eps
    x_t     = (1 - sigma_j) x0 + sigma_j eps
    v       = v_u + g (v_c - v_u)                                   the frozen teacher at t_j, no grad
    x_t'    = x_t - ((t_j - t_{j+1}) / 1000) v                      one Euler step of the guided teacher
    x0_s    = x_t - sigma_j v_student(x_t, t_j)                     the student, differentiated
    x0_ema  = x_t' - sigma_{j+1} v_ema(x_t', t_{j+1})               the student's EMA, no grad
    loss    = mean((x0_s - x0_ema)^2)                               in fp32, over every element

Every forward is teacher-forced: noisy block ``k`` attends to the clean blocks ``< k`` of ``x0``
(``Model.causal.apply_teacher_forced``, one timestep per latent frame ``[B, T]``, all of a sample's equal), so the
student and its EMA must be block-causal with global attention; a block-causal teacher is called the same way (as in
FastVideo's recipe, where all three roles are causal Wan from one checkpoint), a bidirectional one plainly on ``x_t``
at ``t_j`` (it has no clean-history input). Guidance is fvx's ``uncond + g (cond - uncond)``, FastVideo's form here
too; with ``g == 1`` the unconditional call is skipped.

The EMA target is the student's EMA (``state.roles["student"].ema``, passed to the loss explicitly): it starts as the
student's initial weights (or those of the model ``roles.ema`` names, of the student's architecture) and blends
``ema <- d ema + (1 - d) params`` after every update from ``ema_start_step`` on (``ema_start="blend"``): FastVideo
blends after the optimizer step of iteration ``it >= ema_start_step``, its 1-based iteration, which is fvx's 0-based
``step + 1`` (``fvx.core.role.RoleOptimizer``). Deviation: FastVideo draws one ``j`` per rank's batch
(``causal_cd.py:110``, ``randint(0, N - 1, (1,))`` on its CUDA generator); fvx draws one per sample from its global
index (each sample's ``j`` uniform either way, so the same expected loss; a batch mixing levels has lower variance, and
the draws do not depend on how ranks or micro-batches split the batch). Validation samples the student (its EMA)
few-step on ``self_forcing_sigmas(flow_shift, sampling_steps)``, block by block on its KV cache, unguided.
"""
from __future__ import annotations

import functools
import math
from typing import Annotated, Literal, Mapping

import msgspec
import torch

from fvx.config import Config
from fvx.core import ema, flow, random, role
from fvx.core.state import Batch, HeldRole, Program, TrainState
from fvx.training import validation
from fvx_methods.library import one_role
from fvx_models import streaming
from fvx_models.model import check_shared_data, Cond, Model, Params

STUDENT, TEACHER, EMA = one_role.STUDENT, "teacher", "ema"
SAMPLERS = {"sde": "sde (x0, re-noised)", "ode": "ode (Euler)"}

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
Positive = Annotated[float, msgspec.Meta(gt=0)]


# ---------------------------------------------------------------------------------------------------------- the loss


def draws(key: torch.Tensor, sample_index: torch.Tensor, shape: tuple[int, ...], levels: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eps [B, *shape], j [B])``: sample b's noise and grid index ``randint[0, levels - 1)`` from
    ``fold_in(key, index_b)`` (``fvx.core.flow.per_sample_noise``)."""
    noise, index_keys = flow.per_sample_noise(key, sample_index, shape, device)
    return noise, random.randint_each(index_keys, (), 0, levels - 1).to(device)


def per_frame(t: torch.Tensor, frames: int) -> torch.Tensor:
    """One timestep per latent frame ``[B, T]`` from one per sample ``[B]``."""
    return t[:, None].expand(-1, frames)


def velocity(model: Model, params: Params, x_t: torch.Tensor, t: torch.Tensor, cond: Cond,
             clean: torch.Tensor) -> torch.Tensor:
    """``model``'s velocity ``[B, C, T, H, W]`` fp32 at per-frame timesteps ``t [B, T]``: teacher-forced on the clean
    history ``clean`` for a block-causal model, plainly at ``t[:, 0]`` for a bidirectional one."""
    if model.causal is None:
        return model.apply(params, x_t, t[:, 0], cond).float()
    return model.causal.apply_teacher_forced(params, x_t, t, cond, clean=clean).float()


def teacher_velocity(params: Params, x_t: torch.Tensor, t: torch.Tensor, cond: Cond, clean: torch.Tensor, *,
                     teacher: Model, config: CausalCD, negative: Cond | None = None) -> torch.Tensor:
    """The teacher's guided velocity ``v_u + g (v_c - v_u)`` (only ``v_c`` when ``g == 1``)."""
    v_cond = velocity(teacher, params, x_t, t, cond, clean)
    if config.guidance_scale == 1.0:
        return v_cond
    uncond = teacher.uncond(cond, config.cfg_uncond, negative)
    return flow.cfg(v_cond, velocity(teacher, params, x_t, t, uncond, clean), config.guidance_scale)


def euler_step(x_t: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor) -> torch.Tensor:
    """``x_t - ((t - t_next) / 1000) v`` with per-frame timesteps ``t, t_next [B, T]``: one Euler step of the ODE
    from ``t`` to ``t_next`` on the timestep scale (FastVideo's ``dt``)."""
    dt = ((t - t_next) / flow.NUM_TRAIN_TIMESTEPS)[:, None, :, None, None]
    return x_t - dt * v


def loss_fn(params: Params, batch: Batch, key: torch.Tensor, *, ema_params: Params, teacher_params: Params,
            student: Model, teacher: Model, config: CausalCD,
            negative: Cond | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The causal CD loss (module docstring) of ``batch`` (latents ``[B, C, T, H, W]``, whole blocks; the cond;
    sample_index ``[B]``) under the step key ``key``, differentiable in the student's ``params`` only
    (``ema_params``: the student's EMA with its base; ``teacher_params``: the frozen teacher's). aux: the mean drawn
    ``sigma_j``."""
    x0 = student.normalize(batch["latents"].float())
    noise, j = draws(key, batch["sample_index"], tuple(x0.shape[1:]), config.discrete_steps, x0.device)
    sigmas = flow.self_forcing_sigmas(config.flow_shift, config.discrete_steps, device=x0.device)
    timesteps, frames, cond = flow.to_timestep(sigmas), x0.shape[2], batch["cond"]
    t, t_next = per_frame(timesteps[j], frames), per_frame(timesteps[j + 1], frames)
    x_t = flow.add_noise(x0, noise, sigmas[j])
    with torch.no_grad():
        v = teacher_velocity(teacher_params, x_t, t, cond, x0, teacher=teacher, config=config, negative=negative)
        x_next = euler_step(x_t, v, t, t_next)
        x0_ema = flow.x0_from_velocity(x_next, velocity(student, ema_params, x_next, t_next, cond, x0), sigmas[j + 1])
    x0_student = flow.x0_from_velocity(x_t, velocity(student, params, x_t, t, cond, x0), sigmas[j])
    loss = torch.mean((x0_student.float() - x0_ema.float()) ** 2)
    return loss, {"sigma": sigmas[j].mean()}


def loss_inputs(state: TrainState, frozen: Mapping[str, Params]) -> dict[str, Params]:
    """What the loss reads besides the student's params: the frozen teacher's and the student's EMA (with its base)."""
    return {"teacher_params": frozen[TEACHER],
            "ema_params": role.with_trained(frozen.get(STUDENT), state.roles[STUDENT].ema)}


# -------------------------------------------------------------------------------------------------------- the build


class CausalCDRoles(Config):
    """Which of the experiment's models plays each role. The EMA lives in the student's state and runs on the
    student's model; ``ema`` names the model whose initial weights it starts from: the student's (default), or
    another of the student's family with the same trained params (FastVideo's ``ema`` role, loaded from the
    student's checkpoint)."""

    student: str = "student"
    teacher: str = "teacher"
    ema: str = "student"


class CausalCD(one_role.OneRoleConfig, tag="causal_cd"):
    """Every knob of FastVideo's causal consistency distillation (spec §2.10), with fvx's names.

    discrete_steps: the grid's ``N`` levels (FastVideo's ``discrete_cd_N``, >= 2); flow_shift: its shift
        (FastVideo's ``pipeline.flow_shift``, 5 when unset).
    guidance_scale: the teacher's CFG ``g``; ``cfg_uncond`` its unconditional cond (``negative_prompt``: the cond file
        ``negative_prompt_path``, FastVideo's negative prompt; ``zero``; ``keep``).
    ema_decay / ema_start_step / ema_start: the EMA target's decay ``d`` (in (0, 1]: causal CD needs its EMA) and
        start, by default FastVideo's: blend from the initial weights after every update ``step + 1 >= 200``.
    sampling_steps / sampler: how validation samples the student (few-step on the ``sampling_steps``-level grid at
        ``flow_shift``; ``sde`` re-noises its x0 at each level, ``ode`` takes Euler steps).
    and the one-role knobs (optimizer, gradient accumulation: ``fvx_methods.library.one_role.OneRoleConfig``).
    """

    roles: CausalCDRoles = CausalCDRoles()
    discrete_steps: Annotated[int, msgspec.Meta(ge=2)] = 48
    guidance_scale: float = 3.0
    flow_shift: Positive = 5.0
    cfg_uncond: Literal["negative_prompt", "zero", "keep"] = "negative_prompt"
    negative_prompt_path: str | None = None
    ema_decay: float | None = 0.99
    ema_start_step: Annotated[int, msgspec.Meta(ge=0)] = 200
    ema_start: ema.Start = "blend"
    sampling_steps: PositiveInt = 4
    sampler: Literal["sde", "ode"] = "sde"

    def __post_init__(self) -> None:
        n = self.discrete_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(f"method.discrete_steps (FastVideo's discrete_cd_N) must be an int >= 2, got {n!r}")
        if not math.isfinite(self.guidance_scale):
            raise ValueError(f"method.guidance_scale must be finite, got {self.guidance_scale}")
        if self.guidance_scale != 1.0 and self.cfg_uncond == "negative_prompt" and self.negative_prompt_path is None:
            raise ValueError("method.guidance_scale != 1 with cfg_uncond='negative_prompt' needs "
                             "method.negative_prompt_path (a cond file); or use cfg_uncond='zero'")
        if not self.ema_decay:
            raise ValueError(f"method.ema_decay must lie in (0, 1]: the student's EMA is causal CD's target, got "
                             f"{self.ema_decay!r} (None or 0 keeps no EMA)")
        super().__post_init__()

    @property
    def name(self) -> str:
        return "causal CD"

    def held_roles(self) -> tuple[HeldRole, ...]:
        """What the run holds while it trains (the dry run's rows): the student with its EMA, and the frozen
        teacher."""
        return (HeldRole(STUDENT, trainable=True, ema=True), HeldRole(TEACHER, trainable=False))

    def sampling(self, role_name: str) -> dict | None:
        """How the student is sampled as trained (recorded on export): few-step on its grid, block by block."""
        if role_name != STUDENT:
            return None
        sigmas = flow.self_forcing_sigmas(self.flow_shift, self.sampling_steps)
        return {"timesteps": flow.to_timestep(sigmas).tolist(), "sigmas": sigmas.tolist(),
                "sampler": SAMPLERS[self.sampler] + ", block by block on a KV cache"}

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's program: the student trains (its EMA in its state), the teacher is frozen (made once by the
        loop, in its ``frozen_dtype``). Roles, latent spaces, cond and the negative-prompt file are checked now,
        before any weight loads."""
        self.check_models(models)
        student, teacher, ema_model = models[STUDENT], models[TEACHER], models[EMA]
        negative = (None if self.negative_prompt_path is None
                    else student.load_negative(self.negative_prompt_path, "method.negative_prompt_path"))
        loss = functools.partial(loss_fn, student=student, teacher=teacher, config=self, negative=negative)
        return one_role.program(self, student, total_steps=total_steps, ranks=ranks, before_update=before_update,
                                loss=loss, logged=lambda loss, aux: {"causal_cd_loss": loss},
                                check=lambda batch: check_batch(batch, student, teacher, self, negative),
                                samplers=lambda params, is_ema, _: samplers(params, is_ema, student, self),
                                frozen_roles={TEACHER: teacher}, loss_inputs=loss_inputs, ema_model=ema_model)


    def check_models(self, models: Mapping[str, Model]) -> None:
        """The roles' refusals from their skeletons (shared latent space, :func:`check_roles`): :meth:`build` and the
        dry run call it."""
        check_shared_data(models, data_role=STUDENT)
        check_roles(models[STUDENT], models[TEACHER], models[EMA], self)

    def check_latent_frames(self, models: Mapping[str, Model], frames: int) -> None:
        """Samples of ``frames`` latent frames that are not whole blocks of a causal role (:func:`check_blocks`: the
        batch check's, and the dry run's on the samples it estimates)."""
        check_blocks(frames, models[STUDENT], models[TEACHER], self)


def check_roles(student: Model, teacher: Model, ema_model: Model, config: CausalCD) -> None:
    """A one-line ValueError unless the student is block-causal with global attention, a block-causal teacher
    attends globally too, and the EMA's model is the student's architecture."""
    where = f"models.{config.roles.student} ({student.name})"
    if student.causal is None:
        raise ValueError(f"causal CD trains a block-causal student, but {where} is not causal (model.causal is None); "
                         "use a causal family's config")
    for name, model in ((config.roles.student, student), (config.roles.teacher, teacher)):
        if model.causal is not None and model.causal.window != -1:
            raise ValueError(f"causal CD teacher-forces every forward, which needs global attention, but "
                             f"models.{name} ({model.name}) attends to a window of {model.causal.window} frames "
                             "(local_attn_size -1 for all)")
    if ema_model is not student:
        check_same_architecture(student, ema_model, config)


def trained_shapes(model: Model) -> dict[str, tuple[int, ...]]:
    """The shapes of the params a role of ``model`` trains, from its meta skeleton (no weights)."""
    return model.memory_spec().part(model.weights.trained_names)


def check_same_architecture(student: Model, ema_model: Model, config: CausalCD) -> None:
    """A ValueError unless ``ema_model`` is of the student's family with the same trained params (names and shapes):
    its initial params start the EMA the student's model runs."""
    family = student.name.partition(":")[0]
    if ema_model.name.partition(":")[0] != family:
        raise ValueError(f"method.roles.ema = {config.roles.ema!r} is a {ema_model.name} model, but the EMA lives in "
                         f"the student's state and runs on its model ({student.name}); name the student's model or "
                         f"another {family} model of its architecture")
    mine, theirs = trained_shapes(student), trained_shapes(ema_model)
    if mine != theirs:
        name = next(n for n in sorted(set(mine) | set(theirs)) if mine.get(n) != theirs.get(n))
        raise ValueError(f"method.roles.ema = {config.roles.ema!r} ({ema_model.name}) trains other params than the "
                         f"student ({student.name}): {name} is {theirs.get(name, 'absent')} there and "
                         f"{mine.get(name, 'absent')} in the student; the EMA starts from its weights, so it must "
                         "be the student's architecture")


def check_batch(batch: Batch, student: Model, teacher: Model, config: CausalCD, negative: Cond | None = None) -> None:
    """A one-line ValueError when the batch's latents do not fit the student, are not whole blocks of the student's
    (and a causal teacher's), ``grad_accum`` does not divide it, or guidance has no unconditional cond (once, before
    the first step)."""
    one_role.check_latents(batch, student)
    check_blocks(batch["latents"].shape[2], student, teacher, config)
    one_role.check_grad_accum(batch, config.grad_accum)
    if config.guidance_scale != 1.0:
        teacher.uncond(batch["cond"], config.cfg_uncond, negative)  # a negative prompt is there when needed


def check_blocks(frames: int, student: Model, teacher: Model, config: CausalCD) -> None:
    """A one-line ValueError when ``frames`` latent frames are not whole blocks of the student's (or a causal
    teacher's)."""
    for name, model in ((config.roles.student, student), (config.roles.teacher, teacher)):
        if model.causal is not None and frames % model.causal.frames_per_block:
            size = model.causal.frames_per_block
            raise ValueError(f"batch latents have {frames} latent frames, not whole blocks of models.{name}'s "
                             f"num_frames_per_block = {size}: teacher forcing needs whole blocks (set "
                             f"data.num_latent_t to a multiple of {size})")


def samplers(params: Params, is_ema: bool, model: Model, config: CausalCD) -> list[validation.Sampler]:
    """The student (``params``: its EMA) sampled few-step on ``self_forcing_sigmas(flow_shift, sampling_steps)``
    with ``config.sampler``, unguided, block by block on its KV cache (``fvx_models.streaming.draw``)."""
    sigmas = flow.self_forcing_sigmas(config.flow_shift, config.sampling_steps)
    return [validation.Sampler("student_ema" if is_ema else "student", model.apply, params, sigmas, config.sampler,
                               draw=streaming.draw(model.causal, sigmas, sampler=config.sampler))]
