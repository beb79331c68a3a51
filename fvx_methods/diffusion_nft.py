"""DiffusionNFT (FastVideo's DiffusionNFTMethod, spec §2.11; NVlabs' DiffusionNFT): online RL for a flow model by
negative-aware fine-tuning. Samples of a slow-moving old policy are scored by rewards, the rewards become per-group
advantages (``fvx_methods.library.rl``), and the student learns to move towards the samples the advantage favours
and away from the others through two implicit policies around the old one.

The loss at one timestep ``t`` (in [0, 1]) of a sample ``x0`` with advantage ``A``::

    x_t  = (1 - t) x0 + t eps
    A_c  = clamp(A, -C, C), then by adv_mode: positive_only clamp(A_c, 0, C); negative_only clamp(A_c, -C, 0);
           one_only 1[A_c > 0]; binary sign(A_c); all: A_c
    r    = clamp((A_c / C) / 2 + 0.5, 0, 1)
    v+   = beta v_theta + (1 - beta) sg(v_old);          v- = (1 + beta) sg(v_old) - beta v_theta
    x0+- = x_t - t v+-;   w+- = sg(max(mean_{CTHW} |x0+- - x0| (float64), 1e-5))
    L+-_b = mean_{CTHW}((x0+- - x0)^2 / w+-)
    L_policy = mean_b(C (r L+_b / beta + (1 - r) L-_b / beta))
    L_kl     = mean_b mean_{CTHW}((v_theta - sg(v_ref))^2)
    total    = L_policy + kl_beta L_kl

(``C`` is ``adv_clip_max``; ``v_old`` and ``v_ref`` the old policy's and the reference's velocities, no grad).

One fvx step is one outer iteration ``it = step + 1``: (1) the old policy samples the step's ``num_batches_per_epoch``
K-repeat sampling batches (the program's ``batch_at``: ``data.batch_size`` prompts each, every prompt
``num_video_per_prompt`` times over all ranks); (2) the samples are decoded by the experiment's VAE and scored; (3)
every rank's rewards are gathered into per-prompt advantages; (4) ``num_inner_epochs`` passes over the samples in
micro-batches x the first ``T_tr`` sampling timesteps (each sample its own column order), the gradients of ``E_acc =
grad_accum x T_tr`` micro-steps per optimizer update (clip, AdamW, EMA), counted across the inner epochs, a
remainder flushed at the end; (5) the old
policy moves towards the student, ``old <- d old + (1 - d) student`` with ``d = old_policy_decay(it)``. Several
optimizer updates can happen in one step: the learning-rate schedule and the EMA count updates.

Roles: the **student** (all params, or its LoRA adapters on a frozen base); the **old** policy, a copy of what the
student trains (its adapters only, when LoRA), held in the state without optimizer state; the **reference**, frozen:
the model ``roles.reference`` names (a copy of the student's initial weights), or, for a LoRA student whose reference
is its own model, the base with the adapters off (zero), sharing the base's memory: three roles on one base.
"""
from __future__ import annotations

import functools
import math
from typing import Annotated, Any, Callable, Iterator, Literal, Mapping, NamedTuple

import msgspec
import torch

from fvx.config import Config
from fvx.core import ema, flow, grad, optim, random, role, tree
from fvx.core.optim_config import AdamWConfig
from fvx.core.state import all_finite, Batch, copy, HeldRole, Metrics, Program, skipped, TrainState
from fvx.training import validation
from fvx_methods.library import distribution_matching as dm, rl
from fvx_methods.rewards import named, reward as freward
from fvx_models.model import check_shared_data, Model, Params

STUDENT, OLD, REFERENCE = "student", "old", "reference"
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
Positive = Annotated[float, msgspec.Meta(gt=0)]

AdvantageMode = Literal["all", "positive_only", "negative_only", "one_only", "binary"]
WEIGHT_FLOOR = 1e-5  # the adaptive x0-space weights' floor


def clipped_advantages(advantages: torch.Tensor, clip_max: float, mode: AdvantageMode) -> torch.Tensor:
    """``advantages [B]`` clamped to ``[-C, C]`` and shaped by ``mode`` (module docstring)."""
    clipped = torch.clamp(advantages, -clip_max, clip_max)
    if mode == "positive_only":
        return torch.clamp(clipped, 0, clip_max)
    if mode == "negative_only":
        return torch.clamp(clipped, -clip_max, 0)
    if mode == "one_only":
        return (clipped > 0).to(clipped.dtype)
    if mode == "binary":
        return torch.sign(clipped)
    if mode != "all":
        raise ValueError(f"adv_mode must be one of all, positive_only, negative_only, one_only, binary; got {mode!r}")
    return clipped


def weighted_x0_loss(x0_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """``[B]``: ``mean((x0_pred - x0)^2 / w)`` per sample, ``w = sg(max(mean|x0_pred - x0|, 1e-5))`` computed in
    float64 as DiffusionNFT does."""
    dims = tuple(range(1, x0.dim()))
    with torch.no_grad():
        weight = (x0_pred.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp_min(WEIGHT_FLOOR)
    return ((x0_pred - x0) ** 2 / weight).mean(dim=dims)


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, v_ref: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor,
             t: torch.Tensor, advantages: torch.Tensor, *, beta: float, adv_clip_max: float, adv_mode: AdvantageMode,
             kl_beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(total, aux)`` of the module docstring for velocities ``[B, C, T, H, W]`` at ``x_t``, clean samples ``x0``,
    timesteps ``t [B]`` in [0, 1] and ``advantages [B]``; differentiable in ``v_theta`` only. aux: ``policy_loss``,
    ``unweighted_policy_loss``, ``kl_div_loss``, ``old_deviate`` (mean (v_theta - v_old)^2), ``old_kl_div`` (mean
    (v_old - v_ref)^2), ``x0_norm`` (mean x0^2)."""
    v_old, v_ref = v_old.detach(), v_ref.detach()
    t = t.view(-1, *([1] * (x0.dim() - 1)))
    r = torch.clamp(clipped_advantages(advantages, adv_clip_max, adv_mode) / adv_clip_max / 2 + 0.5, 0, 1)
    positive = weighted_x0_loss(x_t - t * (beta * v_theta + (1 - beta) * v_old), x0)
    negative = weighted_x0_loss(x_t - t * ((1 + beta) * v_old - beta * v_theta), x0)
    unweighted = r * positive / beta + (1 - r) * negative / beta
    policy = (unweighted * adv_clip_max).mean()
    kl = ((v_theta - v_ref) ** 2).mean(dim=tuple(range(1, x0.dim()))).mean()
    aux = {"policy_loss": policy.detach(), "unweighted_policy_loss": unweighted.mean().detach(),
           "kl_div_loss": kl.detach(), "old_deviate": ((v_theta - v_old) ** 2).mean().detach(),
           "old_kl_div": ((v_old - v_ref) ** 2).mean(), "x0_norm": (x0 ** 2).mean()}
    return policy + kl_beta * kl, aux


# ------------------------------------------------------------------------------------------------- the inner plan


class Plan(NamedTuple):
    """The shape of an outer step: the sampling schedule ``sigmas [L]``, the trained timesteps (its first ``T_tr``
    levels), the micro-batches per pass, micro-steps per optimizer update (``E_acc``) and updates per step."""

    sigmas: torch.Tensor
    train_sigmas: torch.Tensor
    micro_batches: int
    accumulation: int
    updates_per_step: int


def plan(config: DiffusionNFT, sampling_batch: int) -> Plan:
    """:class:`Plan` of ``config`` for sampling batches of ``sampling_batch`` prompts (global, ``data.batch_size``):
    ``T_tr = max(1, min(L, int(L timestep_fraction)))``; micro-batches ``max(1, N // train_batch_size)`` of the
    step's ``N = num_batches_per_epoch x sampling_batch`` samples (global sizes, so the same on any number of ranks);
    updates per step ``ceil(num_inner_epochs x micro-steps / E_acc)`` (FastVideo counts micro-steps across the inner
    epochs and flushes a remainder at the end)."""
    sigmas = config.sampling.schedule(config.flow_shift)
    steps = len(sigmas)
    columns = max(1, min(steps, int(steps * config.timestep_fraction)))
    samples = config.num_batches_per_epoch * sampling_batch
    micro_batches = max(1, samples // (config.train_batch_size or sampling_batch))
    accumulation = config.grad_accum * columns
    updates = math.ceil(config.num_inner_epochs * micro_batches * columns / accumulation)
    return Plan(sigmas, sigmas[:columns], micro_batches, accumulation, updates)


# ------------------------------------------------------------------------------------------------------ the step


class Roles(NamedTuple):
    """The student's and the reference's models, the student's optimizer and the rewards with their weights."""

    student: Model
    reference: Model
    opt: role.RoleOptimizer
    rewards: Mapping[str, freward.Reward]
    weights: Mapping[str, float]
    decode: Callable[[torch.Tensor], torch.Tensor]


def sample_(state: TrainState, frozen: Mapping[str, Params], batch: Batch, key: torch.Tensor, *, roles: Roles,
            config: DiffusionNFT, plan_: Plan) -> torch.Tensor:
    """The old policy's samples ``[N, C, T, H, W]`` (normalised latents) of the step's prompts, one sampling batch
    at a time."""
    params = role.with_trained(frozen.get(STUDENT), state.roles[OLD].params)
    shape = dm.sample_shape(batch, config)
    n = len(batch["sample_index"]) // config.num_batches_per_epoch
    parts = []
    for b in range(config.num_batches_per_epoch):
        rows = slice(b * n, (b + 1) * n)
        cond = {name: c[rows] for name, c in batch["cond"].items()}
        parts.append(rl.rollout(roles.student.apply, params, cond, shape, batch["sample_index"][rows], key,
                                plan_.sigmas, config.sampling.trajectory).float())
    return torch.cat(parts)


def advantages_of(scores: dict[str, torch.Tensor], batch: Batch,
                  ranks: role.Ranks) -> tuple[torch.Tensor | None, Metrics]:
    """This rank's advantages ``[n]`` from every rank's rewards (gathered: the groups are the dataset rows) and the
    step's reward metrics: ``reward/<k>`` global means, the group diagnostics, ``nft/num_sampled``; None for the
    advantages (and only the means) when a reward on any rank is not finite."""
    names = list(scores)
    everyone = ranks.gather(torch.stack([scores[k] for k in names], dim=1))
    ids = ranks.gather(torch.stack([batch["index"], batch["sample_index"]], dim=1))
    metrics = {f"reward/{k}": everyone[:, i].mean() for i, k in enumerate(names)}
    avg = everyone[:, names.index("avg")]
    if not bool(torch.isfinite(avg).all()):
        return None, metrics
    advantages = rl.group_advantages(avg, ids[:, 0].tolist())
    here = (ids[None, :, 1] == batch["sample_index"][:, None]).int().argmax(1)
    metrics.update(rl.reward_diagnostics(avg, ids[:, 0].tolist()), **{
        "trained_prompt_num": torch.tensor(float(len(rl.groups(ids[:, 0].tolist())))),
        "nft/num_sampled": torch.tensor(float(len(avg)))})
    return advantages[here], metrics


def micro_loss(trained: Params, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, cond: Any,
               v_old: torch.Tensor, v_ref: torch.Tensor, advantages: torch.Tensor, *, base: Params | None,
               model: Model, config: DiffusionNFT) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The NFT loss of one micro-step (module docstring) as a function of the student's trained params."""
    v_theta = model.apply(role.with_trained(base, trained), x_t, t * 1000, cond).float()
    return nft_loss(v_theta, v_old, v_ref, x_t, x0, t, advantages, beta=config.beta, adv_clip_max=config.adv_clip_max,
                    adv_mode=config.adv_mode, kl_beta=config.kl_beta)


def micro_steps(x0: torch.Tensor, sample_index: torch.Tensor, key: torch.Tensor, plan_: Plan,
                epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Inner epoch ``epoch``'s micro-steps ``(rows, t [b], noise [b, ...])``, drawn as they are taken: the samples in
    an order drawn from
    ``fold_in(key, epoch)``, cut into ``plan_.micro_batches`` (the last takes the remainder), each micro-batch at each
    column ``j`` of its samples' own column orders (drawn per sample index), noise per (epoch, column, sample)."""
    epoch_key = random.fold_in(key, epoch)
    order_key, columns_key, noise_key = random.split(epoch_key, 3)
    n, columns = len(x0), len(plan_.train_sigmas)
    order = random.permutation(order_key, n)
    orders = torch.stack([random.permutation(random.fold_in(columns_key, i), columns) for i in sample_index.tolist()])
    size = n // plan_.micro_batches
    for m in range(plan_.micro_batches):
        rows = order[m * size:(m + 1) * size if m < plan_.micro_batches - 1 else n]
        for j in range(columns):
            t = plan_.train_sigmas[orders[rows, j]].to(x0.device)
            keys = random.fold_in(random.fold_in(noise_key, j), sample_index[rows].to(key.device))
            yield rows, t, random.normal_each(keys, tuple(x0.shape[1:]), device=x0.device)


def step_(state: TrainState, frozen: Mapping[str, Params], batch: Batch, *, roles: Roles, config: DiffusionNFT,
          plan_: Plan, before: role.BeforeUpdate | None = None) -> tuple[TrainState, Metrics]:
    """One outer iteration (module docstring), donating ``state``. ``split(fold_in(run_key, step))``: the sampling
    key and the training key. A non-finite reward applies nothing (:func:`skipped`); a non-finite loss or gradient
    at the step's first update applies nothing, at a later one stops the step there (the updates before it stay:
    the loop halts, ``run.on_nonfinite=skip`` being refused when a step holds several updates)."""
    s, ranks, model = int(state.step), roles.opt.ranks, roles.student
    sample_key, train_key = random.split(random.fold_in(state.key, state.step))
    base = frozen.get(STUDENT)
    x0 = sample_(state, frozen, batch, sample_key, roles=roles, config=config, plan_=plan_)
    with torch.no_grad():
        media = roles.decode(model.denormalize(x0))
    scores = freward.scores(roles.rewards, roles.weights, media, batch["caption"])
    advantages, metrics = advantages_of(scores, batch, ranks)
    if advantages is None:  # a reward was not finite on some rank: every rank skips
        return skipped(state, metrics)
    student, old = state.roles[STUDENT], state.roles[OLD]
    old_params = role.with_trained(base, old.params)
    ref_params = frozen[REFERENCE]
    value_and_grad = grad.value_and_grad(functools.partial(micro_loss, base=base, model=model, config=config),
                                         has_aux=True)
    logs: list[dict[str, torch.Tensor]] = []
    grads, pending, updates, measured = None, [], 0, None
    total = config.num_inner_epochs * plan_.micro_batches * len(plan_.train_sigmas)
    steps = (m for epoch in range(config.num_inner_epochs)
             for m in micro_steps(x0, batch["sample_index"], train_key, plan_, epoch))
    for i, (rows, t, noise) in enumerate(steps):
        x0_b = x0[rows]
        x_t = flow.add_noise(x0_b, noise, t)
        cond = {name: c[rows] for name, c in batch["cond"].items()}
        with torch.no_grad():
            v_old = model.apply(old_params, x_t, t * 1000, cond).float()
            v_ref = roles.reference.apply(ref_params, x_t, t * 1000, cond).float()
        (loss, aux), g = value_and_grad(student.params, x_t, x0_b, t, cond, v_old, v_ref, advantages[rows])
        torch._foreach_mul_(tree.tensor_leaves(g), 1.0 / plan_.accumulation)
        grads = g if grads is None else optim.apply_updates_(grads, g)
        logs.append({"total_loss": loss.detach(), **aux})
        pending.append(loss.detach())
        if len(pending) < plan_.accumulation and i < total - 1:
            continue
        measured = role.measure(roles.opt, student, grads)
        if not all_finite(ranks.mean(torch.stack(pending).mean()), measured.norm):
            metrics.update(_means(logs, ranks), **role.metrics(measured, STUDENT))
            if updates == 0:
                return skipped(state, metrics)
            metrics["total_loss"] = torch.tensor(float("nan"))  # applied before: the loop halts on it
            return state._replace(step=state.step + 1, roles={**state.roles, STUDENT: student}), metrics
        student = role.update_(roles.opt, student, measured, s * plan_.updates_per_step + updates, before, STUDENT)
        grads, pending, updates = None, [], updates + 1
    decay = rl.old_policy_decay(s + 1, config.decay_type)
    torch._foreach_lerp_(tree.tensor_leaves(old.params), tree.tensor_leaves(student.params), 1.0 - decay)
    metrics.update(_means(logs, ranks), **role.metrics(measured, STUDENT), **{
        "nft/iteration": torch.tensor(float(s + 1)), "nft/num_inner_epochs": torch.tensor(
            float(config.num_inner_epochs)), "nft/inner_micro_steps": torch.tensor(float(total)),
        "nft/optimizer_steps": torch.tensor(float(updates)), "nft/old_decay": torch.tensor(decay)})
    return state._replace(step=state.step + 1, roles={**state.roles, STUDENT: student, OLD: old}), metrics


def _means(logs: list[dict[str, torch.Tensor]], ranks: role.Ranks) -> Metrics:
    """Each logged entry's mean over the micro-steps, then over the data-parallel ranks."""
    return {name: ranks.mean(torch.stack([log[name] for log in logs]).mean()) for name in logs[0]}


# ----------------------------------------------------------------------------------------------------- the build


Spacing = Literal["set_timesteps", "even"]


class Sampling(Config):
    """How the old policy samples (FastVideo's ``method.sampling``): ``num_steps`` levels laid out by ``spacing`` at
    shift ``flow_shift`` (None: the method's ``flow_shift``; FastVideo's ``inherit``), or an explicit descending
    ``sigmas`` schedule in (0, 1], used as given; ``trajectory`` the Euler ODE or ``sde_reflow`` (x0 predicted and
    re-noised at each level). ``scheduler``: both of FastVideo's names are the flow-matching Euler schedule here.

    ``spacing``: ``set_timesteps``, FastVideo's (its sampler calls ``FlowMatchEulerDiscreteScheduler(shift=s)
    .set_timesteps(num_steps)``; ``fvx.core.flow.scheduler_sigmas``): timesteps evenly spaced from 1000 down to the
    scheduler's smallest shifted training level, then shifted again, so the low end is shifted twice (shift 8, 25
    steps: 1 ... 0.293, 0.060); ``even``: the levels ``1 - k / K`` shifted once (``validation.many_step_sigmas``;
    shift 8, 25 steps: 1 ... 0.410, 0.250), whose last hop starts higher but which, at few steps and a low shift,
    spends no model call near 0 (shift 3, 4 steps: 1, 0.9, 0.75, 0.5 against 1, 0.858, 0.602, 0.0089). Validation
    samples with the same spacing at its own ``num_steps`` and ``flow_shift``, as FastVideo's does."""

    num_steps: PositiveInt = 25
    scheduler: Literal["flow_match_euler", "model_default"] = "flow_match_euler"
    spacing: Spacing = "set_timesteps"
    trajectory: rl.Trajectory = "ode"
    flow_shift: Positive | None = None
    sigmas: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.sigmas is not None and (not self.sigmas or any(not 0 < s <= 1 for s in self.sigmas)
                                        or any(a <= b for a, b in zip(self.sigmas, self.sigmas[1:]))):
            raise ValueError(f"method.sampling.sigmas must be strictly descending levels in (0, 1], got "
                             f"{list(self.sigmas)}")

    def levels(self, num_steps: int, shift: float) -> torch.Tensor:
        """``num_steps`` levels ``[K]`` fp32, descending, laid out by ``spacing`` at ``shift`` (the samplers end at
        0)."""
        if self.spacing == "even":
            return validation.many_step_sigmas(num_steps, shift)
        return flow.scheduler_sigmas(shift, num_steps)

    def schedule(self, shift: float) -> torch.Tensor:
        """The sampling levels ``[L]`` (the samplers end at 0): the explicit ``sigmas``, or :meth:`levels` of
        ``num_steps`` at ``flow_shift`` (else ``shift``, the method's)."""
        if self.sigmas is not None:
            return torch.tensor(self.sigmas, dtype=torch.float32)
        return self.levels(self.num_steps, self.flow_shift or shift)


class RewardModel(Config):
    """A reward model's local folder (a CLIP model with its tokenizer and preprocessing), and, for PickScore, the
    folder of its processor (CLIP-H's) when it is another."""

    path: str
    processor: str | None = None


class NFTRoles(Config):
    """Which of the experiment's models plays each role: the student (the old policy is a copy of what it trains) and
    the reference."""

    student: str = "student"
    reference: str = "student"


class DiffusionNFT(Config, tag="diffusion_nft"):
    """Every knob of FastVideo's DiffusionNFT (spec §2.11), flat as in its YAML, in fvx's terms:

    reward_fn: reward name -> weight (``clipscore``, ``pickscore``, ``world``); reward_models: name -> its folder.
    sampling: the old policy's sampler (:class:`Sampling`); flow_shift: the sampling schedule's shift
        (``pipeline.flow_shift``).
    num_batches_per_epoch: sampling batches of ``data.batch_size`` prompts (global: FastVideo's
        ``sample_train_batch_size`` x ranks) per step; num_video_per_prompt: the copies K of each prompt in a
        sampling batch (a group is every copy of a prompt over the step's batches, so with K = 1 only prompts that
        recur across them get an advantage: refused with one batch per step, where none can).
    train_batch_size: the inner loop's micro-batch (global; None: ``data.batch_size``); grad_accum: micro-batches per
        update (FastVideo's ``loop.gradient_accumulation_steps``): an update every ``grad_accum x T_tr`` micro-steps.
    num_inner_epochs, timestep_fraction, adv_clip_max, adv_mode, beta, kl_beta, decay_type: as FastVideo's.
    optim: the student's AdamW, schedule (in optimizer updates) and clip (FastVideo's ``max_grad_norm``, ``betas``).
    ema_decay (None or 0: no EMA), ema_update_after_step: the student's EMA after every update from that many on;
        validate_ema: validation samples the EMA (FastVideo's ``ema.validation``).
    latent_shape: ``(C, T, H, W)`` of the samples for text-only data.
    """

    roles: NFTRoles = NFTRoles()
    reward_fn: dict[str, float] = {}
    reward_models: dict[str, RewardModel] = {}
    sampling: Sampling = Sampling()
    flow_shift: Positive = 3.0
    num_batches_per_epoch: PositiveInt = 48
    num_inner_epochs: PositiveInt = 1
    num_video_per_prompt: PositiveInt = 24
    train_batch_size: PositiveInt | None = None
    grad_accum: PositiveInt = 1
    adv_clip_max: Positive = 5.0
    adv_mode: AdvantageMode = "all"
    timestep_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.99
    kl_beta: Annotated[float, msgspec.Meta(ge=0)] = 1e-4
    beta: Positive = 0.1
    decay_type: Literal[0, 1, 2] = 1
    optim: AdamWConfig = AdamWConfig(lr=3e-5, betas=(0.9, 0.999), weight_decay=1e-4, max_grad_norm=1.0)
    ema_decay: float | None = 0.9
    ema_update_after_step: Annotated[int, msgspec.Meta(ge=0)] = 0
    validate_ema: bool = True
    latent_shape: tuple[PositiveInt, PositiveInt, PositiveInt, PositiveInt] | None = None

    needs = ("vae", "data")  # decodes samples for the rewards; reads its own grouped batches

    def __post_init__(self) -> None:
        freward.check_weights(self.reward_fn, named.KNOWN)
        for name in self.reward_models:
            if name not in self.reward_fn:
                raise ValueError(f"method.reward_models.{name}: {name!r} is not a reward of method.reward_fn "
                                 f"({', '.join(self.reward_fn)})")
        if self.optim.lr <= 0:
            raise ValueError(f"DiffusionNFT needs method.optim.lr > 0, got {self.optim.lr}")
        if self.num_video_per_prompt == 1 and self.num_batches_per_epoch == 1:
            raise ValueError("method.num_video_per_prompt=1 with method.num_batches_per_epoch=1 samples each prompt "
                             "of a step once: every group is one sample, every advantage 0, and no reward trains")
        if self.ema_decay:
            ema.check_decay(self.ema_decay)

    def held_roles(self) -> tuple[HeldRole, ...]:
        """What the run holds (the dry run's rows): the student trainable (with its EMA), the old policy (the
        student's trained params, no optimizer), the reference frozen (for a LoRA student on its own model: the
        shared base)."""
        return (HeldRole(STUDENT, trainable=True, ema=bool(self.ema_decay)),
                HeldRole(OLD, trainable=True, optimizer=False, model=STUDENT),
                HeldRole(REFERENCE, trainable=False))

    def updates_per_step(self, data: Any) -> int:
        """Optimizer updates in one step for the experiment's ``data`` (its ``batch_size`` is a sampling batch)."""
        return plan(self, data.batch_size).updates_per_step

    def micro_batches(self, data: Any) -> int:
        """In how many micro-batches the inner loop differentiates a rank's sampling batch (the dry run's
        activations)."""
        return max(1, data.batch_size // (self.train_batch_size or data.batch_size))

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None, vae: Any = None, data: Any = None) -> Program:
        """The loop's program; bad input (group sizes, rewards, the VAE) fails here, before any weights load."""
        check_shared_data(models, data_role=STUDENT)
        if data is None or vae is None:
            raise ValueError("DiffusionNFT decodes its samples for the rewards: the experiment needs a vae (and its "
                             "data config)")
        if data.batch_size % self.num_video_per_prompt:
            raise ValueError(f"data.batch_size {data.batch_size} (a sampling batch, all ranks) is not a multiple of "
                             f"method.num_video_per_prompt {self.num_video_per_prompt} (FastVideo's rule: world x "
                             "batch divisible by the group size)")
        plan_ = plan(self, data.batch_size)
        rewards = {name: named.named(name, **_reward_source(self, name, data)) for name in self.reward_fn}
        codec = vae.build(random.key(0))
        roles = Roles(models[STUDENT], models[REFERENCE],
                      self.optim.role(total_steps * plan_.updates_per_step, ranks, ema_decay=self.ema_decay,
                                      ema_start_step=self.ema_update_after_step + 1, ema_start="blend"),
                      rewards, dict(self.reward_fn), codec.decode)
        return Program(
            model=roles.student,
            init=lambda run_key: init(run_key, roles),
            frozen=lambda run_key: frozen_params(run_key, roles, same_model=self.roles.reference == self.roles.student),
            step_=lambda state, frozen, batch: step_(state, frozen, batch, roles=roles, config=self, plan_=plan_,
                                                     before=before_update),
            check=lambda batch: check_batch(batch, roles.student, self),
            validate=lambda state, frozen, cfg: validate(state, frozen, cfg, roles=roles, config=self),
            batch_at=functools.partial(rl.k_repeat_batch_at, repeats=self.num_video_per_prompt,
                                       batches=self.num_batches_per_epoch))


def _reward_source(config: DiffusionNFT, name: str, data: Any) -> dict[str, Any]:
    """What :func:`named.named` needs to make reward ``name``: its folder, or the toy world."""
    if name == "world":
        return {"world": data.world if data.path is None else None}
    model = config.reward_models.get(name)
    return {} if model is None else {"path": model.path, "processor": model.processor}


def init(run_key: torch.Tensor, roles: Roles) -> TrainState:
    """Step 0: the student's initial params (fresh optimizer state, EMA) and the old policy, a copy of them."""
    params_key, steps_key = random.split(run_key)
    student = role.init(roles.opt, roles.student.weights.initial(params_key))
    old = role.RoleState(params=copy(student.params), opt_state=None)
    return TrainState(step=torch.zeros((), dtype=torch.int64), key=steps_key, roles={STUDENT: student, OLD: old})


def frozen_params(run_key: torch.Tensor, roles: Roles, *, same_model: bool) -> dict[str, Params]:
    """The student's base and the reference's whole params (one copy when they are one base), from the params'
    key; a LoRA student's own reference gets zero adapters (adapters off)."""
    params_key = random.split(run_key)[0]
    frozen = role.frozen_params(params_key, {STUDENT: (roles.student, False), REFERENCE: (roles.reference, True)})
    if same_model and roles.student.export.adapters is not None:
        zeros = tree.map_tensors(torch.zeros_like, roles.student.weights.initial(params_key))
        frozen[REFERENCE] = {**frozen[REFERENCE], **zeros}
    return frozen


def check_batch(batch: Batch, model: Model, config: DiffusionNFT) -> None:
    """A ValueError when the first batch cannot feed DiffusionNFT: no captions for the rewards, latents the student
    cannot take, or text-only data without ``latent_shape``."""
    if "caption" not in batch:
        raise ValueError("DiffusionNFT's rewards read the prompts, but the data has no captions (a caption column)")
    if "latents" in batch:
        model.check_latents(tuple(batch["latents"].shape), where="batch latents")
    elif config.latent_shape is None:
        raise ValueError("the batch has no latents (text_only data), so DiffusionNFT needs method.latent_shape = "
                         "[C, T, H, W] for its samples")
    else:
        model.check_latents((1, *config.latent_shape), where="method.latent_shape")


def validate(state: TrainState, frozen: Mapping[str, Params], validation_config: validation.ValidationConfig, *,
             roles: Roles, config: DiffusionNFT) -> list[validation.Sampler]:
    """The student (its EMA when kept and ``validate_ema``) on ``validation_config.num_steps`` levels at its
    ``flow_shift``, laid out by the sampling's ``spacing`` (FastVideo's RL validation reuses ``method.sampling``
    with the validation's step count), with the method's trajectory, its videos scored by the rewards (in their
    captions and as ``validation/<tag>/reward/<k>``)."""
    student = state.roles[STUDENT]
    ema = student.ema is not None and config.validate_ema
    params = role.with_trained(frozen.get(STUDENT), student.ema if ema else student.params)
    sigmas = config.sampling.levels(validation_config.num_steps, validation_config.flow_shift)
    sampler = rl.SAMPLER[config.sampling.trajectory]

    def score(video: torch.Tensor, captions: list[str]) -> dict[str, torch.Tensor]:
        return freward.scores(roles.rewards, roles.weights, video, captions)

    return [validation.Sampler("student_ema" if ema else "student", roles.student.apply, params, sigmas, sampler,
                               score=score)]
