"""The distribution-matching core of DMD2 and its kin (Self-Forcing): the real and fake scores of a generated sample,
the DMD loss, the critic's flow-matching loss and the step that updates the student and the critic on their cadence,
as pure functions parameterised by a rollout (how the student generates ``x0_gen``) and a small :class:`Score`
config. The student's gradients come through one graph over the rollout (:func:`generator_grads`) or part by part
(:func:`generator_grads_by_parts`: the loss is linear in ``x0_gen`` against a stop-gradient target).

Per sample ``b`` of a batch, with ``x0_gen`` the student's sample and ``g`` the guidance scale::

    t_b      = clamp(shift_timestep(randint[0, 1000), timestep_shift), window)        per sample
    x_t      = (1 - sigma(t_b)) x0_gen + sigma(t_b) eps
    x0_fake  = critic x0(x_t, t; cond)
    x0_real  = teacher x0(x_t, t; uncond) + g (teacher x0(x_t, t; cond) - teacher x0(x_t, t; uncond))
    grad_b   = nan_to_num((x0_fake - x0_real)_b / mean_{C,T,H,W} |x0_gen - x0_real|_b)   per-sample normaliser
    L_gen    = 0.5 mean((x0_gen - sg(x0_gen - grad))^2)       so dL_gen/dx0_gen = grad / numel
    L_critic = mean((v_critic(x_t', t') - (eps' - sg(x0_gen')))^2) on a fresh rollout x0_gen'

as in the DMD2 paper and FastVideo's recipe (one sample per rank, so its per-rank draws and normaliser are per
sample). ``x0(x_t, t) = x_t - sigma(t) v(x_t, t)`` with ``sigma(t)`` the level of the model's training grid
(``training_sigmas(flow_shift)``) whose timestep is nearest ``t``, as FastVideo's schedulers look it up; the model
itself is called at ``t``. Guidance is fvx's ``uncond + g (cond - uncond)`` (design §2); with ``g == 1`` the teacher's
unconditional call is skipped. Draws: a sample's score timestep and noise come from ``fold_in(key', global sample
index)`` (``key'`` a sub-key of the loss's key per draw), so nothing depends on how ranks or micro-batches split the
batch.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Callable, Literal, Mapping, NamedTuple

import msgspec
import torch

from fvx.config import Config
from fvx.core import ema, flow, random, role
from fvx.core.optim_config import AdamWConfig
from fvx.core.state import all_finite, Batch, HeldRole, Metrics, Program, skipped, TrainState
from fvx.training import validation
from fvx_models.model import check_shared_data, Cond, Model, Params

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
Positive = Annotated[float, msgspec.Meta(gt=0)]

Rollout = Callable[[Params, Batch, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]
"""``rollout(student_params, batch, key, with_grad) -> (x0_gen [B, C, T, H, W], the graded timesteps [B])``."""


class Score(NamedTuple):
    """How scores are taken: the models' grid shift, the score timesteps' shift and window ``[min, max]`` (ratios of
    1000, truncated to timesteps as DMD2 does, or rounded with ``round_window`` as streaming long tuning does), the
    teacher's guidance scale and its unconditional cond (``"negative_prompt"``, ``"zero"`` or ``"keep"``), the
    scheduler whose grid the models convert on: FastVideo's ``S_fm`` (``"flow_match"``, the training grid) or
    ``S_sf`` (``"self_forcing"``: its 1000 levels from ``linspace``, Self-Forcing's), and the floor of the DMD
    normaliser (0: none, DMD2's; streaming long tuning's 1e-6)."""

    flow_shift: float
    timestep_shift: float
    min_timestep_ratio: float
    max_timestep_ratio: float
    guidance_scale: float
    cfg_uncond: str
    scheduler: str = "flow_match"
    round_window: bool = False
    normalizer_floor: float = 0.0

    def grid(self, device: torch.device | None = None) -> torch.Tensor:
        if self.scheduler == "self_forcing":
            return flow.self_forcing_sigmas(self.flow_shift, flow.NUM_TRAIN_TIMESTEPS, device=device)
        return flow.training_sigmas(self.flow_shift, device=device)


def denoising_timesteps(steps: tuple[int, ...], warp: bool, grid: torch.Tensor) -> torch.Tensor:
    """The student's step timesteps ``[K]`` fp32: ``steps``, or with ``warp`` the grid's timesteps
    ``cat(1000 grid, [0])[1000 - s]`` (``grid``: the 1000 levels of the models' grid)."""
    if not warp:
        return torch.tensor(steps, dtype=torch.float32)
    table = torch.cat([flow.to_timestep(grid.cpu()), torch.zeros(1)])
    return table[flow.NUM_TRAIN_TIMESTEPS - torch.tensor(steps, dtype=torch.int64)]


def per_sample_normal(key: torch.Tensor, sample_index: torch.Tensor, draw: int, shape: tuple[int, ...],
                      device: torch.device) -> torch.Tensor:
    """Noise ``[B, *shape]``: sample b's draw number ``draw`` is ``normal(fold_in(fold_in(key, draw), index_b))``."""
    keys = random.fold_in(random.fold_in(key, draw), sample_index.to(key.device))
    return random.normal_each(keys, shape, device=device)


def per_sample_randint(key: torch.Tensor, sample_index: torch.Tensor, high: int) -> torch.Tensor:
    """``[B]`` int64: sample b's ``randint[0, high)`` from ``fold_in(key, index_b)``."""
    return random.randint_each(random.fold_in(key, sample_index.to(key.device)), (), 0, high)


def check_score_window(min_ratio: float, max_ratio: float) -> None:
    """A one-line ValueError when ``method.min_timestep_ratio`` is above ``method.max_timestep_ratio``: the clamp of
    the score timesteps would put every draw at the max (torch's clamp), an empty window trained silently. Equal
    ratios are a one-level window, which FastVideo's DMD2 rule ``0 <= min <= max <= 1`` allows."""
    if min_ratio > max_ratio:
        raise ValueError(f"method.min_timestep_ratio = {min_ratio} is above method.max_timestep_ratio = {max_ratio}: "
                         "the score timesteps' window [min, max] is empty (equal values make a one-level window)")


def score_window(score: Score) -> tuple[int, int]:
    """``(int(1000 min_ratio), int(1000 max_ratio))`` (``round`` with ``round_window``), the window score timesteps
    are clamped to."""
    n, to_int = flow.NUM_TRAIN_TIMESTEPS, round if score.round_window else int
    return to_int(score.min_timestep_ratio * n), to_int(score.max_timestep_ratio * n)


def score_timesteps(key: torch.Tensor, sample_index: torch.Tensor, score: Score) -> torch.Tensor:
    """``[B]`` fp32 score timesteps: per sample ``t0 ~ randint[0, 1000)``, shifted by ``timestep_shift``, clamped to
    [0, 1000], then to the window."""
    t0 = per_sample_randint(key, sample_index, flow.NUM_TRAIN_TIMESTEPS).to(torch.float32)
    t = torch.clamp(flow.shift_timestep(t0, score.timestep_shift), 0, flow.NUM_TRAIN_TIMESTEPS)
    lo, hi = score_window(score)
    return torch.clamp(t, lo, hi)


def predict_x0(model: Model, params: Params, x_t: torch.Tensor, t: torch.Tensor, cond: Cond,
               grid: torch.Tensor) -> torch.Tensor:
    """``x_t - sigma(t) v(x_t, t)`` for latents ``[B, C, T, H, W]`` at timesteps ``t [B]``, with ``sigma(t)`` the
    nearest level of ``grid``."""
    v = model.apply(params, x_t, t, cond)
    return flow.x0_from_velocity(x_t, v, flow.nearest_grid_sigma(grid, t))


def noised(x0: torch.Tensor, sample_index: torch.Tensor, key: torch.Tensor, score: Score,
           grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_t, noise, t [B]): score timesteps from ``split(key)[0]``, per-sample noise from ``split(key)[1]``."""
    t_key, noise_key = random.split(key)
    t = score_timesteps(t_key, sample_index, score).to(x0.device)
    noise = per_sample_normal(noise_key, sample_index, 0, tuple(x0.shape[1:]), x0.device)
    return flow.add_noise(x0, noise, flow.nearest_grid_sigma(grid, t)), noise, t


def real_and_fake_x0(critic_params: Params, teacher_params: Params, x0_gen: torch.Tensor, batch: Batch,
                     key: torch.Tensor, *, critic: Model, teacher: Model, score: Score,
                     negative: Cond | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x0_fake, x0_real, t [B])`` of the sample ``x0_gen`` noised at per-sample score timesteps (no grad): the
    critic's x0 and the teacher's guided x0."""
    grid = score.grid(x0_gen.device)
    cond = batch["cond"]
    with torch.no_grad():
        x_t, _, t = noised(x0_gen.detach(), batch["sample_index"], key, score, grid)
        x0_fake = predict_x0(critic, critic_params, x_t, t, cond, grid)
        x0_cond = predict_x0(teacher, teacher_params, x_t, t, cond, grid)
        if score.guidance_scale == 1.0:
            return x0_fake, x0_cond, t
        uncond = teacher.uncond(cond, score.cfg_uncond, negative)
        x0_uncond = predict_x0(teacher, teacher_params, x_t, t, uncond, grid)
        return x0_fake, flow.cfg(x0_cond, x0_uncond, score.guidance_scale), t


def dmd_target(x0_gen: torch.Tensor, x0_fake: torch.Tensor, x0_real: torch.Tensor,
               floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sg(x0_gen - grad), normaliser [B])`` in fp32, each sample's ``grad_b = nan_to_num((x0_fake - x0_real)_b /
    max(mean|x0_gen - x0_real|_b, floor))``: what the DMD loss pulls ``x0_gen`` towards."""
    with torch.no_grad():
        x0_gen = x0_gen.float()
        normalizer = (x0_gen - x0_real.float()).abs().mean(dim=tuple(range(1, x0_gen.dim()))).clamp_min(floor)
        shape = (-1,) + (1,) * (x0_gen.dim() - 1)
        direction = torch.nan_to_num((x0_fake.float() - x0_real.float()) / normalizer.view(shape))
        return x0_gen - direction, normalizer


def dmd_loss(x0_gen: torch.Tensor, x0_fake: torch.Tensor, x0_real: torch.Tensor,
             floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(0.5 mean((x0_gen - target)^2), normaliser [B])`` with :func:`dmd_target`'s target, in fp32, so that ``d loss
    / d x0_gen = (x0_gen - target) / numel = grad / numel`` (up to the rounding of ``x0_gen - (x0_gen - grad)``)."""
    target, normalizer = dmd_target(x0_gen, x0_fake, x0_real, floor)
    return 0.5 * torch.mean((x0_gen.float() - target) ** 2), normalizer


def generator_loss(student_params: Params, batch: Batch, critic_params: Params, teacher_params: Params,
                   key: torch.Tensor, *, rollout: Rollout, critic: Model, teacher: Model, score: Score,
                   negative: Cond | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DMD loss of the student (module docstring), differentiable in ``student_params`` through the rollout's
    graded call only. ``split(key)`` gives the rollout key and the score key. aux (means over the batch):
    ``dmd_normalizer``, ``generator_timestep`` (the rollout's graded timesteps), ``score_timestep``."""
    rollout_key, score_key = random.split(key)
    x0_gen, t_gen = rollout(student_params, batch, rollout_key, True)
    x0_fake, x0_real, t = real_and_fake_x0(critic_params, teacher_params, x0_gen, batch, score_key, critic=critic,
                                           teacher=teacher, score=score, negative=negative)
    loss, normalizer = dmd_loss(x0_gen, x0_fake, x0_real, score.normalizer_floor)
    return loss, {"dmd_normalizer": normalizer.mean(), "generator_timestep": t_gen.float().mean(),
                  "score_timestep": t.mean()}


def critic_loss(critic_params: Params, batch: Batch, student_params: Params, key: torch.Tensor, *, rollout: Rollout,
                critic: Model, score: Score) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's flow-matching loss on a fresh student sample: ``mean((v(x_t, t) - (eps - x0_gen))^2)``. Key
    layout as :func:`generator_loss`; the rollout runs without grad. aux: ``generator_timestep``,
    ``score_timestep`` (means)."""
    rollout_key, score_key = random.split(key)
    with torch.no_grad():
        x0_gen, t_gen = rollout(student_params, batch, rollout_key, False)
    x_t, noise, t = noised(x0_gen, batch["sample_index"], score_key, score, score.grid(x0_gen.device))
    v = critic.apply(critic_params, x_t, t, batch["cond"]).float()
    loss = torch.mean((v - flow.velocity_target(x0_gen, noise)) ** 2)
    return loss, {"generator_timestep": t_gen.float().mean(), "score_timestep": t.mean()}


# --------------------------------------------------------------------------------------------------------- the step


STUDENT, CRITIC, TEACHER = "student", "critic", "teacher"


class Roles(NamedTuple):
    """Each role's model and the trainable roles' optimizers."""

    student: Model
    critic: Model
    teacher: Model
    student_opt: role.RoleOptimizer
    critic_opt: role.RoleOptimizer


GeneratorGrads = Callable[..., tuple[tuple[torch.Tensor, dict], Params]]
"""``generator_grads(student_base, student_params, batch, n, critic_params, teacher_params, key) -> ((loss, aux),
grads)``: the student's DMD loss and its gradients in ``student_params`` over ``n`` micro-batches."""


def update_student(step: int, interval: int) -> bool:
    """Whether step ``step`` (0-based) updates the student: iteration ``step + 1`` is a multiple of ``interval``, or
    always when ``interval <= 0``."""
    return interval <= 0 or (step + 1) % interval == 0


def generator_grads(rollout: Rollout, roles: Roles, score: Score, negative: Cond | None = None) -> GeneratorGrads:
    """The student's gradients of :func:`generator_loss` through one graph per micro-batch (``fvx.core.role.grads``)."""
    def grads(student_base, student_params, batch, n, critic_params, teacher_params, key):
        return role.grads(generator_loss, student_base, student_params, batch, n, critic_params, teacher_params, key,
                          rollout=rollout, critic=roles.critic, teacher=roles.teacher, score=score, negative=negative)
    return grads


Parts = Callable[[Params, Batch, torch.Tensor], Any]
"""``parts(student_params, batch, key) -> rolled``: the rollout without grad; ``rolled.x0`` is the sample ``[B, C, T,
H, W]`` and ``rolled.timesteps`` its graded timesteps ``[B]``, and it keeps what :data:`PartsVJP` needs."""

PartsVJP = Callable[[Params, Params | None, Any, Batch, torch.Tensor], Params]
"""``vjp(trained, base, rolled, batch, cotangent) -> grads``: the gradient in ``trained`` of ``sum(x0 * cotangent)``
through the rollout's graded calls, recomputed from what ``rolled`` kept, one part's graph at a time."""


def generator_grads_by_parts(parts: Parts, vjp: PartsVJP, roles: Roles, score: Score,
                             negative: Cond | None = None) -> GeneratorGrads:
    """The student's gradients of :func:`generator_loss` without a graph over the rollout: roll out without grad,
    take the DMD target of the whole sample, then back-propagate ``d loss / d x0 = (x0 - target) / numel`` through the
    graded calls part by part (``vjp``). Equal to :func:`generator_grads` for a rollout whose other calls run without
    grad. aux as :func:`generator_loss`'s."""
    def value_and_grad(trained, micro, student_base, critic_params, teacher_params, key):
        rollout_key, score_key = random.split(key)
        with torch.no_grad():
            rolled = parts(role.with_trained(student_base, trained), micro, rollout_key)
        x0_fake, x0_real, t = real_and_fake_x0(critic_params, teacher_params, rolled.x0, micro, score_key,
                                               critic=roles.critic, teacher=roles.teacher, score=score,
                                               negative=negative)
        target, normalizer = dmd_target(rolled.x0, x0_fake, x0_real, score.normalizer_floor)
        residual = rolled.x0.float() - target
        grads = vjp(trained, student_base, rolled, micro, residual / residual.numel())
        aux = {"dmd_normalizer": normalizer.mean(), "generator_timestep": rolled.timesteps.float().mean(),
               "score_timestep": t.mean()}
        return (0.5 * torch.mean(residual ** 2), aux), grads

    def grads(student_base, student_params, batch, n, critic_params, teacher_params, key):
        return role.accumulate(value_and_grad, student_params, batch, n, student_base, critic_params,
                               teacher_params, key)
    return grads


def step_(state: TrainState, batch: Batch, *, roles: Roles, frozen: Mapping[str, Params], score: Score,
          rollout: Rollout, interval: int, grad_accum: int, student_grads: GeneratorGrads,
          before: role.BeforeUpdate | None = None) -> tuple[TrainState, Metrics]:
    """One step of a distribution-matching method, donating ``state``: the critic's update every step
    (:func:`critic_loss` on a fresh rollout), the student's (``student_grads``) on its cadence (:func:`update_student`,
    else only its EMA), both from the params before the step; ``split(fold_in(run_key, step))`` gives the generator's
    and the critic's keys. Metrics: ``critic_loss``, ``grad_norm/critic``, ``lr/critic``, ``update_student``; on
    student steps ``generator_loss``, ``dmd_normalizer`` (the per-sample normalisers' mean), ``grad_norm/student``,
    ``lr/student``. Non-finite: nothing applied. ``frozen``: the teacher's params and the student's and critic's bases
    (when they have one)."""
    s, ranks = int(state.step), roles.critic_opt.ranks
    generator_key, critic_key = random.split(random.fold_in(state.key, state.step))
    student, critic = state.roles[STUDENT], state.roles[CRITIC]
    student_base, critic_base, teacher = frozen.get(STUDENT), frozen.get(CRITIC), frozen[TEACHER]
    updates = update_student(s, interval)
    metrics: Metrics = {"update_student": torch.tensor(float(updates))}
    checked = []
    if updates:
        (loss, aux), grads = student_grads(student_base, student.params, batch, grad_accum,
                                           role.with_trained(critic_base, critic.params), teacher, generator_key)
        student_measured = role.measure(roles.student_opt, student, grads)
        metrics.update(generator_loss=ranks.mean(loss), dmd_normalizer=ranks.mean(aux["dmd_normalizer"]),
                       **role.metrics(student_measured, STUDENT))
        checked += [metrics["generator_loss"], student_measured.norm]
    (loss, _), grads = role.grads(critic_loss, critic_base, critic.params, batch, grad_accum,
                                  role.with_trained(student_base, student.params), critic_key, rollout=rollout,
                                  critic=roles.critic, score=score)
    critic_measured = role.measure(roles.critic_opt, critic, grads)
    metrics.update(critic_loss=ranks.mean(loss), **role.metrics(critic_measured, CRITIC))
    return finish_(state, metrics, checked, roles=roles, student_measured=student_measured if updates else None,
                   critic_measured=critic_measured, before=before)


def finish_(state: TrainState, metrics: Metrics, checked: list[torch.Tensor], *, roles: Roles,
            student_measured: role.Measured | None, critic_measured: role.Measured,
            before: role.BeforeUpdate | None) -> tuple[TrainState, Metrics]:
    """The end of a distribution-matching step, donating ``state``: nothing applied when ``checked`` or the critic's
    loss and norm are not finite (:func:`skipped`); else the student's update (only its EMA when
    ``student_measured`` is None) and the critic's, and the step advanced."""
    if not all_finite(*checked, metrics["critic_loss"], critic_measured.norm):
        return skipped(state, metrics)
    s, student, critic = int(state.step), state.roles[STUDENT], state.roles[CRITIC]
    if student_measured is None:
        student = role.ema_(roles.student_opt, student, s)
    else:
        student = role.update_(roles.student_opt, student, student_measured, s, before, STUDENT)
    critic = role.update_(roles.critic_opt, critic, critic_measured, s, before, CRITIC)
    return state._replace(step=state.step + 1, roles={STUDENT: student, CRITIC: critic}), metrics


def role_keys(run_key: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The keys of the student's, the steps', the critic's and the teacher's: ``split(run_key, 4)``."""
    return tuple(random.split(run_key, 4))


def init(run_key: torch.Tensor, roles: Roles) -> TrainState:
    """Step 0: the student's and the critic's initial params with fresh optimizer states (and the student's EMA)."""
    student_key, steps_key, critic_key, _ = role_keys(run_key)
    return TrainState(step=torch.zeros((), dtype=torch.int64), key=steps_key, roles={
        STUDENT: role.init(roles.student_opt, roles.student.weights.initial(student_key)),
        CRITIC: role.init(roles.critic_opt, roles.critic.weights.initial(critic_key))})


def frozen_params(run_key: torch.Tensor, roles: Roles) -> dict[str, Params]:
    """The teacher's params and the trained roles' bases, all from the teacher's key: one copy per distinct base."""
    return role.frozen_params(role_keys(run_key)[3], {TEACHER: (roles.teacher, True), STUDENT: (roles.student, False),
                                                      CRITIC: (roles.critic, False)})


def program(config: Any, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks,
            before_update: role.BeforeUpdate | None, step_: Callable[..., Any], check: Callable[..., None],
            validate: Callable[..., Any]) -> Program:
    """The loop's Program of a distribution-matching method for the role -> model mapping and a ``total_steps`` run.
    ``config`` has ``optim``, ``critic_optim``, ``ema_decay``, ``ema_start_step`` and ``negative_prompt_path``; the
    method's ``step_(state, batch, *, roles, config, frozen, negative, before)``, ``check(batch, student, config,
    negative)`` and ``validate(state, validation_config, *, roles, config, frozen, negative)``. Latent spaces, cond
    and the negative-prompt file are checked now, so bad input fails before any weights load; on a mesh every role's
    params are local shards (the teacher's without optimizer state) and norms are global per role."""
    config.check_models(models)
    negative = (None if config.negative_prompt_path is None
                else models[STUDENT].load_negative(config.negative_prompt_path, "method.negative_prompt_path"))
    roles = Roles(models[STUDENT], models[CRITIC], models[TEACHER],
                  config.optim.role(total_steps, ranks, ema_decay=config.ema_decay,
                                    ema_start_step=config.ema_start_step),
                  config.critic_optim.role(total_steps, ranks))
    return Program(
        model=roles.student,
        init=lambda run_key: init(run_key, roles),
        frozen=lambda run_key: frozen_params(run_key, roles),
        step_=lambda state, frozen, batch: step_(state, batch, roles=roles, config=config, frozen=frozen,
                                                 negative=negative, before=before_update),
        check=lambda batch: check(batch, roles.student, config, negative),
        validate=lambda state, frozen, cfg: validate(state, cfg, roles=roles, config=config, frozen=frozen,
                                                     negative=negative),
    )


def held_roles(ema: bool) -> tuple[HeldRole, ...]:
    """What a distribution-matching run holds while it trains (the dry run's rows): the student (and its EMA when
    ``ema``) and the critic trainable, the teacher frozen."""
    return (HeldRole(STUDENT, trainable=True, ema=ema), HeldRole(CRITIC, trainable=True),
            HeldRole(TEACHER, trainable=False))


def sample_shape(batch: Batch, config: DistributionMatchingConfig) -> tuple[int, ...]:
    """``(C, T, H, W)`` of the student's samples: the batch latents' (only their shape is used) or ``latent_shape``."""
    if "latents" in batch:
        return tuple(batch["latents"].shape[1:])
    if config.latent_shape is None:
        raise ValueError("the batch has no latents, so simulate needs method.latent_shape = [C, T, H, W]")
    return tuple(config.latent_shape)


def check_batch(batch: Batch, model: Model, config: DistributionMatchingConfig, negative: Cond | None = None) -> None:
    """A ValueError when ``batch`` cannot feed a distribution-matching method (once, before the first step):
    latents the student cannot take, text_only data without ``latent_shape`` (or with ``data_latent``), a
    ``grad_accum`` that does not divide the batch, guidance without the unconditional cond it needs."""
    if "latents" in batch:
        model.check_latents(tuple(batch["latents"].shape), where="batch latents")
    elif config.rollout_mode == "data_latent":
        raise ValueError("rollout_mode='data_latent' noises the data latents, but the batch has none "
                         "(data.kind='text_only'?); use method.rollout_mode=simulate for text-only data")
    elif config.latent_shape is None:
        raise ValueError("the batch has no latents (text_only data), so simulate needs method.latent_shape "
                         "= [C, T, H, W] for the student's samples")
    else:
        model.check_latents((1, *config.latent_shape), where="method.latent_shape")
    if len(batch["sample_index"]) % config.grad_accum:
        raise ValueError(f"method.grad_accum = {config.grad_accum} does not divide a rank's batch of "
                         f"{len(batch['sample_index'])} samples")
    if config.guidance_scale != 1.0:
        model.uncond(batch["cond"], config.cfg_uncond, negative)  # a negative prompt is there when needed


def teacher_sampler(roles: Roles, teacher_params: Params, config: DistributionMatchingConfig,
                    validation_config: validation.ValidationConfig,
                    negative: Cond | None = None) -> validation.Sampler:
    """The teacher as validation samples it beside the student: guided as the DMD loss guides it, on the
    validation's many-step ODE schedule; frozen, so sampled at the first validation of a launch only (``fixed``)."""
    def uncond(cond: Cond) -> Cond:
        return roles.teacher.uncond(cond, config.cfg_uncond, negative)

    guided = validation.guided(roles.teacher.apply, uncond, config.guidance_scale)
    sigmas = validation.schedule_sigmas(validation_config, roles.teacher)
    return validation.Sampler("teacher", guided, teacher_params, sigmas, "ode", fixed=True,
                              draw=validation.many_step_draw(validation_config, guided))


# ------------------------------------------------------------------------------------------------------- the config


class DistributionMatchingConfig(Config):
    """The knobs of FastVideo's DMD2 that its distribution-matching kin share, flat as in its YAML (spec §2.4).

    rollout_mode: ``simulate`` (from noise; the batch latents only give the shape, else ``latent_shape`` does, so
        text_only data works) or ``data_latent`` (the data latents noised to the exit step; needs latents).
    denoising_steps: the student's schedule, timesteps in [0, 1000], strictly descending; ``warp_denoising_step``
        maps each through the models' grid (:func:`denoising_timesteps`).
    generator_update_interval: the student updates on iterations ``step + 1`` divisible by it (``<= 0``: always).
    guidance_scale: the teacher's CFG ``g``, fvx's ``uncond + g (cond - uncond)`` (FastVideo's
        ``real_score_guidance_scale``); ``cfg_uncond`` its unconditional cond (``negative_prompt``: the cond file
        ``negative_prompt_path`` of the student's family, read at build; ``zero``; ``keep``).
    flow_shift: the shift of the models' grid.
    optim / critic_optim: each trainable role's AdamW and schedule; grad_accum: micro-batches per step.
    latent_shape: ``(C, T, H, W)`` of the samples when the batch has no latents.
    ema_decay / ema_start_step: the student's EMA (None or 0: none); validate_teacher: also sample the teacher.
    """

    rollout_mode: Literal["simulate", "data_latent"] = "simulate"
    denoising_steps: tuple[int, ...] = (1000, 750, 500, 250)
    warp_denoising_step: bool = False
    generator_update_interval: int = 1
    guidance_scale: float = 1.0
    flow_shift: Positive = 3.0
    optim: AdamWConfig = AdamWConfig(lr=2e-6, betas=(0.0, 0.999))
    critic_optim: AdamWConfig = AdamWConfig(lr=8e-6, betas=(0.0, 0.999))
    grad_accum: Annotated[int, msgspec.Meta(ge=1)] = 1
    cfg_uncond: Literal["negative_prompt", "zero", "keep"] = "negative_prompt"
    negative_prompt_path: str | None = None
    latent_shape: tuple[PositiveInt, PositiveInt, PositiveInt, PositiveInt] | None = None
    ema_decay: float | None = None
    ema_start_step: Annotated[int, msgspec.Meta(ge=0)] = 0
    validate_teacher: bool = False

    def __post_init__(self) -> None:
        steps = self.denoising_steps
        if not steps or any(not 0 <= s <= flow.NUM_TRAIN_TIMESTEPS for s in steps) \
                or any(a <= b for a, b in zip(steps, steps[1:])):
            raise ValueError(f"method.denoising_steps must be strictly descending timesteps in [0, "
                             f"{flow.NUM_TRAIN_TIMESTEPS}], e.g. [1000, 750, 500, 250]; got {list(steps)}")
        if not math.isfinite(self.guidance_scale):
            raise ValueError(f"method.guidance_scale must be finite, got {self.guidance_scale}")
        if not self.critic_optim.lr > 0:
            raise ValueError(f"the critic needs method.critic_optim.lr > 0 (FastVideo's fake_score_learning_rate), "
                             f"got {self.critic_optim.lr}")
        if self.ema_decay is not None:
            ema.check_decay(self.ema_decay)

    def held_roles(self) -> tuple[HeldRole, ...]:
        """What the run holds while it trains (the dry run's rows): the student (and its EMA) and the critic
        trainable, the teacher frozen."""
        return held_roles(bool(self.ema_decay))

    def check_models(self, models: Mapping[str, Model]) -> None:
        """The refusals of the roles' models from their skeletons, before any file is read (:func:`program` and the
        dry run, ``fvx.training.config_checks.check_models``): the roles share the data's latent space; a method adds
        its own."""
        check_shared_data(models, data_role=STUDENT)
