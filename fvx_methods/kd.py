"""Knowledge distillation from a teacher's ODE trajectories (FastVideo's KDMethod and KDCausalMethod, spec §2.9):
a few-step student learns to jump from any state of the teacher's probability-flow ODE at a ``t_list`` time to where
that ODE ends.

The data is the teacher's trajectory cache (``fvx_methods.trajectory_cache``, built beforehand by its own command;
the run reads it instead of the experiment's data): per sample the states ``x_{t_k}`` at ``t_list[k]``, ``k < K``
(``K = len(t_list) - 1``), and the end ``x0*``, in the model's latent scale, with the sample's cond. Per sample ``b``
of the global batch, ``k ~ randint[0, K)`` from ``fold_in(step_key, global_sample_index)``, ``t = t_list[k]``,
``sigma = t / 1000`` (FastVideo: its dense grid's level nearest ``t``, up to 2.5e-4 lower at shift 5; not yet
matched, docs/design.md), ``v = student(x_{t_k}, t)``, ``x0_hat = x_{t_k} - sigma v``, and

    loss = 0.5 mean((x0_hat - x0*)^2)

FastVideo draws one ``k`` per rank's batch (``KDMethod.single_train_step``,
``fastvideo/train/methods/knowledge_distillation/kd.py:655-660``: ``randint(0, K, (1,))``, every sample at that
level); fvx keeps one per sample: each sample's ``k`` is uniform on ``[0, K)`` either way (the same expected loss and
gradient), a batch that mixes levels gives a lower-variance gradient, and the draws do not depend on how many ranks or
micro-batches share the global batch (docs/design.md, KD).

Causal (``kd_causal``): the latent frames form blocks of ``num_frames_per_block`` (the student's own blocks) and every
block draws its own ``k`` (``randint_each`` of shape ``[blocks]``, repeated over the block's frames to ``[B, T]``), per
sample and block as FastVideo does (``kd.py:900-909``); frame ``f`` of the input is frame ``f`` of the state at
``t_list[k[b, f]]``, the student takes one timestep per frame ``t [B, T]``, and ``sigma`` is per frame; the loss is the
same mean. The frames must be whole blocks (FastVideo's would end on a short block; ``fvx_models.wan_causal``).

Validation samples the student few-step on the ``t_list`` schedule (``sampler``: ``sde`` re-noises its x0 at each level,
``ode`` takes Euler steps), a causal student block by block on its KV cache. The update is ``fvx.core.role``'s, as
fine-tuning's; the teacher is never loaded for training (only the cache command loads it).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Annotated, Any, ClassVar, Literal, Mapping

import msgspec
import torch

from fvx.config import Config
from fvx.core import flow, random, role
from fvx.core.state import Batch, Program
from fvx.training import validation
from fvx_methods import trajectory_cache as cache
from fvx_methods.library import one_role
from fvx_models import streaming
from fvx_models.model import check_shared_data, Model, Params

STUDENT, TEACHER = one_role.STUDENT, "teacher"
SAMPLERS = {"sde": "sde (x0, re-noised)", "ode": "ode (Euler)"}

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
Positive = Annotated[float, msgspec.Meta(gt=0)]


# ---------------------------------------------------------------------------------------------------------- the loss


def step_indices(key: torch.Tensor, sample_index: torch.Tensor, num_steps: int, blocks: int | None) -> torch.Tensor:
    """Sample ``b``'s t_list indices from ``fold_in(key, index_b)``: ``randint[0, num_steps)`` of shape ``[]``
    (``blocks`` None: one per sample, ``[B]``) or ``[blocks]`` (one per block, ``[B, blocks]``)."""
    keys = random.fold_in(key, sample_index.to(key.device))
    return random.randint_each(keys, () if blocks is None else (blocks,), 0, num_steps)


def frame_indices(indices: torch.Tensor, frames: int) -> torch.Tensor:
    """``[B, T]``: each frame's t_list index, from one per sample ``[B]`` or one per block of ``T / blocks`` frames
    ``[B, blocks]``."""
    if indices.dim() == 1:
        return indices[:, None].expand(-1, frames)
    return indices.repeat_interleave(frames // indices.shape[1], dim=1)


def loss_fn(params: Params, batch: Batch, key: torch.Tensor, *, model: Model, t_list: tuple[int, ...],
            frames_per_block: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The KD loss (module docstring) of ``batch`` (``trajectory [B, K, C, T, H, W]`` at ``t_list[:K]``,
    ``latents [B, C, T, H, W]`` the targets ``x0*``, ``cond``, ``sample_index [B]``) under the step key ``key``;
    ``frames_per_block`` set: the causal form. aux ``step_idx``: the mean drawn index."""
    trajectory, target = batch["trajectory"].float(), batch["latents"].float()
    frames = trajectory.shape[3]
    blocks = None if frames_per_block is None else frames // frames_per_block
    drawn = step_indices(key, batch["sample_index"], len(t_list) - 1, blocks).to(trajectory.device)
    per_frame = frame_indices(drawn, frames)  # [B, T]
    x_t = torch.take_along_dim(trajectory, per_frame[:, None, None, :, None, None], dim=1).squeeze(1)
    t = torch.tensor(t_list[:-1], dtype=torch.float32, device=trajectory.device)[per_frame]  # [B, T]
    sigma = (t / flow.NUM_TRAIN_TIMESTEPS)[:, None, :, None, None]  # [B, 1, T, 1, 1]
    v = model.apply(params, x_t, t if blocks is not None else t[:, 0], batch["cond"]).float()
    loss = 0.5 * torch.mean((flow.x0_from_velocity(x_t, v, sigma) - target) ** 2)
    return loss, {"step_idx": drawn.float().mean()}


# -------------------------------------------------------------------------------------------------------- the build


class KDRoles(Config):
    """Which of the experiment's models plays each role: the student trains; the teacher only builds the cache."""

    student: str = "student"
    teacher: str = "teacher"


class KD(one_role.OneRoleConfig, tag="kd"):
    """Every knob of FastVideo's KD (spec §2.9), with fvx's names.

    t_list: the student's timesteps, descending ints in [0, 1000] ending in 0 (e.g. ``(999, 937, 833, 624, 0)``);
        it samples on them, and trains on the teacher's states at all but the last.
    cache: the trajectory cache folder (FastVideo's ``teacher_path_cache``), built by ``python -m
        fvx_methods.trajectory_cache`` with this experiment; a run refuses a missing, incomplete or mismatched one.
    teacher_steps, flow_shift: the teacher's Euler steps on the ``flow_shift``-shifted grid (FastVideo's
        ``teacher_inference_steps`` and ``pipeline.flow_shift``), the t_list times inserted.
    teacher_guidance_scale: the teacher's CFG ``g`` (``uncond + g (cond - uncond)``; applied, unlike FastVideo's);
        ``cfg_uncond`` its unconditional cond, ``negative_prompt_path`` the cond file of ``negative_prompt``.
    sampler: how validation samples the student on ``t_list`` (``sde``: x0 re-noised; ``ode``: Euler).
    and the one-role knobs (optimizer, gradient accumulation, EMA: ``fvx_methods.library.one_role.OneRoleConfig``).
    """

    roles: KDRoles = KDRoles()
    t_list: tuple[int, ...]
    cache: str
    teacher_steps: PositiveInt = 48
    flow_shift: Positive = 3.0
    teacher_guidance_scale: float = 1.0
    cfg_uncond: Literal["negative_prompt", "zero", "keep"] = "negative_prompt"
    negative_prompt_path: str | None = None
    sampler: Literal["sde", "ode"] = "sde"

    def __post_init__(self) -> None:
        steps = self.t_list
        if (len(steps) < 2 or steps[-1] != 0 or steps[0] > flow.NUM_TRAIN_TIMESTEPS
                or any(a <= b for a, b in zip(steps, steps[1:]))):
            raise ValueError(f"method.t_list must be strictly descending timesteps in [0, {flow.NUM_TRAIN_TIMESTEPS}] "
                             f"ending in 0, e.g. [999, 937, 833, 624, 0]; got {list(steps)}")
        if not math.isfinite(self.teacher_guidance_scale):
            raise ValueError(f"method.teacher_guidance_scale must be finite, got {self.teacher_guidance_scale}")
        if (self.teacher_guidance_scale != 1.0 and self.cfg_uncond == "negative_prompt"
                and self.negative_prompt_path is None):
            raise ValueError("method.teacher_guidance_scale != 1 with cfg_uncond='negative_prompt' needs "
                             "method.negative_prompt_path (a cond file); or use cfg_uncond='zero'")
        super().__post_init__()

    index_metric: ClassVar[str] = "kd_step_idx"  # the logged mean t_list index

    def frames_per_block(self) -> int | None:
        """The frames per block of the causal form, None for the plain one."""
        return None

    def trajectory(self) -> cache.Trajectory:
        """What the cache command integrates and records for this method."""
        return cache.Trajectory(self.t_list, self.teacher_steps, self.flow_shift, self.teacher_guidance_scale,
                                self.cfg_uncond, self.negative_prompt_path, self.cache, self.roles.teacher)

    def check_student(self, model: Model) -> None:
        """Raise a ValueError when the student cannot be trained by this method (the causal form checks its blocks)."""

    def check_models(self, models: Mapping[str, Model]) -> None:
        """The roles' refusals from their skeletons (shared latent space, :meth:`check_student`): :meth:`build` and
        the dry run call it."""
        check_shared_data(models, data_role=STUDENT)
        self.check_student(models[STUDENT])

    def check_latent_frames(self, models: Mapping[str, Model], frames: int) -> None:
        """Samples of ``frames`` latent frames that are not whole blocks of the causal form's (:func:`check_blocks`:
        the batch check's, and the dry run's on the samples it estimates)."""
        check_blocks(frames, self)

    def sampling(self, role_name: str) -> dict | None:
        """How the student is sampled as trained (recorded on export): few-step on the t_list, unguided."""
        if role_name != STUDENT:
            return None
        how = {"timesteps": list(self.t_list[:-1]), "sampler": SAMPLERS[self.sampler]}
        block = self.frames_per_block()
        return how if block is None else {**how, "sampler": how["sampler"] + ", block by block on a KV cache",
                                          "frames_per_block": block}

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's program: the student trains on the cache (``Program.dataset``, checked against the teacher,
        the data and ``t_list`` when the loop opens it) read through ``Program.model`` (the student, its ``batch``
        taking the cache's batches as they are: their cond is the one the teacher's model made, the same as the
        student's). The teacher's model only identifies the cache; its weights are never loaded."""
        self.check_models(models)
        student, teacher = models[STUDENT], models[TEACHER]
        trajectory = self.trajectory()
        loss = functools.partial(loss_fn, model=student, t_list=self.t_list, frames_per_block=self.frames_per_block())
        return one_role.program(self, student, total_steps=total_steps, ranks=ranks, before_update=before_update,
                                loss=loss, logged=lambda loss, aux: {"kd_loss": loss,
                                                                     self.index_metric: aux["step_idx"]},
                                check=lambda batch: check_batch(batch, student, self),
                                samplers=lambda params, is_ema, _: samplers(params, is_ema, student, self),
                                data_model=dataclasses.replace(student, batch=cached_batch),
                                dataset=lambda source: open_cache(trajectory, teacher, source))


class KDCausal(KD, tag="kd_causal"):
    """KD of a block-causal student (FastVideo's KDCausalMethod): one t_list index per block of
    ``num_frames_per_block`` latent frames, which must be the student's own block size (``model.causal``)."""

    num_frames_per_block: PositiveInt = 3

    index_metric: ClassVar[str] = "kd_mean_step_idx"

    def frames_per_block(self) -> int | None:
        return self.num_frames_per_block

    def check_student(self, model: Model) -> None:
        if model.causal is None:
            raise ValueError(f"method kd_causal needs a block-causal student, but model {model.name} is not one "
                             "(its Model.causal is None); use method kd for it")
        if model.causal.frames_per_block != self.num_frames_per_block:
            raise ValueError(f"method.num_frames_per_block = {self.num_frames_per_block}, but the student "
                             f"{model.name} attends in blocks of {model.causal.frames_per_block} frames; set them "
                             "equal")


def cached_batch(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A cache batch as the method sees it: as it is (the cache holds the cond the teacher's model made)."""
    return dict(raw)


def open_cache(trajectory: cache.Trajectory, teacher: Model, source: Any) -> cache.CacheDataset:
    """The run's data: the complete cache of this teacher, data and ODE holding the states at ``t_list[:-1]``."""
    expected = cache.for_training(cache.metadata(trajectory, cache.teacher_identity(teacher),
                                                 cache.data_identity(source)))
    return cache.open_cache(trajectory.folder, expected, trajectory.t_list[:-1], source)


def check_batch(batch: Batch, model: Model, config: KD) -> None:
    """A ValueError naming what does not fit (once, before the first step)."""
    model.check_latents(tuple(batch["latents"].shape), where="the cache's x0")
    k, shape = len(config.t_list) - 1, tuple(batch["latents"].shape)
    if tuple(batch["trajectory"].shape) != (shape[0], k, *shape[1:]):
        raise ValueError(f"the cache's trajectories are {tuple(batch['trajectory'].shape)}, expected "
                         f"{(shape[0], k, *shape[1:])} (K = {k} states of t_list)")
    one_role.check_grad_accum(batch, config.grad_accum)
    check_blocks(shape[2], config)


def check_blocks(frames: int, config: KD) -> None:
    """A ValueError when ``frames`` latent frames do not split into the causal form's blocks."""
    block = config.frames_per_block()
    if block is not None and frames % block:
        raise ValueError(f"latents of {frames} frames do not split into blocks of method.num_frames_per_block = "
                         f"{block}")


def samplers(params: Params, is_ema: bool, model: Model, config: KD) -> list[validation.Sampler]:
    """The student (``params``: its EMA when kept) sampled on the t_list schedule with ``config.sampler``, unguided;
    a causal student block by block (``fvx_models.streaming.draw``)."""
    sigmas = torch.tensor(config.t_list, dtype=torch.float32) / flow.NUM_TRAIN_TIMESTEPS
    return [validation.Sampler("student_ema" if is_ema else "student", model.apply, params, sigmas, config.sampler,
                               draw=streaming_draw(model, sigmas, config.sampler))]


def streaming_draw(model: Model, sigmas: torch.Tensor, sampler: str) -> Any:
    """A causal model's block-by-block sampler (``fvx_models.streaming.draw``), None for another model."""
    return None if model.causal is None else streaming.draw(model.causal, sigmas, sampler=sampler)
