"""Diffusion-forcing and teacher-forcing SFT of a block-causal model (FastVideo's DiffusionForcingSFTMethod and
TeacherForcingSFTMethod, spec §2.2 and §2.3) as pure functions.

Fine-tuning by flow matching, but every chunk of ``chunk_size`` latent frames (the student's block) draws its own noise
level. Per sample b of the global batch: ``x0`` the normalised latents ``[C, T, H, W]``, ``noise ~ N(0, I)``, one
training-grid index per chunk, ``idx[b, k]`` uniform in ``[lo, hi]`` (index 0 is the noisiest), repeated over the
chunk's frames to ``idx [B, T]``; ``sigma = grid[idx]`` (``grid = fvx.core.flow.training_sigmas(flow_shift)``, the
model's shift-3 grid in FastVideo's recipes, spec §0.4), ``x_t = (1 - sigma) x0 + sigma noise`` frame by frame, ``v =
model(x_t, 1000 sigma)`` with one timestep per frame, and

    l[b, f] = mean_{C,H,W}((v - (noise - x0))^2)            (default)
    l[b, f] = mean_{C,H,W}((x_t - sigma v - x0)^2)          (precondition_outputs)
    loss    = mean_{b,f}(l[b, f] w[idx[b, f]])

with ``w`` a flat Gaussian over the grid *index* (:func:`index_weights`, zero at index 0, largest mid-grid).
Diffusion forcing (DFSFT) denoises all blocks in one block-causal forward, each seeing the *noisy* earlier blocks;
teacher forcing (TFSFT, ``teacher_forcing``) shows each noisy block the *clean* earlier blocks instead
(``model.causal.apply_teacher_forced``), which needs a model attending to all earlier blocks (window -1).

Noise and chunk indices come from ``fold_in(step_key, global_sample_index)``, so a sample draws the same numbers
whatever the number of ranks or micro-batches. The update is ``fvx.core.role``'s, as in fine-tuning
(``fvx_methods.finetune``); validation samples the student as it runs, block by block on its KV cache.
"""
from __future__ import annotations

import functools
from typing import Annotated, Mapping

import msgspec
import torch

from fvx.config import Config
from fvx.core import flow, random, role
from fvx.core.state import Batch, Program
from fvx_methods.library import one_role
from fvx_models import streaming
from fvx_models.model import Model, Params

STUDENT = one_role.STUDENT
Ratio = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


# ---------------------------------------------------------------------------------------------------------- the loss


def index_range(min_ratio: float, max_ratio: float, n: int = flow.NUM_TRAIN_TIMESTEPS) -> tuple[int, int]:
    """The inclusive grid-index range ``[lo, hi]`` of the ratios: each ``int(ratio n)`` clipped to ``[0, n - 1]``,
    and ``hi = min(n - 1, lo + 1)`` when that leaves ``hi <= lo`` (so the range holds two indices but at the end)."""
    lo = min(max(int(min_ratio * n), 0), n - 1)
    hi = min(max(int(max_ratio * n), 0), n - 1)
    return lo, (min(n - 1, lo + 1) if hi <= lo else hi)


def index_weights(n: int = flow.NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """The loss weight of each grid index ``[n]`` fp32: ``y = exp(-2 ((i - n/2) / n)^2)``, ``y -= min(y)``, scaled
    to mean 1 (``w = y n / sum(y)``)."""
    i = torch.arange(n, dtype=torch.float32)
    y = torch.exp(-2 * ((i - n / 2) / n) ** 2)
    y = y - y.min()
    return y * n / y.sum()


def chunk_indices(keys: torch.Tensor, frames: int, chunk: int, lo: int, hi: int) -> torch.Tensor:
    """Grid indices ``[B, frames]`` int64: per sample (its key of ``keys [B, 2]``) one uniform draw in ``[lo, hi]``
    per chunk of ``chunk`` frames, repeated over the chunk (``frames`` a multiple of ``chunk``)."""
    per_chunk = random.randint_each(keys, (frames // chunk,), lo, hi + 1)
    return per_chunk.repeat_interleave(chunk, dim=1)


def velocity(params: Params, x_t: torch.Tensor, t: torch.Tensor, batch: Batch, x0: torch.Tensor, *, model: Model,
             teacher_forcing: bool) -> torch.Tensor:
    """The student's velocity ``[B, C, T, H, W]`` fp32 at per-frame timesteps ``t [B, T]``: one block-causal
    forward over the noisy blocks, or (teacher forcing) over ``[clean x0 | noisy x_t]``."""
    if teacher_forcing:
        return model.causal.apply_teacher_forced(params, x_t, t, batch["cond"], clean=x0).float()
    return model.apply(params, x_t, t, batch["cond"]).float()


def loss_fn(params: Params, batch: Batch, key: torch.Tensor, *, model: Model,
            config: DFSFT) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DFSFT (or TFSFT) loss of ``batch`` (latents ``[B, C, T, H, W]`` with ``T`` a multiple of
    ``chunk_size``, the model's cond, sample_index ``[B]``) under the step key; aux holds the mean drawn ``sigma``."""
    x0 = model.normalize(batch["latents"].float())
    noise, t_keys = flow.per_sample_noise(key, batch["sample_index"], tuple(x0.shape[1:]), x0.device)
    lo, hi = index_range(config.min_timestep_ratio, config.max_timestep_ratio)
    idx = chunk_indices(t_keys, x0.shape[2], config.chunk_size, lo, hi).to(x0.device)
    sigma = flow.training_sigmas(config.flow_shift, device=x0.device)[idx]  # [B, T]
    frame_sigma = sigma[:, None, :, None, None]
    x_t = flow.add_noise(x0, noise, frame_sigma)
    v = velocity(params, x_t, flow.to_timestep(sigma), batch, x0, model=model,
                 teacher_forcing=config.teacher_forcing)
    if config.precondition_outputs:
        residual = flow.x0_from_velocity(x_t, v, frame_sigma) - x0
    else:
        residual = v - flow.velocity_target(x0, noise)
    per_frame = residual.pow(2).mean(dim=(1, 3, 4))  # [B, T]
    loss = torch.mean(per_frame * index_weights().to(x0.device)[idx])
    return loss, {"sigma": sigma.mean()}


# -------------------------------------------------------------------------------------------------------- the build


class DFSFTRoles(Config):
    """Which of the experiment's models plays each role."""

    student: str = "student"


class DFSFT(one_role.OneRoleConfig, tag="dfsft"):
    """Knobs of diffusion-forcing SFT (spec §2.2); ``teacher_forcing`` makes it teacher-forcing SFT (§2.3).

    chunk_size: latent frames sharing one noise level; must be the student's block (``frames_per_block``), and the
        data's latent frames a whole number of chunks.
    min_timestep_ratio / max_timestep_ratio: the grid-index window ``[int(1000 min), int(1000 max)]`` (index 0 is the
        noisiest level) the chunks draw from (:func:`index_range`).
    flow_shift: the training grid's shift (the model's, 3 for Wan; not the validation pipeline's).
    precondition_outputs: as in fine-tuning (``Finetune``); and the one-role knobs (optimizer, gradient accumulation,
    EMA: ``fvx_methods.library.one_role.OneRoleConfig``).
    """

    roles: DFSFTRoles = DFSFTRoles()
    chunk_size: Annotated[int, msgspec.Meta(ge=1)] = 3
    min_timestep_ratio: Ratio = 0.0
    max_timestep_ratio: Ratio = 1.0
    teacher_forcing: bool = False
    precondition_outputs: bool = False
    flow_shift: Annotated[float, msgspec.Meta(gt=0)] = 3.0

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"method.chunk_size must be an int >= 1, got {self.chunk_size!r}")
        for name in ("min_timestep_ratio", "max_timestep_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"method.{name} = {getattr(self, name)} must lie in [0, 1]")
        if self.max_timestep_ratio < self.min_timestep_ratio:
            raise ValueError(f"method.max_timestep_ratio = {self.max_timestep_ratio} is below "
                             f"method.min_timestep_ratio = {self.min_timestep_ratio}")
        super().__post_init__()

    @property
    def name(self) -> str:
        return "TFSFT (teacher_forcing)" if self.teacher_forcing else "DFSFT"

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None) -> Program:
        """The loop's program for the student's model (``models["student"]``, block-causal, blocks of
        ``chunk_size`` frames: checked now, before any weight loads) and the run length. Validation samples the
        student as it runs: block by block from noise on the many-step ODE, each block attending to the KV cache
        of the clean blocks before it, at the validation's classifier-free guidance."""
        self.check_models(models)
        model = models[STUDENT]
        streamed = functools.partial(streaming.draw, model.causal, sampler="ode")
        return one_role.program(self, model, total_steps=total_steps, ranks=ranks, before_update=before_update,
                                loss=functools.partial(loss_fn, model=model, config=self),
                                check=lambda batch: check_batch(batch, model, self),
                                samplers=one_role.many_step_samplers(model, draw=streamed))

    def check_models(self, models: Mapping[str, Model]) -> None:
        """The student's refusals (:func:`check_student`), from its skeleton: :meth:`build` and the dry run call it."""
        check_student(models[STUDENT], self)

    def check_latent_frames(self, models: Mapping[str, Model], frames: int) -> None:
        """Samples of ``frames`` latent frames that are not whole chunks (:func:`check_chunks`: the batch check's, and
        the dry run's on the samples it estimates)."""
        check_chunks(frames, self)

    def sampling(self, role_name: str) -> dict | None:
        """How the student is sampled as trained (recorded on export): block-causally, block by block."""
        return {"sampler": "ode, block by block on a KV cache", "frames_per_block": self.chunk_size}


def check_student(model: Model, config: DFSFT) -> None:
    """A one-line ValueError unless ``model`` is block-causal with blocks of ``config.chunk_size`` frames (and, for
    teacher forcing, attends to every earlier block)."""
    where = f"models.{config.roles.student} ({model.name})"
    if model.causal is None:
        raise ValueError(f"{config.name} trains a block-causal model, but {where} is not causal (model.causal is "
                         "None); use a causal family's config")
    if config.chunk_size != model.causal.frames_per_block:
        raise ValueError(f"method.chunk_size = {config.chunk_size} must equal the block size of {where}, "
                         f"frames_per_block = {model.causal.frames_per_block}")
    if config.teacher_forcing and model.causal.window != -1:
        raise ValueError(f"method.teacher_forcing needs a model attending to all earlier blocks, but {where} attends "
                         f"to a window of {model.causal.window} frames (window -1 for all)")


def check_batch(batch: Batch, model: Model, config: DFSFT) -> None:
    """A one-line ValueError when the batch's latents do not fit the model or are not a whole number of chunks, or
    ``grad_accum`` does not divide it (once, before the first step)."""
    one_role.check_latents(batch, model)
    check_chunks(batch["latents"].shape[2], config)
    one_role.check_grad_accum(batch, config.grad_accum)


def check_chunks(frames: int, config: DFSFT) -> None:
    """A one-line ValueError when ``frames`` latent frames are not a whole number of chunks."""
    if frames % config.chunk_size:
        chunk, rest = config.chunk_size, frames % config.chunk_size
        fix = f"data.num_latent_t = {frames - rest}" if frames > chunk else f"clips of {chunk} latent frames or more"
        raise ValueError(f"batch latents have {frames} latent frames, not a whole number of method.chunk_size = "
                         f"{chunk} frames: FastVideo's training mask would end on a short block, frames "
                         f"[{frames - rest}, {frames}) (its Self-Forcing rollout puts the remainder first, its causal "
                         f"sampler refuses it), fvx requires frames % chunk_size == 0 (e.g. {fix})")
