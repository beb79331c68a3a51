"""DMD2 distribution-matching distillation (FastVideo's DMD2Method, spec §2.4) as pure functions.

Three roles, each a :class:`fvx_models.model.Model` of any family (``roles`` names the experiment's model of each):
the **student** (trainable, a few-step generator), the **critic** (trainable, the "fake score": a flow-matching model
of the student's samples) and the **teacher** (frozen, the "real score"). A teacher of another size than the
student (a 14B teacher for a 1.3B student) is a model of its own; all three must denoise the same latent space from
the same conditioning (checked at build, from the configs). Per step, with ``k`` the rollout index, ``t`` a score timestep and
``g = guidance_scale``::

    x0_gen   = student rollout, gradient only through its last model call           (student_rollout)
    x_t      = (1 - sigma(t)) x0_gen + sigma(t) eps
    x0_fake  = critic x0(x_t, t; cond)
    x0_real  = teacher x0(x_t, t; uncond) + g (teacher x0(x_t, t; cond) - teacher x0(x_t, t; uncond))
    grad     = nan_to_num((x0_fake - x0_real) / mean|x0_gen - x0_real|)              (mean over all elements)
    L_gen    = 0.5 mean((x0_gen - sg(x0_gen - grad))^2)      so dL_gen/dx0_gen = grad / numel   (generator_loss)
    L_critic = mean((v_critic(x_t', t') - (eps' - sg(x0_gen')))^2) on a fresh rollout x0_gen'   (critic_loss)

Guidance: fvx writes classifier-free guidance ``uncond + g (cond - uncond)`` (design §2; ``fvx.flow.cfg``), with the
knob ``guidance_scale`` = FastVideo's ``real_score_guidance_scale``. FastVideo's legacy trainer, Self-Forcing and
CausVid write ``cond + w (cond - uncond)``; their ``w`` is ``g - 1`` here (a legacy ``w = 3.5`` is ``g = 4.5``).

Timesteps: ``x0(x_t, t) = x_t - sigma(t) v(x_t, t)`` and ``add_noise`` use ``sigma(t)``, the level on the model's
training grid (``flow.training_sigmas(flow_shift)``) whose timestep is nearest ``t``, as FastVideo's schedulers do;
the model itself is called at ``t``. Score timesteps ``t = clamp(shift_timestep(randint[0, 1000), timestep_shift))``
are clamped to ``[int(1000 min_timestep_ratio), int(1000 max_timestep_ratio)]``.

Keys: the step key is ``fold_in(run_key, step)``, split into a generator key and a critic key, so the two rollouts
draw independently. Within a loss, batch-level draws (rollout index ``k``, score timestep ``t``) come from the key
alone and are identical on every rank; per-sample noise comes from ``fold_in(key', global sample index)`` (with
``key'`` a sub-key of the loss's key per draw), so it does not depend on how ranks split the batch.

Cadence (plain Python on the integer step): with FastVideo's iteration ``i = step + 1``, the critic updates every
step and the student iff ``i % generator_update_interval == 0`` (every step when the interval is ``<= 0``); both
losses of a step see the params from before the step. The student's LR schedule advances on its own updates only.
EMA of the student (``ema_decay``): left alone until ``i == max(ema_start_step, 1)``, re-initialised from the
student there, then ``shadow <- d shadow + (1 - d) student`` at the end of every later step, update step or not.

Roles and sources. ``build(models, total_steps=...)`` receives each role's model. Each role starts from its model's
``initial_params``: the model config's ``path`` when it names a folder, else random params from the role's own key
(``split(run_key, 4)``: student, steps, critic, teacher). The teacher is frozen: the loop makes its params once
(``Program.frozen``) and passes them to every step; it is not in the state, gets no optimizer, is never saved, and is
only ever called under ``torch.no_grad``, so FastVideo's "teacher must be non-trainable" and "all roles required"
errors cannot arise here. It is stored in its model config's ``frozen_dtype`` (bf16 but the params the family keeps
in fp32; sharded on a mesh straight into bf16 shards) and computes in its ``compute_dtype``, so under fp32 compute a
bf16 teacher is the fp32 computation of its bf16-rounded weights.

Deviations from FastVideo: ``simulate`` runs only the ``k`` no-grad transitions that reach step ``k`` (FastVideo
runs all ``K - 1``; with counter-based keys the result is the same, at fewer model calls); ``data_latent`` honours
``with_grad`` (FastVideo ignores it, spec §7.5); with ``guidance_scale == 1`` the teacher's unconditional call is
skipped (``uncond + 1 (cond - uncond) = cond`` up to rounding); x0 is computed in fp32, not fp64; the rollout mode
has no aliases (``sim``, ``data``, ...); and knobs FastVideo requires (rollout mode, steps, the critic's optimizer)
default to dmd2_t2v.yaml's values here, as does the student's optimizer.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Callable, Literal, Mapping, NamedTuple

import msgspec
import torch

from fvx import ema, flow, grad, optim, random, sharding, tree, validation
from fvx.config import Config
from fvx.optim_config import AdamWConfig
from fvx.state import Batch, Metrics, Program, RoleState, TrainState, all_finite, skipped
from fvx_models.model import Cond, Model, Params, check_shared_data

STUDENT, CRITIC, TEACHER = "student", "critic", "teacher"

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
Positive = Annotated[float, msgspec.Meta(gt=0)]


class DMD2Roles(Config):
    """Which of the experiment's models plays each role (the critic is a copy of the student's model by default)."""

    student: str = "student"
    critic: str = "student"
    teacher: str = "teacher"


class DMD2(Config, tag="dmd2"):
    """Every knob of FastVideo's DMD2 (spec §2.4); see the module docstring for the algorithm and conventions.

    rollout_mode: ``simulate`` (the student denoises pure noise through ``denoising_steps``; the batch latents, if
        any, only give the shape, else ``latent_shape`` does: text_only data works) or ``data_latent`` (the data
        latents are noised to a random step and denoised once; needs latents).
    denoising_steps: the student's few-step schedule, timesteps in [0, 1000], strictly descending.
    warp_denoising_step: map each step ``s`` to the training grid,
        ``cat(1000 training_sigmas(flow_shift), [0])[1000 - s]``.
    generator_update_interval: the student updates on iterations ``i = step + 1`` divisible by it (``<= 0``: always).
    guidance_scale: the teacher's CFG scale ``g`` in ``uncond + g (cond - uncond)`` (legacy ``w`` = ``g - 1``).
    min_timestep_ratio / max_timestep_ratio: the score-timestep window, ``0 <= min <= max <= 1``.
    timestep_shift: the shift of score timesteps (FastVideo's ``pipeline.flow_shift``; 8 in ``dmd2_t2v.yaml``).
    flow_shift: the models' training-grid shift (FastVideo's ``models.<role>.flow_shift``, Wan 3.0), used to look
        timesteps up as levels and by ``warp_denoising_step``.
    optim / critic_optim: the student's and the critic's AdamW, each with its own LR, betas and schedule; the
        critic's LR must be > 0.
    cfg_uncond: the teacher's unconditional cond: ``negative_prompt`` (the cond file ``negative_prompt_path``),
        ``zero`` (the family's zero cond: zero text and mask) or ``keep`` (the conditional cond).
    negative_prompt_path: a cond file of the student's family (``fvx_models.cond``: for Wan a safetensors file with
        ``"text"`` ``[L, D]`` or ``[1, L, D]`` and optionally ``"text_mask"``), read and checked when the method is
        built, before any weights load. No text encoder runs in training.
    latent_shape: ``(C, T, H, W)`` of the student's samples when the batch has no latents (simulate on text_only data).
    ema_decay / ema_start_step: the student's EMA (None or 0 turns it off); starts at iteration ``ema_start_step``.
    validate_teacher: also sample the teacher (guided, many-step ODE) at validations, beside the few-step student.
    roles: which of the experiment's models plays the student, the critic and the teacher.
    """

    roles: DMD2Roles = DMD2Roles()
    rollout_mode: Literal["simulate", "data_latent"] = "simulate"
    denoising_steps: tuple[int, ...] = (1000, 750, 500, 250)
    warp_denoising_step: bool = False
    generator_update_interval: int = 1
    guidance_scale: float = 1.0
    min_timestep_ratio: float = 0.0
    max_timestep_ratio: float = 1.0
    timestep_shift: Positive = 3.0
    flow_shift: Positive = 3.0
    optim: AdamWConfig = AdamWConfig(lr=2e-6, betas=(0.0, 0.999))
    critic_optim: AdamWConfig = AdamWConfig(lr=8e-6, betas=(0.0, 0.999))
    cfg_uncond: Literal["negative_prompt", "zero", "keep"] = "negative_prompt"
    negative_prompt_path: str | None = None
    latent_shape: tuple[PositiveInt, PositiveInt, PositiveInt, PositiveInt] | None = None
    ema_decay: float | None = None
    ema_start_step: Annotated[int, msgspec.Meta(ge=0)] = 0
    validate_teacher: bool = False

    def __post_init__(self) -> None:
        steps = self.denoising_steps
        if not steps:
            raise ValueError("denoising_steps must be a non-empty list of timesteps, e.g. [1000, 750, 500, 250]")
        if any(not 0 <= s <= flow.NUM_TRAIN_TIMESTEPS for s in steps):
            raise ValueError(f"denoising_steps must lie in [0, {flow.NUM_TRAIN_TIMESTEPS}], got {list(steps)}")
        if any(a <= b for a, b in zip(steps, steps[1:])):
            raise ValueError(f"denoising_steps must be strictly descending, got {list(steps)}")
        lo, hi = self.min_timestep_ratio, self.max_timestep_ratio
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"need 0 <= min_timestep_ratio <= max_timestep_ratio <= 1, got min={lo}, max={hi}")
        if not math.isfinite(self.guidance_scale):
            raise ValueError(f"guidance_scale must be finite, got {self.guidance_scale}")
        if not self.critic_optim.lr > 0:
            raise ValueError(f"the critic needs critic_optim.lr > 0 (FastVideo's fake_score_learning_rate), "
                             f"got {self.critic_optim.lr}")
        if self.ema_decay is not None:
            ema.check_decay(self.ema_decay)

    @property
    def ema_enabled(self) -> bool:
        return bool(self.ema_decay)

    def build(self, models: Mapping[str, Model], *, total_steps: int, mesh: Any = None) -> Program:
        """The loop's Program for the role -> model mapping and a ``total_steps`` run. The roles' latent spaces and
        conditioning are checked against the student's and the negative-prompt file is read now, so every bad input,
        including the loop's check of the first batch, fails before any weights load. On a device mesh (models built
        on the same mesh) every role's params are local shards (the teacher in its frozen dtype, without optimizer
        state), norms and clips are global per role, and the DMD normaliser and logged losses are means over the
        ranks' equal slices."""
        check_shared_data(models, data_role=STUDENT)
        group = sharding.Group() if mesh is None else sharding.group_of(mesh)
        negative = None
        if self.negative_prompt_path is not None:
            negative, _ = models[STUDENT].load_cond(self.negative_prompt_path)
            rows = next(iter(negative.values())).shape[0]
            if rows != 1:
                raise ValueError(f"method.negative_prompt_path {self.negative_prompt_path!r} holds {rows} prompts; "
                                 "a negative prompt is one")
        txs = optimizers(self, total_steps, group)
        return Program(
            model=models[STUDENT],
            init=lambda run_key: init(run_key, models, self, txs),
            frozen=lambda run_key: {TEACHER: models[TEACHER].initial_params(role_keys(run_key).teacher, frozen=True)},
            step_=lambda state, frozen, batch: step_(state, batch, models=models, config=self,
                                                     teacher=frozen[TEACHER], txs=txs, negative=negative, group=group),
            check=lambda batch: check_batch(batch, models[STUDENT], self, negative),
            validate=lambda state, frozen, validation_config: validate(
                state, validation_config, models=models, config=self, teacher=frozen[TEACHER], negative=negative),
        )

    def memory_plan(self, specs: Mapping[str, Any]) -> Any:
        """For ``--dry-run``: a trainable student (with its EMA when enabled), a trainable critic and a frozen
        teacher, each of its own model, the teacher at its frozen dtype's bytes a param (its few fp32-kept params,
        norms and the time embedding, counted at that width); the two backward passes run one after the other."""
        from fvx import dry_run, memory  # the dry run only

        return dry_run.Plan(roles=(memory.Role(STUDENT, specs[STUDENT], trainable=True, ema=self.ema_enabled),
                                   memory.Role(CRITIC, specs[CRITIC], trainable=True),
                                   memory.Role(TEACHER, specs[TEACHER], trainable=False,
                                               param_bytes=specs[TEACHER].frozen_bytes)))


# ------------------------------------------------------------------------------------------------ roles and setup


class Optimizers(NamedTuple):
    """The student's and the critic's transformations, and their LR as a function of each one's update count."""

    student: optim.GradientTransformation
    critic: optim.GradientTransformation
    student_lr: Callable[[Any], Any]
    critic_lr: Callable[[Any], Any]


def optimizers(config: DMD2, total_steps: int, group: sharding.Group = sharding.Group()) -> Optimizers:
    """Each trainable role's AdamW; over shards (``group`` of more than one rank) each clips by its global norm."""
    return Optimizers(config.optim.build(total_steps, group), config.critic_optim.build(total_steps, group),
                      config.optim.schedule_fn(total_steps), config.critic_optim.schedule_fn(total_steps))


class RoleKeys(NamedTuple):
    student: torch.Tensor
    steps: torch.Tensor
    critic: torch.Tensor
    teacher: torch.Tensor


def role_keys(run_key: torch.Tensor) -> RoleKeys:
    """The keys of each role's initial params and of the steps: ``split(run_key, 4)`` (the student's and the steps'
    are fine-tuning's)."""
    return RoleKeys(*random.split(run_key, 4))


def _norm(grads: Params, group: sharding.Group) -> torch.Tensor:
    return tree.global_norm(grads) if group.dp_size == 1 else sharding.global_norm_sharded(grads, group)


def init(run_key: torch.Tensor, models: Mapping[str, Model], config: DMD2, txs: Optimizers) -> TrainState:
    """Step 0: the student's and the critic's initial params (each from its model: its folder or its own key), a
    fresh optimizer state each over the params it trains, and the student's EMA when enabled."""
    keys = role_keys(run_key)
    student = models[STUDENT].initial_params(keys.student)
    critic = models[CRITIC].initial_params(keys.critic)
    trained = models[STUDENT].trainable(student)
    roles = {
        STUDENT: RoleState(params=student, opt_state=txs.student.init(trained),
                           ema=ema.ema_init(trained) if config.ema_enabled else None),
        CRITIC: RoleState(params=critic, opt_state=txs.critic.init(models[CRITIC].trainable(critic))),
    }
    return TrainState(step=torch.zeros((), dtype=torch.int64), key=keys.steps, roles=roles)


def uncond(model: Model, batch: Batch, config: DMD2, negative: Cond | None = None) -> Cond:
    """The teacher's unconditional cond under ``config.cfg_uncond`` (spec §3.1), batched like ``batch["cond"]``."""
    return model.uncond(batch["cond"], config.cfg_uncond, negative)


# ---------------------------------------------------------------------------------------------- batch validation


def check_batch(batch: Batch, model: Model, config: DMD2, negative: Cond | None = None) -> None:
    """Raise a ValueError when ``batch`` cannot feed this method and the student's model (called once, before the
    first step; the batch's cond was checked when the model made it).

    This is where ``text_only`` data meets ``data_latent``: the method cannot see the data config, but such a
    batch has no latents, and the loop checks the first batch before it writes or trains anything.
    """
    has_latents = "latents" in batch
    if config.rollout_mode == "data_latent" and not has_latents:
        raise ValueError("rollout_mode='data_latent' noises the data latents, but the batch has none "
                         "(data.kind='text_only'?); use method.rollout_mode=simulate for text-only data")
    if has_latents:
        model.check_latents(tuple(batch["latents"].shape), where="batch latents")
    elif config.latent_shape is None:
        raise ValueError("the batch has no latents (text_only data), so simulate needs method.latent_shape "
                         "= [C, T, H, W] for the student's samples")
    else:
        model.check_latents((1, *config.latent_shape), where="method.latent_shape")
    if config.guidance_scale != 1.0:
        uncond(model, batch, config, negative)  # a negative prompt is there when cfg_uncond needs one


# --------------------------------------------------------------------------------------------- timesteps and x0


def validate(state: TrainState, validation_config: Any, *, models: Mapping[str, Model], config: DMD2,
             teacher: Params, negative: Cond | None = None) -> list[validation.Sampler]:
    """What a validation samples: the student (its EMA when kept) with its few-step SDE schedule, and with
    ``validate_teacher`` the teacher, guided, on the many-step ODE. Params are used in place, never copied."""
    student, model = state.roles[STUDENT], models[STUDENT]
    few_steps = denoising_timesteps(config) / flow.NUM_TRAIN_TIMESTEPS
    params = student.params if student.ema is None else with_trained(student.params, student.ema)
    samplers = [validation.Sampler("student" if student.ema is None else "student_ema", model.apply, params,
                                   few_steps, "sde")]
    if config.validate_teacher:
        teacher_model = models[TEACHER]

        def guided(params: Params, x_t: torch.Tensor, t: torch.Tensor, cond: Cond) -> torch.Tensor:
            unconditional = teacher_model.uncond(cond, config.cfg_uncond, negative)
            return flow.cfg(teacher_model.apply(params, x_t, t, cond), teacher_model.apply(params, x_t, t, unconditional),
                            config.guidance_scale)

        many_steps = validation.many_step_sigmas(validation_config.num_steps, validation_config.flow_shift)
        samplers.append(validation.Sampler("teacher", guided, teacher, many_steps, "ode"))
    return samplers


def with_trained(params: Params, trained: Params) -> Params:
    """``params`` with the trained ones replaced by ``trained`` (an EMA, or the differentiated leaves)."""
    return trained if len(trained) == len(params) else {**params, **trained}


def denoising_timesteps(config: DMD2) -> torch.Tensor:
    """The student's step timesteps ``[K]`` fp32: ``denoising_steps``, or with warp the shifted-grid values
    ``cat(1000 training_sigmas(flow_shift), [0])[1000 - s]``."""
    steps = torch.tensor(config.denoising_steps, dtype=torch.float32)
    if not config.warp_denoising_step:
        return steps
    grid = flow.to_timestep(flow.training_sigmas(config.flow_shift))
    table = torch.cat([grid, torch.zeros(1)])
    return table[flow.NUM_TRAIN_TIMESTEPS - torch.tensor(config.denoising_steps, dtype=torch.int64)]


def score_timestep_bounds(config: DMD2) -> tuple[int, int]:
    """``(int(1000 min_ratio), int(1000 max_ratio))``, the window score timesteps are clamped to."""
    n = flow.NUM_TRAIN_TIMESTEPS
    return int(config.min_timestep_ratio * n), int(config.max_timestep_ratio * n)


def sample_score_timestep(key: torch.Tensor, config: DMD2) -> torch.Tensor:
    """One score timestep for the batch, 0-dim fp32: ``t0 ~ randint[0, 1000)``, shifted by ``timestep_shift``,
    clamped to [0, 1000], then to the ratio window."""
    t0 = random.randint(key, (), 0, flow.NUM_TRAIN_TIMESTEPS).to(torch.float32)
    t = torch.clamp(flow.shift_timestep(t0, config.timestep_shift), 0, flow.NUM_TRAIN_TIMESTEPS)
    lo, hi = score_timestep_bounds(config)
    return torch.clamp(t, lo, hi)


def rollout_index(key: torch.Tensor, num_steps: int) -> int:
    """The step the student is trained at: ``randint[0, K)`` as a Python int (it chooses how many calls to run)."""
    return int(random.randint(key, (), 0, num_steps))


def predict_x0(model: Model, params: Params, x_t: torch.Tensor, t: torch.Tensor, cond: Cond,
               grid: torch.Tensor) -> torch.Tensor:
    """``x_t - sigma(t) v(x_t, t)`` for latents ``[B, C, T, H, W]`` at one timestep ``t`` (0-dim), with
    ``sigma(t)`` the nearest level of ``grid``."""
    v = model.apply(params, x_t, t.expand(x_t.shape[0]), cond)
    return flow.x0_from_velocity(x_t, v, flow.nearest_grid_sigma(grid, t))


def per_sample_normal(key: torch.Tensor, sample_index: torch.Tensor, draw: int, shape: tuple[int, ...],
                      device: torch.device) -> torch.Tensor:
    """Noise ``[B, *shape]``: sample b's draw number ``draw`` is ``normal(fold_in(fold_in(key, draw), index_b))``."""
    keys = random.fold_in(random.fold_in(key, draw), sample_index.to(key.device))
    return random.normal_each(keys, shape, device=device)


def sample_shape(batch: Batch, config: DMD2) -> tuple[int, ...]:
    """``(C, T, H, W)`` of the student's samples: the batch latents' (only their shape is used) or ``latent_shape``."""
    if "latents" in batch:
        return tuple(batch["latents"].shape[1:])
    if config.latent_shape is None:
        raise ValueError("the batch has no latents, so simulate needs method.latent_shape = [C, T, H, W]")
    return tuple(config.latent_shape)


# --------------------------------------------------------------------------------------------------- the losses


def _rollout(params: Params, batch: Batch, key: torch.Tensor, model: Model, config: DMD2,
             with_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0_gen ``[B, C, T, H, W]``, the timestep of the graded call): see :func:`student_rollout`."""
    index_key, noise_key = random.split(key)
    steps = denoising_timesteps(config)
    grid = flow.training_sigmas(config.flow_shift)
    k = rollout_index(index_key, len(steps))
    cond, index, device = batch["cond"], batch["sample_index"], batch["sample_index"].device
    steps, grid = steps.to(device), grid.to(device)
    if config.rollout_mode == "data_latent":
        x0 = model.normalize(batch["latents"].float())
        noise = per_sample_normal(noise_key, index, 0, tuple(x0.shape[1:]), device)
        x = flow.add_noise(x0, noise, flow.nearest_grid_sigma(grid, steps[k]))
    else:
        shape = sample_shape(batch, config)
        x = per_sample_normal(noise_key, index, 0, shape, device)
        with torch.no_grad():
            for j in range(k):
                x0_j = predict_x0(model, params, x, steps[j], cond, grid)
                noise = per_sample_normal(noise_key, index, j + 1, shape, device)
                x = flow.add_noise(x0_j, noise, flow.nearest_grid_sigma(grid, steps[j + 1]))
    with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
        return predict_x0(model, params, x, steps[k], cond, grid), steps[k]


def student_rollout(student_params: Params, batch: Batch, key: torch.Tensor, *, model: Model, config: DMD2,
                    with_grad: bool = True) -> torch.Tensor:
    """The student's sample ``x0_gen [B, C, T, H, W]`` fp32 that DMD2 trains on.

    ``k = randint[0, K)`` from ``split(key)[0]``; noise draw ``j`` of a sample from ``split(key)[1]`` by
    :func:`per_sample_normal`.
    ``simulate``: ``x = eps_0``; for ``j < k`` (no grad) ``x <- add_noise(x0(x, steps[j]), eps_{j+1}, steps[j+1])``;
    then ``x0_gen = x0(x, steps[k])``. ``data_latent``: ``x0_gen = x0(add_noise(latents, eps_0, steps[k]), steps[k])``.
    Only that last call records a graph, and only when ``with_grad``: one student forward in the graph.
    """
    return _rollout(student_params, batch, key, model, config, with_grad)[0]


def dmd_loss(x0_gen: torch.Tensor, x0_fake: torch.Tensor, x0_real: torch.Tensor,
             group: sharding.Group = sharding.Group()) -> tuple[torch.Tensor, torch.Tensor]:
    """``(0.5 mean((x0_gen - sg(x0_gen - grad))^2), mean|x0_gen - x0_real|)`` with
    ``grad = nan_to_num((x0_fake - x0_real) / mean|x0_gen - x0_real|)``, in fp32, so that
    ``d loss / d x0_gen = grad / numel`` (up to the rounding of ``x0_gen - (x0_gen - grad)``)."""
    x0_gen = x0_gen.float()
    with torch.no_grad():
        normalizer = sharding.dp_mean((x0_gen - x0_real.float()).abs().mean(), group)  # of the global batch
        direction = torch.nan_to_num((x0_fake.float() - x0_real.float()) / normalizer)
        target = x0_gen - direction
    return 0.5 * torch.mean((x0_gen - target) ** 2), normalizer


def _noised(x0: torch.Tensor, batch: Batch, key: torch.Tensor, config: DMD2,
            grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_t, noise, t): a score timestep ``t`` from ``split(key)[0]``, per-sample noise from ``split(key)[1]``."""
    t_key, noise_key = random.split(key)
    t = sample_score_timestep(t_key, config).to(x0.device)
    noise = per_sample_normal(noise_key, batch["sample_index"], 0, tuple(x0.shape[1:]), x0.device)
    return flow.add_noise(x0, noise, flow.nearest_grid_sigma(grid, t)), noise, t


def real_and_fake_x0(critic_params: Params, teacher_params: Params, x0_gen: torch.Tensor, batch: Batch,
                     key: torch.Tensor, *, critic: Model, teacher: Model, config: DMD2,
                     negative: Cond | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x0_fake, x0_real, t)`` of the student sample ``x0_gen`` noised at a score timestep (no grad): the critic's
    x0 and the teacher's guided x0 ``uncond + g (cond - uncond)``."""
    grid = flow.training_sigmas(config.flow_shift).to(x0_gen.device)
    with torch.no_grad():
        x_t, _, t = _noised(x0_gen.detach(), batch, key, config, grid)
        x0_fake = predict_x0(critic, critic_params, x_t, t, batch["cond"], grid)
        x0_cond = predict_x0(teacher, teacher_params, x_t, t, batch["cond"], grid)
        if config.guidance_scale == 1.0:
            return x0_fake, x0_cond, t
        x0_uncond = predict_x0(teacher, teacher_params, x_t, t, uncond(teacher, batch, config, negative), grid)
        return x0_fake, flow.cfg(x0_cond, x0_uncond, config.guidance_scale), t


def generator_loss(student_params: Params, critic_params: Params, teacher_params: Params, batch: Batch,
                   key: torch.Tensor, *, models: Mapping[str, Model], config: DMD2, negative: Cond | None = None,
                   group: sharding.Group = sharding.Group()) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DMD loss of the student (module docstring), differentiable in ``student_params`` only; over shards the
    normaliser is the mean over ``group``'s ranks (the global batch's), the loss this rank's slice's.

    ``split(key)`` gives the rollout key (:func:`student_rollout`) and the score key (timestep ``t`` from its first
    half, per-sample noise from its second). aux: ``dmd_normalizer`` ``mean|x0_gen - x0_real|``,
    ``generator_timestep`` (the rollout's graded step) and ``score_timestep``.
    """
    rollout_key, score_key = random.split(key)
    x0_gen, t_gen = _rollout(student_params, batch, rollout_key, models[STUDENT], config, with_grad=True)
    x0_fake, x0_real, t = real_and_fake_x0(critic_params, teacher_params, x0_gen, batch, score_key,
                                           critic=models[CRITIC], teacher=models[TEACHER], config=config,
                                           negative=negative)
    loss, normalizer = dmd_loss(x0_gen, x0_fake, x0_real, group)
    return loss, {"dmd_normalizer": normalizer, "generator_timestep": t_gen, "score_timestep": t}


def critic_loss(critic_params: Params, student_params: Params, batch: Batch, key: torch.Tensor, *,
                models: Mapping[str, Model], config: DMD2) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's flow-matching loss on a fresh student sample: ``mean((v(x_t, t) - (eps - x0_gen))^2)``.

    Key layout as :func:`generator_loss`; the rollout runs without grad. aux: ``generator_timestep``,
    ``score_timestep``.
    """
    rollout_key, score_key = random.split(key)
    with torch.no_grad():
        x0_gen, t_gen = _rollout(student_params, batch, rollout_key, models[STUDENT], config, with_grad=False)
    grid = flow.training_sigmas(config.flow_shift).to(x0_gen.device)
    x_t, noise, t = _noised(x0_gen, batch, score_key, config, grid)
    v = models[CRITIC].apply(critic_params, x_t, t.expand(x_t.shape[0]), batch["cond"]).float()
    loss = torch.mean((v - flow.velocity_target(x0_gen, noise)) ** 2)
    return loss, {"generator_timestep": t_gen, "score_timestep": t}


# ------------------------------------------------------------------------------------------------------ the step


def update_student(step: int, interval: int) -> bool:
    """Whether step ``step`` (0-based) updates the student: FastVideo's iteration ``step + 1`` is a multiple of
    ``interval``, or always when ``interval <= 0``."""
    return interval <= 0 or (step + 1) % interval == 0


def _update_count(opt_state: Any) -> torch.Tensor:
    """The AdamW update count inside an optimizer state (the LR schedule's argument)."""
    found = [node for node in tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, optim.AdamWState))
             if isinstance(node, optim.AdamWState)]
    if len(found) != 1:
        raise ValueError(f"expected one AdamW state in the optimizer state, found {len(found)}")
    return found[0].count


def _keys(state: TrainState) -> tuple[torch.Tensor, torch.Tensor]:
    """(generator key, critic key) of this step: ``split(fold_in(run_key, step))``."""
    generator_key, critic_key = random.split(random.fold_in(state.key, state.step))
    return generator_key, critic_key


def _value_and_grad_trained(loss: Callable, model: Model, params: Params, *args: Any, **kwargs: Any):
    """``((loss, aux), grads)`` of ``loss(params, *args)`` differentiated in the params ``model`` trains only."""
    def of_trained(trained: Params, *rest: Any, **kw: Any):
        return loss(with_trained(params, trained), *rest, **kw)

    return grad.value_and_grad(of_trained, has_aux=True)(model.trainable(params), *args, **kwargs)


def _critic_update(state: TrainState, batch: Batch, key: torch.Tensor, models: Mapping[str, Model], config: DMD2,
                   txs: Optimizers, group: sharding.Group) -> tuple[Params, Metrics]:
    """The critic's gradients (from the params before this step) and metrics."""
    critic, student = state.roles[CRITIC], state.roles[STUDENT]
    (loss, _), grads = _value_and_grad_trained(critic_loss, models[CRITIC], critic.params, student.params, batch,
                                               key, models=models, config=config)
    lr = txs.critic_lr(_update_count(critic.opt_state))
    return grads, {"critic_loss": sharding.dp_mean(loss, group), "grad_norm/critic": _norm(grads, group),
                   "lr/critic": torch.as_tensor(lr, dtype=torch.float32)}


def _apply_(role: RoleState, model: Model, grads: Params, tx: optim.GradientTransformation) -> RoleState:
    """The optimizer step of the params the role's model trains, in place (``role.params`` sees it)."""
    _, opt_state = optim.step_(tx, model.trainable(role.params), grads, role.opt_state)
    return role._replace(opt_state=opt_state)


def _ema_(student: RoleState, model: Model, step: int, config: DMD2) -> RoleState:
    """The student's EMA at the end of step ``step`` (iteration ``step + 1``), in place."""
    if config.ema_enabled:
        ema.ema_step_(student.ema, model.trainable(student.params), step + 1, decay=config.ema_decay,
                      start_step=max(config.ema_start_step, 1))
    return student


def critic_step_(state: TrainState, batch: Batch, *, models: Mapping[str, Model], config: DMD2, teacher: Params,
                 txs: Optimizers, negative: Cond | None = None,
                 group: sharding.Group = sharding.Group()) -> tuple[TrainState, Metrics]:
    """A step that updates only the critic (and the student's EMA), donating ``state``."""
    s = int(state.step)
    _, critic_key = _keys(state)
    critic_grads, metrics = _critic_update(state, batch, critic_key, models, config, txs, group)
    metrics["update_student"] = torch.zeros((), dtype=torch.float32)
    if not all_finite(metrics["critic_loss"], metrics["grad_norm/critic"]):
        return skipped(state, metrics)
    roles = {STUDENT: _ema_(state.roles[STUDENT], models[STUDENT], s, config),
             CRITIC: _apply_(state.roles[CRITIC], models[CRITIC], critic_grads, txs.critic)}
    return TrainState(step=state.step + 1, key=state.key, roles=roles), metrics


def student_and_critic_step_(state: TrainState, batch: Batch, *, models: Mapping[str, Model], config: DMD2,
                             teacher: Params, txs: Optimizers, negative: Cond | None = None,
                             group: sharding.Group = sharding.Group()) -> tuple[TrainState, Metrics]:
    """A step that updates the student and the critic (both losses from the params before the step), then the
    student's EMA, donating ``state``."""
    s = int(state.step)
    generator_key, critic_key = _keys(state)
    student, critic = state.roles[STUDENT], state.roles[CRITIC]
    (loss, aux), student_grads = _value_and_grad_trained(generator_loss, models[STUDENT], student.params,
                                                         critic.params, teacher, batch, generator_key, models=models,
                                                         config=config, negative=negative, group=group)
    lr = txs.student_lr(_update_count(student.opt_state))
    metrics = {"generator_loss": sharding.dp_mean(loss, group), "dmd_normalizer": aux["dmd_normalizer"],
               "grad_norm/student": _norm(student_grads, group),
               "lr/student": torch.as_tensor(lr, dtype=torch.float32)}
    critic_grads, critic_metrics = _critic_update(state, batch, critic_key, models, config, txs, group)
    metrics.update(critic_metrics, update_student=torch.ones((), dtype=torch.float32))
    if not all_finite(*(metrics[name] for name in ("generator_loss", "grad_norm/student", "critic_loss",
                                                    "grad_norm/critic"))):
        return skipped(state, metrics)
    student = _ema_(_apply_(student, models[STUDENT], student_grads, txs.student), models[STUDENT], s, config)
    roles = {STUDENT: student, CRITIC: _apply_(critic, models[CRITIC], critic_grads, txs.critic)}
    return TrainState(step=state.step + 1, key=state.key, roles=roles), metrics


def step_(state: TrainState, batch: Batch, *, models: Mapping[str, Model], config: DMD2, teacher: Params,
          txs: Optimizers, negative: Cond | None = None,
          group: sharding.Group = sharding.Group()) -> tuple[TrainState, Metrics]:
    """One DMD2 step, donating ``state`` (see fvx.state.Program): :func:`student_and_critic_step_` on student-update
    steps, else :func:`critic_step_`. ``teacher`` is the frozen teacher's params (read only).

    Metrics: ``critic_loss``, ``grad_norm/critic``, ``lr/critic``, ``update_student`` (0/1) every step; on update
    steps also ``generator_loss``, ``dmd_normalizer``, ``grad_norm/student``, ``lr/student``. Norms are before clipping.
    A non-finite loss or gradient norm of either role applies nothing (no update, no EMA) and adds ``nonfinite = 1``
    (fvx.state.skipped). Over shards (``group``), params are local shards, norms global, losses means over ranks.
    """
    chosen = student_and_critic_step_ if update_student(int(state.step), config.generator_update_interval) \
        else critic_step_
    return chosen(state, batch, models=models, config=config, teacher=teacher, txs=txs, negative=negative,
                  group=group)
