"""Self-Forcing (FastVideo's SelfForcingMethod, spec §2.5): a block-causal few-step student generates a clip block by
block on its own outputs, and the distribution-matching core (``fvx_methods.library.distribution_matching``: the DMD
generator loss and the critic's flow matching, with the per-sample normaliser) trains it on the whole generated clip
against a bidirectional teacher and critic.

The rollout, block ``b`` of ``chunk_size`` latent frames after block ``b - 1`` (each call attends to the KV cache)::

    x = noise[block b]
    for j < exit_b:   x0 = student x0(x, steps[j])  (no grad);   x = hop(x, x0, steps[j] -> steps[j + 1])
    x0_b = student x0(x, steps[exit_b])      graded iff with_grad, enable_gradient_in_rollout and the block starts at
                                             or after start_gradient_frame
    cache = student pass over sg(x0_b), re-noised to context_noise when > 0, its keys and values written (no grad;
            none after the last block)

``hop``: ``sde`` re-noises ``x0`` to the next level with fresh noise; ``ode`` keeps the predicted noise,
``eps = (x - (1 - s) x0) / max(s, 1e-8)``, ``x = (1 - s') x0 + s' eps`` (an Euler step). Every model (student, critic,
teacher) converts on FastVideo's ``S_sf(pipeline.flow_shift)`` grid (``flow_shift`` here: the grid levels nearest a
timestep), the student is called at ``floor(t)`` (FastVideo casts its streaming timesteps to long) and the score
timesteps are shifted by the same shift, unclamped.

Draws: ``split(key, 4)`` gives the exits, the clip's noise, the hops' noise and the context noise. The exits are one
draw for the whole batch, ``[blocks]`` (or one shared by every block), as FastVideo draws them on rank 0 and
broadcasts them; noise is per sample (``fold_in(.., sample_index)``), where FastVideo draws per rank: so nothing
depends on how ranks or micro-batches split the batch.

Block-at-a-time gradients (``block_gradients``): the generator loss depends on the student's params only through the
blocks' graded calls (the cache is written without grad), and is ``0.5 mean((x0 - sg(target))^2)``, so its gradient
is the sum over blocks of the vector-Jacobian product of ``(x0_b - target_b) / numel`` with block ``b``'s exit call.
The step then rolls out without grad, keeping each exit's input, takes the DMD target of the clip, and re-runs the
blocks in order, each graded exit with grad and each context write again (no grad) to rebuild the cache it saw: one
block's graph and one cache alive at a time (FastVideo issue 888's memory spike), at two extra forwards per block.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Mapping, NamedTuple

import msgspec
import torch

from fvx.config import Config
from fvx.core import flow, grad, optim, random, role
from fvx.core.state import Batch, Metrics, Program, TrainState
from fvx.training import validation
from fvx_methods.library import distribution_matching as dm
from fvx_models import streaming
from fvx_models.model import Cond, Model, Params

STUDENT, CRITIC, TEACHER = dm.STUDENT, dm.CRITIC, dm.TEACHER
PositiveInt = dm.PositiveInt

LONG_CLIP_BLOCKS = 4
"""``block_gradients="auto"`` takes gradients block at a time from this many blocks on (bench/self_forcing_toy.py)."""


# ------------------------------------------------------------------------------------------------------ the rollout


class Exit(NamedTuple):
    """A block's exit call as the rollout made it: its latent frames ``[start, end)`` (of the rolled clip), its input
    ``x [B, C, f, H, W]``, its timestep (the model's, ``[B]``), its grid level, and whether it is graded (records a
    graph in a graded rollout)."""

    frames: tuple[int, int]
    x: torch.Tensor
    t: torch.Tensor
    sigma: torch.Tensor
    graded: bool


class Rolled(NamedTuple):
    """A rollout: the clip ``x0 [B, C, T, H, W]`` fp32, the mean exit timestep per sample ``[B]``, every block's exit
    and the key of the context noise (what re-running the exits needs: :func:`exit_grads`)."""

    x0: torch.Tensor
    timesteps: torch.Tensor
    exits: tuple[Exit, ...]
    context_key: torch.Tensor


def exit_steps(key: torch.Tensor, blocks: int, config: SelfForcing) -> list[int]:
    """Each block's exit step in ``[0, K)``: ``K - 1`` for ``last_step_only``, else one draw ``randint(key, [blocks])``,
    or ``[1]`` shared by every block with ``same_step_across_blocks``."""
    k = len(config.denoising_steps)
    if config.last_step_only:
        return [k - 1] * blocks
    draws = random.randint(key, (1 if config.same_step_across_blocks else blocks,), 0, k).tolist()
    return draws * blocks if config.same_step_across_blocks else draws


def exit_x0(model: Model, params: Params, exit_: Exit, cond: Cond, cache: Any) -> torch.Tensor:
    """The student's x0 of an exit block ``[B, C, f, H, W]`` fp32 on ``cache`` (the graph of the exit call when grad
    is enabled)."""
    v, _ = model.causal.apply_cached(params, exit_.x, exit_.t, cond, cache)
    return flow.x0_from_velocity(exit_.x, v, exit_.sigma).float()


def hop(x: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, noise: torch.Tensor,
        sample_type: str) -> torch.Tensor:
    """The next level's ``x`` from ``x`` at ``sigma`` and its predicted ``x0``: re-noised (``sde``) or along the
    predicted noise (``ode``)."""
    if sample_type == "sde":
        return flow.add_noise(x0, noise, sigma_next)
    eps = (x - (1 - sigma) * x0) / torch.clamp(sigma, min=1e-8)
    return flow.add_noise(x0, eps, sigma_next)


def student_steps(config: SelfForcing, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(timesteps [K], grid levels [K], the model's timesteps floor(t) [K])`` of the student's steps."""
    grid = config.score().grid(device)
    steps = dm.denoising_timesteps(config.denoising_steps, config.warp_denoising_step, grid).to(device)
    return steps, flow.nearest_grid_sigma(grid, steps), torch.floor(steps)


def hop_to_exit(model: Model, params: Params, x: torch.Tensor, exit_step: int, cond: Cond, cache: Any,
                key: torch.Tensor, sample_index: torch.Tensor, config: SelfForcing) -> torch.Tensor:
    """A block's input at its exit step: ``exit_step`` no-grad hops from its noise ``x [B, C, f, H, W]`` on
    ``cache`` (hop ``j``'s noise is draw ``j`` of ``key``)."""
    _, sigmas, model_t = student_steps(config, x.device)
    with torch.no_grad():
        for j in range(exit_step):
            v, _ = model.causal.apply_cached(params, x, model_t[j].expand(x.shape[0]), cond, cache)
            x0 = flow.x0_from_velocity(x, v, sigmas[j])
            eps = dm.per_sample_normal(key, sample_index, j, tuple(x.shape[1:]), x.device)
            x = hop(x, x0, sigmas[j], sigmas[j + 1], eps, config.student_sample_type)
    return x


def rollout(params: Params, batch: Batch, key: torch.Tensor, with_grad: bool, *, model: Model,
            config: SelfForcing) -> Rolled:
    """The streaming rollout of the module docstring, from noise of the batch's latents' shape (or ``latent_shape``)."""
    exit_key, noise_key, hop_key, context_key = random.split(key, 4)
    index, cond = batch["sample_index"], batch["cond"]
    device, shape, size = index.device, dm.sample_shape(batch, config), config.chunk_size
    steps, sigmas, model_t = student_steps(config, device)
    noise = dm.per_sample_normal(noise_key, index, 0, shape, device)
    blocks, batch_size = shape[1] // size, len(index)
    cache, out, exits, ks = model.causal.empty_cache(shape[1]), [], [], exit_steps(exit_key, blocks, config)
    for b, k in enumerate(ks):
        start = b * size
        x = hop_to_exit(model, params, noise[:, :, start:start + size], k, cond, cache, random.fold_in(hop_key, b),
                        index, config)
        exits.append(Exit((start, start + size), x, model_t[k].expand(batch_size), sigmas[k],
                          graded=config.enable_gradient_in_rollout and start >= config.start_gradient_frame))
        with torch.set_grad_enabled(with_grad and exits[-1].graded and torch.is_grad_enabled()):
            out.append(exit_x0(model, params, exits[-1], cond, cache))
        if b + 1 < blocks:
            cache = write_context(model, params, out[-1].detach(), cache, cond, random.fold_in(context_key, b), index,
                                  config)
    timesteps = steps[ks].mean().expand(batch_size)
    return Rolled(torch.cat(out, dim=2), timesteps, tuple(exits), context_key)


def write_context(model: Model, params: Params, x0: torch.Tensor, cache: Any, cond: Cond, key: torch.Tensor,
                  sample_index: torch.Tensor, config: SelfForcing, always_noise: bool = False) -> Any:
    """The cache with a generated block's keys and values written, from a pass over the block (no grad) at
    ``floor(context_noise)``, the block re-noised to that level first when it is above 0 (or ``always_noise``: to
    the grid level nearest it, the smallest for 0, as streaming long tuning does)."""
    t = torch.full((x0.shape[0],), float(math.floor(config.context_noise)), device=x0.device)
    with torch.no_grad():
        if config.context_noise > 0 or always_noise:
            eps = dm.per_sample_normal(key, sample_index, 0, tuple(x0.shape[1:]), x0.device)
            level = flow.nearest_grid_sigma(config.score().grid(x0.device),
                                            torch.tensor([config.context_noise], device=x0.device))[0]
            x0 = flow.add_noise(x0, eps, level)
        return model.causal.apply_cached(params, x0, t, cond, cache)[1]


# --------------------------------------------------------------------------------------------------------- the step


def block_at_a_time(config: SelfForcing, frames: int) -> bool:
    """Whether the generator's gradients are taken block at a time (module docstring) for clips of ``frames``."""
    if config.block_gradients == "auto":
        return frames // config.chunk_size >= LONG_CLIP_BLOCKS
    return config.block_gradients == "on"


def exit_grads(trained: Params, base: Params | None, rolled: Rolled, batch: Batch, cotangent: torch.Tensor, *,
               model: Model, config: SelfForcing, cache: Any = None, always_noise: bool = False) -> Params:
    """The gradient in ``trained`` of ``sum(rolled.x0 * cotangent)``, block by block: the cache rebuilt as the
    rollout wrote it from ``cache`` (default: empty; each block's output again through :func:`write_context`, no
    grad) and each graded exit re-run with grad on it, so one block's graph and one cache are alive at a time."""
    params, cond, blocks = role.with_trained(base, trained), batch["cond"], len(rolled.exits)
    cache, grads = model.causal.empty_cache(rolled.x0.shape[2]) if cache is None else cache, None
    for b, exit_ in enumerate(rolled.exits):
        start, end = exit_.frames
        if exit_.graded:
            def share(p: Params) -> torch.Tensor:  # called at once, on this block's exit and cache
                return torch.sum(exit_x0(model, role.with_trained(base, p), exit_, cond, cache)
                                 * cotangent[:, :, start:end])
            g = grad.grad(share)(trained)
            grads = g if grads is None else optim.apply_updates_(grads, g)
        if b + 1 < blocks:
            cache = write_context(model, params, rolled.x0[:, :, start:end], cache, cond,
                                  random.fold_in(rolled.context_key, b), batch["sample_index"], config, always_noise)
    return grads


def student_grads(roles: dm.Roles, config: SelfForcing, negative: Cond | None = None, *,
                  block_at_a_time: bool) -> dm.GeneratorGrads:
    """The student's DMD gradients through the streaming rollout: one graph over the rollout, or block at a time."""
    if not block_at_a_time:
        return dm.generator_grads(graded_rollout(roles.student, config), roles, config.score(), negative)

    def parts(params: Params, micro: Batch, key: torch.Tensor) -> Rolled:
        return rollout(params, micro, key, False, model=roles.student, config=config)

    def vjp(trained: Params, base: Params | None, rolled: Rolled, micro: Batch, cotangent: torch.Tensor) -> Params:
        return exit_grads(trained, base, rolled, micro, cotangent, model=roles.student, config=config)

    return dm.generator_grads_by_parts(parts, vjp, roles, config.score(), negative)


def graded_rollout(model: Model, config: SelfForcing) -> dm.Rollout:
    """The rollout as the distribution-matching core calls it: ``(x0, timesteps)``."""
    def rollout_(params: Params, micro: Batch, key: torch.Tensor, with_grad: bool):
        return rollout(params, micro, key, with_grad, model=model, config=config)[:2]
    return rollout_


def step_(state: TrainState, batch: Batch, *, roles: dm.Roles, config: SelfForcing, frozen: Mapping[str, Params],
          negative: Cond | None = None, before: role.BeforeUpdate | None = None) -> tuple[TrainState, Metrics]:
    """One Self-Forcing step, donating ``state``: the distribution-matching step (``dm.step_``: the critic every step,
    the student on its cadence) on the streaming rollout."""
    grads = student_grads(roles, config, negative,
                          block_at_a_time=block_at_a_time(config, dm.sample_shape(batch, config)[1]))
    return dm.step_(state, batch, roles=roles, frozen=frozen, score=config.score(),
                    rollout=graded_rollout(roles.student, config), interval=config.generator_update_interval,
                    grad_accum=config.grad_accum, student_grads=grads, before=before)


# -------------------------------------------------------------------------------------------------------- the build


class SelfForcingRoles(Config):
    """Which of the experiment's models plays each role: the block-causal student, and the bidirectional critic
    (trained, from its model's weights) and teacher (frozen)."""

    student: str = "student"
    critic: str = "teacher"
    teacher: str = "teacher"


class SelfForcing(dm.DistributionMatchingConfig, tag="self_forcing"):
    """Every knob of FastVideo's Self-Forcing (spec §2.5): DMD2's distribution-matching ones
    (``dm.DistributionMatchingConfig``; ``rollout_mode`` must be ``simulate``, FastVideo's rule; ``flow_shift`` is
    FastVideo's ``pipeline.flow_shift``, the shift of the ``S_sf`` grid every model converts on and of the score
    timesteps) and the rollout's:

    chunk_size: latent frames per rollout block, the student's own block size; the clip must be whole blocks.
    student_sample_type: ``sde`` or ``ode`` hops between the student's steps (module docstring).
    same_step_across_blocks / last_step_only: one exit step for every block / always the last step.
    context_noise: the timestep in [0, 1000) the generated blocks are re-noised to before they are cached.
    enable_gradient_in_rollout / start_gradient_frame: the exit calls record a graph only when on, and only for
        blocks starting at or after this latent frame.
    block_gradients: ``on`` (block at a time), ``off`` (one graph over the rollout) or ``auto`` (on from
        ``LONG_CLIP_BLOCKS`` blocks); equal gradients either way.
    """

    roles: SelfForcingRoles = SelfForcingRoles()
    chunk_size: PositiveInt = 3
    student_sample_type: Literal["sde", "ode"] = "sde"
    same_step_across_blocks: bool = False
    last_step_only: bool = False
    context_noise: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    enable_gradient_in_rollout: bool = True
    start_gradient_frame: Annotated[int, msgspec.Meta(ge=0)] = 0
    block_gradients: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollout_mode != "simulate":
            raise ValueError(f"Self-Forcing rolls the student out from noise: method.rollout_mode must be simulate "
                             f"(FastVideo's rule), got {self.rollout_mode}")
        if not self.context_noise < flow.NUM_TRAIN_TIMESTEPS:
            raise ValueError(f"method.context_noise is a timestep in [0, 1000), got {self.context_noise}")
        if not self.enable_gradient_in_rollout:
            raise ValueError("method.enable_gradient_in_rollout = false leaves the student no gradient (no exit call "
                             "records a graph; FastVideo's backward fails on it); keep it true")

    def score(self) -> dm.Score:
        """Scores on FastVideo's ``S_sf(flow_shift)`` grid at timesteps shifted by it, over the whole range (no
        window)."""
        return dm.Score(self.flow_shift, self.flow_shift, 0.0, 1.0, self.guidance_scale, self.cfg_uncond,
                        "self_forcing")

    def sampling(self, role: str) -> dict | None:
        """How a role is sampled as trained (recorded on export): the student streamed block by block."""
        if role != STUDENT:
            return None
        steps, sigmas = student_schedule(self)
        return {"timesteps": steps.tolist(), "sigmas": sigmas.tolist(), "chunk_size": self.chunk_size,
                "context_noise": self.context_noise,
                "sampler": "sde (x0, re-noised)" if self.student_sample_type == "sde" else "ode (Euler)"}

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's Program for the role -> model mapping and a ``total_steps`` run (``dm.program``); the student
        (:meth:`check_models`), latent spaces, cond and the negative-prompt file are checked before any weights
        load."""
        return dm.program(self, models, total_steps=total_steps, ranks=ranks, before_update=before_update,
                          step_=step_, check=check_batch, validate=validate)


    def check_models(self, models: Mapping[str, Model]) -> None:
        """``dm``'s refusals, then the student's: block-causal in blocks of ``chunk_size`` (:func:`check_student`);
        ``dm.program`` and the dry run call it."""
        super().check_models(models)
        check_student(models[STUDENT], self)

    def check_latent_frames(self, models: Mapping[str, Model], frames: int) -> None:
        """A ValueError when a rollout clip of ``frames`` latent frames is not whole blocks (:func:`check_frames`:
        the batch check's, and the dry run's on the samples it estimates)."""
        check_frames(frames, self, ROLLOUT_CLIP)


ROLLOUT_CLIP = "the rollout's clip"  # what a clip-length refusal names


def check_student(model: Model, config: SelfForcing) -> None:
    """A ValueError unless the student is block-causal in blocks of ``chunk_size`` frames, and ``latent_shape`` (when
    set) fits the rollout."""
    if model.causal is None:
        raise ValueError(f"Self-Forcing needs a block-causal student (its rollout streams on a KV cache), but model "
                         f"{model.name} is not one; use a causal family such as wan_causal")
    if model.causal.frames_per_block != config.chunk_size:
        raise ValueError(f"method.chunk_size = {config.chunk_size}, but the student {model.name} attends in blocks "
                         f"of {model.causal.frames_per_block} frames; set them equal")
    if config.latent_shape is not None:
        check_frames(config.latent_shape[1], config, "method.latent_shape")


def check_frames(frames: int, config: SelfForcing, where: str) -> None:
    """A ValueError when a clip of ``frames`` latent frames is not whole rollout blocks or ends before
    ``start_gradient_frame``."""
    if frames % config.chunk_size:
        raise ValueError(f"{where}: {frames} latent frames are not whole blocks of method.chunk_size = "
                         f"{config.chunk_size}")
    last_block = frames - config.chunk_size
    if config.start_gradient_frame > last_block:
        raise ValueError(f"method.start_gradient_frame = {config.start_gradient_frame} is past the last block of "
                         f"the {frames}-frame clip (it starts at frame {last_block}), so no block would get a "
                         "gradient")


def check_batch(batch: Batch, model: Model, config: SelfForcing, negative: Cond | None = None) -> None:
    """A ValueError when ``batch`` cannot feed this method (once, before the first step): ``dm.check_batch``'s,
    and a clip of whole blocks that some block's gradient reaches."""
    dm.check_batch(batch, model, config, negative)
    check_frames(dm.sample_shape(batch, config)[1], config, ROLLOUT_CLIP)


def student_schedule(config: SelfForcing) -> tuple[torch.Tensor, torch.Tensor]:
    """``(timesteps [K], sigmas [K])`` the student samples on, as the rollout calls it: the model at ``floor(s_k)``,
    converting with the ``S_sf(flow_shift)`` grid's level nearest ``s_k``."""
    _, sigmas, model_t = student_steps(config, torch.device("cpu"))
    return model_t, sigmas


def validate(state: TrainState, validation_config: Any, *, roles: dm.Roles, config: SelfForcing,
             frozen: Mapping[str, Params], negative: Cond | None = None) -> list[validation.Sampler]:
    """The student (its EMA when kept) streamed block by block on its few-step schedule, unguided, with the
    rollout's sampler and context noise; ``validate_teacher``: the guided many-step teacher."""
    student, teacher = state.roles[STUDENT], frozen[TEACHER]
    steps, sigmas = student_schedule(config)
    params = role.with_trained(frozen.get(STUDENT), student.params if student.ema is None else student.ema)
    context_sigma = float(flow.nearest_grid_sigma(config.score().grid(), torch.tensor([config.context_noise]))[0])
    draw = streaming.draw(roles.student.causal, sigmas, sampler=config.student_sample_type,
                          context_noise=float(math.floor(config.context_noise)), timesteps=steps,
                          context_sigma=context_sigma)
    samplers = [validation.Sampler("student" if student.ema is None else "student_ema", roles.student.apply,
                                   params, sigmas, config.student_sample_type, draw=draw)]
    if config.validate_teacher:
        samplers.append(dm.teacher_sampler(roles, teacher, config, validation_config, negative))
    return samplers
