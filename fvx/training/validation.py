"""Validation: sample fixed prompts from fixed noise with the params in hand, decode when a decoder is given, and log.

Generic: it knows no model family and no method. A caller supplies an ``apply_fn(params, x_t, t, cond) -> velocity``
(wrapped with ``flow.cfg`` for guidance), the params to sample with (used in place: nothing is copied), a schedule,
and optionally ``denormalize`` and a VAE's ``decode``; prompts are the model's ``cond`` (read through the model's
``load_cond`` and ``batch``, never by tensor name). Prompt ``i`` always gets the noise ``normal(fold_in(key, i))``
and, for the SDE sampler, the key ``fold_in(sampler_key, i)``, so every validation of a run (and of another run with
the same validation seed) starts from the same numbers, whatever the number of prompts. A typical call::

    prompts = read_prompts(config, dataset, model)
    noise_key, sampler_key = random.split(random.key(config.seed))
    noise = fixed_noise(noise_key, (prompts.count, *latent_shape(config, dataset)))
    if should_validate(config, step):
        latents, video = sample_videos(model.apply, params, noise, sigmas, prompts.cond,
                                       key=prompt_keys(sampler_key, len(noise)), sampler="sde",
                                       denormalize=model.denormalize, decode=vae.decode)
        log_validation(tracker, step, "student", latents, video, folder=run_dir / "validation", fps=config.fps,
                       captions=prompts.captions)

Prompts file (``prompts_file``): a cond file of the model's family (``fvx_models.cond``: its cond tensors ``[N, ...]``
and the captions as a JSON list in the file's metadata under ``captions``), as ``fvx_models.cond.save`` writes it.
"""
from __future__ import annotations

import math
import os
import pathlib
from typing import Annotated, Any, Callable, Literal, Mapping, NamedTuple, Sequence

import msgspec
import torch

from fvx.config import Config
from fvx.core import flow, random, unipc
from fvx.data import actions
from fvx.training import callbacks as fcallbacks
from fvx.training.tracking import Tracker

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]

PREVIEW_MIN_SIZE = 64  # latent previews are upscaled (nearest, whole factors) until their short side reaches this


class ValidationConfig(Config):
    """When and what to validate.

    ``every``: validate at steps that are multiples of it (0 disables validation entirely); ``at_start``: include
    step 0 (FastVideo's ``run_at_start``). Prompts: the first ``num_prompts`` of ``prompts_file`` (see the module
    docstring) or, without one, of the dataset (skipping samples whose text CFG dropout blanked). ``latent_shape``
    ``[C, T, H, W]`` to sample (default: the dataset's). ``num_steps`` and ``flow_shift`` give the many-step ODE
    schedule for models validated without a schedule of their own (fine-tuning, a DMD2 teacher): ``schedule``
    ``fvx``, FastVideo's evenly spaced levels (:func:`many_step_sigmas`), or ``diffusers``, the levels of diffusers'
    ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` (``flow.scheduler_sigmas``), which its pipelines sample
    with, or ``model``, the levels of the family's own pipeline (CogVideoX's DDIM: ``Model.rules.sampling_sigmas``),
    stretched to end at ``shift_terminal`` when set (LTX-Video's schedulers; :func:`schedule_sigmas`);
    ``solver`` ``euler`` steps along them, ``unipc`` is diffusers' ``UniPCMultistepScheduler`` in the flow
    configuration Wan's, SkyReels-V2's and Cosmos 2.5's folders ship, on its own levels (``fvx.core.unipc``;
    :func:`many_step_draw`), Karras' levels between ``karras = (sigma_min, sigma_max)`` when set (Cosmos 2.5's
    (0.01, 200)).
    ``guidance_scale`` is the classifier-free guidance ``uncond + g (cond - uncond)`` of the models a method samples
    with guidance (fine-tuning; FastVideo's t2v recipe validates at 5), the unconditional cond being
    ``cfg_uncond``'s: the cond file ``negative_prompt_path`` (``negative_prompt``), the family's zero cond, or the
    cond itself (``keep``). ``display_scale`` enlarges the logged videos (nearest neighbour; tiny clips); prompts
    whose cond has a ``keyboard`` (action data) get each frame's keys drawn on it after the scaling. ``seed`` fixes
    the noise, independently of the run's seed.
    """

    every: Annotated[int, msgspec.Meta(ge=0)] = 0
    at_start: bool = True
    num_prompts: PositiveInt = 4
    prompts_file: str | None = None
    latent_shape: tuple[PositiveInt, PositiveInt, PositiveInt, PositiveInt] | None = None
    num_steps: PositiveInt = 20
    flow_shift: PositiveFloat = 3.0
    schedule: Literal["fvx", "diffusers", "model"] = "fvx"
    shift_terminal: Annotated[float, msgspec.Meta(gt=0, lt=1)] | None = None
    solver: Literal["euler", "unipc"] = "euler"
    karras: tuple[PositiveFloat, PositiveFloat] | None = None
    guidance_scale: float = 1.0
    cfg_uncond: Literal["negative_prompt", "zero", "keep"] = "zero"
    negative_prompt_path: str | None = None
    fps: PositiveFloat = 16.0
    display_scale: PositiveInt = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.karras is not None and (self.solver != "unipc" or not self.karras[0] < self.karras[1]):
            raise ValueError(f"validation.karras = {self.karras}: Karras levels (sigma_min < sigma_max) are UniPC's; "
                             "set validation.solver=unipc")
        if not math.isfinite(self.guidance_scale):
            raise ValueError(f"validation.guidance_scale must be finite, got {self.guidance_scale}")
        if self.guidance_scale != 1.0 and self.cfg_uncond == "negative_prompt" and self.negative_prompt_path is None:
            raise ValueError("validation.cfg_uncond='negative_prompt' needs validation.negative_prompt_path (a cond "
                             "file); or use cfg_uncond='zero'")


class Prompts(NamedTuple):
    """Validation prompts: the model's ``cond`` with one row per prompt (fp32, CPU), captions when known, and the
    dataset samples they come from (None: from a prompts file)."""

    cond: dict[str, torch.Tensor]
    captions: tuple[str, ...] | None = None
    indices: tuple[int, ...] | None = None

    @property
    def count(self) -> int:
        return next(iter(self.cond.values())).shape[0]


# ---------------------------------------------------------------------------------------------------------- cadence


def should_validate(config: ValidationConfig, step: int) -> bool:
    """``every > 0``, ``step`` a multiple of ``every``, and ``step > 0`` unless ``at_start`` (FastVideo's rule)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return config.every > 0 and step % config.every == 0 and (step > 0 or config.at_start)


# ------------------------------------------------------------------------------------------------------ noise, keys


def prompt_keys(key: torch.Tensor, num: int) -> torch.Tensor:
    """One key per prompt, ``[num, 2]``: row ``i`` is ``fold_in(key, i)``, so it does not depend on ``num``."""
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"num must be an int >= 1, got {num!r}")
    return torch.stack([random.fold_in(key, i) for i in range(num)])


def fixed_noise(key: torch.Tensor, shape: Sequence[int] | Mapping[str, Sequence[int]], *,
                device: torch.device | str | None = None) -> Any:
    """Standard normal ``[N, C, T, H, W]`` fp32; prompt ``i``'s noise is ``normal(fold_in(key, i), [C, T, H, W])``.
    A joint model's dict of shapes ``{modality: [N, ...]}``: the first modality's noise from ``key``, modality ``m``'s
    from ``fold_in(key, m)``."""
    if isinstance(shape, Mapping):
        return {name: _normal_rows(key if m == 0 else random.fold_in(key, m), tuple(part), device)
                for m, (name, part) in enumerate(shape.items())}
    shape = tuple(shape)
    if len(shape) != 5 or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
        raise ValueError(f"shape must be [N, C, T, H, W] of positive ints, got {shape}")
    return _normal_rows(key, shape, device)


def _normal_rows(key: torch.Tensor, shape: tuple[int, ...], device: torch.device | str | None) -> torch.Tensor:
    keys = prompt_keys(key, shape[0])
    return torch.stack([random.normal(k, shape[1:], device=device) for k in keys])


def many_step_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """The ``num_steps``-step Euler schedule ``[K]`` fp32: the evenly spaced levels ``1 - k / K`` for
    ``k = 0..K-1``, shifted (``shift_sigma``); the samplers end at 0. It is how FastVideo's
    ``SelfForcingFlowMatchScheduler`` lays out its steps; diffusers' ``FlowMatchEulerDiscreteScheduler.set_timesteps``
    differs (it spaces from its smallest training level and applies the shift twice, design §2:
    ``flow.scheduler_sigmas``)."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    steps = [flow.NUM_TRAIN_TIMESTEPS * (num_steps - k) / num_steps for k in range(num_steps)]
    return flow.denoising_sigmas(steps, shift=shift, warp=True)


def schedule_sigmas(config: ValidationConfig, model: Any = None) -> torch.Tensor:
    """The many-step levels ``[K]`` of ``config``: ``num_steps`` at ``flow_shift`` as ``schedule`` lays them out
    (``model``: the family's own, ``model.rules.sampling_sigmas``), stretched to ``shift_terminal`` when set; UniPC's
    own levels for ``solver="unipc"``."""
    if config.solver == "unipc":
        return unipc.unipc_sigmas(config.num_steps, config.flow_shift, config.karras)
    if config.schedule == "model":
        own = None if model is None else model.rules.sampling_sigmas
        if own is None:
            raise ValueError(f"validation.schedule=model (sample --schedule model): "
                             f"{getattr(model, 'name', 'the model')} has no sampling schedule of its own; use fvx or "
                             "diffusers")
        sigmas = own(config.num_steps)
    else:
        sigmas = (flow.scheduler_sigmas(config.flow_shift, config.num_steps) if config.schedule == "diffusers"
                  else many_step_sigmas(config.num_steps, config.flow_shift))
    return sigmas if config.shift_terminal is None else flow.stretch_to_terminal(sigmas, config.shift_terminal)


def many_step_draw(config: ValidationConfig, apply_fn: flow.ApplyFn) -> Callable[..., torch.Tensor] | None:
    """A :class:`Sampler`'s ``draw`` for ``config.solver``: None for Euler (``flow.sample`` on the sampler's
    levels), else UniPC on its levels, guided when ``guidance`` is given, the model called as the pipelines call it:
    at the scheduler's int timesteps (Wan's), or on Karras levels at the level itself (Cosmos 2.5's passes
    ``sigmas[i]``; fvx's ``1000 sigma``)."""
    if config.solver == "euler":
        return None
    sigmas = unipc.unipc_sigmas(config.num_steps, config.flow_shift, config.karras)
    timesteps = (None if config.karras is not None
                 else unipc.unipc_timesteps(config.num_steps, config.flow_shift, config.karras))

    def draw(params: Any, noise: torch.Tensor, cond: Any, key: torch.Tensor, guidance: Any = None) -> torch.Tensor:
        apply = apply_fn if guidance is None else guided(apply_fn, guidance[0], guidance[1])
        return unipc.unipc_sample(apply, params, noise, sigmas.to(noise.device), cond=cond, timesteps=timesteps)

    return draw


# ---------------------------------------------------------------------------------------------------------- prompts


def read_prompts(config: ValidationConfig, dataset: Any, model: Any) -> Prompts:
    """The ``config.num_prompts`` validation prompts, from ``config.prompts_file`` (a cond file of ``model``'s family,
    read by ``model.load_cond``) or else from ``dataset``: the first samples in index order that CFG dropout did not
    blank, as ``model.batch`` makes their cond."""
    if config.prompts_file is not None:
        path = config.prompts_file
        if not pathlib.Path(path).is_file():
            raise ValueError(f"validation.prompts_file {path!r} does not exist")
        cond, captions = model.load_cond(path)
        count = next(iter(cond.values())).shape[0]
        if config.num_prompts > count:
            raise ValueError(f"validation.num_prompts={config.num_prompts}, but validation.prompts_file {path!r} "
                             f"holds only {count} prompts")
        keep = slice(0, config.num_prompts)
        return Prompts({name: t[keep].float() for name, t in cond.items()},
                       None if captions is None else captions[keep])
    if dataset is None:
        raise ValueError("validation needs prompts: set validation.prompts_file or pass the dataset")
    return _dataset_prompts(dataset, config.num_prompts, model)


def _dataset_prompts(dataset: Any, num: int, model: Any) -> Prompts:
    conds: list[dict[str, torch.Tensor]] = []
    captions: list[str | None] = []
    indices_used: list[int] = []
    start = 0
    while len(conds) < num and start < len(dataset):
        indices = list(range(start, min(start + num, len(dataset))))
        batch = model.batch(dataset.read(indices))
        names = batch.get("caption") or [None] * len(indices)
        dropped = batch.get("cfg_dropped", torch.zeros(len(indices), dtype=torch.bool))
        for row, (blank, caption) in enumerate(zip(dropped.tolist(), names)):
            if not blank and len(conds) < num:
                conds.append({name: t[row] for name, t in batch["cond"].items()})
                captions.append(caption)
                indices_used.append(indices[row])
        start += len(indices)
    if len(conds) < num:
        raise ValueError(f"validation.num_prompts={num}, but the dataset has only {len(conds)} samples whose text "
                         f"CFG dropout did not blank (of {len(dataset)})")
    cond = {name: torch.stack([c[name] for c in conds]).float() for name in conds[0]}
    return Prompts(cond, tuple(captions) if all(c is not None for c in captions) else None, tuple(indices_used))


def latent_shapes(config: ValidationConfig, dataset: Any, model: Any) -> Any:
    """What to sample per prompt: :func:`latent_shape`, or for a joint model ``{modality: shape}``, the video's and
    each other modality's from the dataset's first sample (its ``<modality>_latents``)."""
    video = latent_shape(config, dataset)
    if not getattr(model, "joint", False):
        return video
    batch = {} if dataset is None or len(dataset) == 0 else dataset.read([0])
    shapes = {"video": video}
    for name in list(model.modalities)[1:]:
        if f"{name}_latents" not in batch:
            raise ValueError(f"validation of model {model.name} samples {name} too and takes its latents' shape from "
                             f"the data's first sample, which has no {name}_latents (data.kind=t2va, or i2va)")
        shapes[name] = tuple(int(size) for size in batch[f"{name}_latents"].shape[1:])
    return shapes


def latent_shape(config: ValidationConfig, dataset: Any = None) -> tuple[int, int, int, int]:
    """``[C, T, H, W]`` to sample: ``config.latent_shape``, else the shape of the dataset's first latents."""
    if config.latent_shape is not None:
        return tuple(config.latent_shape)
    if dataset is None or len(dataset) == 0:
        raise ValueError("validation.latent_shape is not set and there is no dataset to take it from")
    batch = dataset.read([0])
    if "latents" not in batch:
        raise ValueError("validation.latent_shape must be set for data without latents (text_only)")
    return tuple(int(s) for s in batch["latents"].shape[1:])


# --------------------------------------------------------------------------------------------------------- sampling


def sample_videos(
    apply_fn: flow.ApplyFn,
    params: Any,
    noise: torch.Tensor,
    sigmas: Sequence[float] | torch.Tensor,
    cond: Any,
    *,
    key: torch.Tensor | None = None,
    sampler: str = "ode",
    denormalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
    decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
    draw: Callable[..., torch.Tensor] | None = None,
    guidance: tuple[Callable[[Any], Any], float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(latents ``[N, C, T, H, W]`` in the model's scale, video ``[N, 3, T', H', W']`` in [0, 1] or None).

    Samples ``noise`` along ``sigmas`` with ``flow.sample`` (``sampler`` "ode" or "sde"; ``key`` ``[2]`` or, to make
    each prompt independent of the others, ``prompt_keys(key, N)``) under ``torch.no_grad``, using ``params`` as they
    are, or with ``draw(params, noise, cond, key, guidance=guidance)`` when given. With ``decode``, the latents go
    through ``denormalize`` (when given) and then ``decode``. A joint model's noise and latents are dicts keyed by
    modality; its video latents are decoded.
    """
    with torch.no_grad():
        latents = (flow.sample(apply_fn, params, noise, sigmas, key, cond=cond, sampler=sampler) if draw is None
                   else draw(params, noise, cond, key, guidance=guidance))
        if decode is None:
            return latents, None
        clean = denormalize(latents) if denormalize is not None else latents
        video = decode(clean["video"] if isinstance(clean, Mapping) else clean)
    return latents, video


# ---------------------------------------------------------------------------------------------------------- logging


def latent_stats(latents: torch.Tensor) -> dict[str, float]:
    """Mean, standard deviation and mean absolute value over all elements of ``latents`` (in fp32)."""
    x = latents.detach().float()
    return {"latent_mean": x.mean().item(), "latent_std": x.std(correction=0).item(),
            "latent_mean_abs": x.abs().mean().item()}


def latent_preview(latents: torch.Tensor, min_size: int = PREVIEW_MIN_SIZE) -> torch.Tensor:
    """Frames ``[T, K, H', W']`` in [0, 1] of one latent ``[C, T, H, W]``: its first 3 channels as RGB (the first as
    grey when C < 3), each min-max normalised over the clip (0.5 where constant), upscaled by a whole factor (nearest)
    until the short side reaches ``min_size``."""
    if not (isinstance(latents, torch.Tensor) and latents.dim() == 4):
        raise ValueError(f"latents must be [C, T, H, W], got {getattr(latents, 'shape', type(latents).__name__)}")
    x = latents.detach().float().cpu()[: 3 if latents.shape[0] >= 3 else 1]
    low = x.amin(dim=(1, 2, 3), keepdim=True)
    span = x.amax(dim=(1, 2, 3), keepdim=True) - low
    x = torch.where(span > 0, (x - low) / torch.where(span > 0, span, 1.0), 0.5)
    factor = max(1, math.ceil(min_size / min(x.shape[-2:])))
    x = x.repeat_interleave(factor, dim=-2).repeat_interleave(factor, dim=-1)
    return x.permute(1, 0, 2, 3).contiguous()


def log_validation(
    tracker: Tracker,
    step: int,
    tag: str,
    latents: torch.Tensor,
    video: torch.Tensor | None,
    *,
    folder: str | os.PathLike | None = None,
    fps: float = 16.0,
    captions: Sequence[str] | None = None,
) -> list[pathlib.Path]:
    """Log one validation: per prompt ``i`` an animated GIF image summary ``validation/<tag>/prompt_<i>`` of the
    decoded ``video`` ``[N, 3, T, H, W]``, or without a video ``validation/<tag>/latents_<i>`` of
    :func:`latent_preview`; always the scalars ``validation/<tag>/<latent_stats>``; the captions as text when given.

    With ``folder`` (the run's validation folder) each clip is also written to ``<folder>/step_<step>/`` (GIF, PNG
    of the first frame, MP4 when an encoder is installed), named by its prompt: ``<tag>_prompt_<i>_<caption
    slug>_<step>``. Returns the paths written.
    """
    if not (isinstance(latents, torch.Tensor) and latents.dim() == 5):
        raise ValueError(f"latents must be [N, C, T, H, W], got {getattr(latents, 'shape', type(latents).__name__)}")
    if video is not None and not (isinstance(video, torch.Tensor) and video.dim() == 5
                                  and video.shape[0] == latents.shape[0] and video.shape[1] in (1, 3)):
        got = getattr(video, "shape", type(video).__name__)
        raise ValueError(f"video must be [N, 3, T, H, W] with N = {latents.shape[0]} (one per latent), got {got}")
    out = pathlib.Path(folder) / f"step_{step}" if folder is not None else None
    prefix = f"validation/{tag}"
    paths: list[pathlib.Path] = []
    for i in range(latents.shape[0]):
        if video is not None:
            frames, name = video[i].permute(1, 0, 2, 3), f"{prefix}/prompt_{i}"
        else:
            frames, name = latent_preview(latents[i]), f"{prefix}/latents_{i}"
        paths += tracker.video(step, name, frames, fps=fps, folder=out, label=None if captions is None else captions[i])
    tracker.scalars(step, {f"{prefix}/{name}": value for name, value in latent_stats(latents).items()})
    if captions is not None:
        tracker.text(step, f"{prefix}/captions", "\n".join(f"- prompt_{i}: {c}" for i, c in enumerate(captions)))
    return paths


def log_audio(tracker: Tracker, step: int, tag: str, waveforms: torch.Tensor, sample_rate: int, *,
              folder: str | os.PathLike | None = None, captions: Sequence[str] | None = None) -> list[pathlib.Path]:
    """Log one validation's sound: per prompt ``i`` of ``waveforms`` ``[N, C, S]`` in [-1, 1] an audio summary
    ``validation/<tag>/audio_<i>`` and, with ``folder``, a ``.wav`` beside the prompt's GIF; returns the paths."""
    out = pathlib.Path(folder) / f"step_{step}" if folder is not None else None
    paths: list[pathlib.Path] = []
    for i in range(waveforms.shape[0]):
        paths += tracker.audio(step, f"validation/{tag}/audio_{i}", waveforms[i], sample_rate, folder=out,
                               label=None if captions is None else captions[i])
    return paths


# ---------------------------------------------------------------------------------------------------------- the loop's


class Sampler(NamedTuple):
    """One model a method asks to validate: ``tag`` (e.g. "student"), its ``apply(params, x_t, t, cond)`` and
    ``params`` (used as they are, no copy), the sigma schedule, the sampler kind (``"ode"`` or ``"sde"``), and
    whether to sample it with the validation's classifier-free guidance (``guided``). ``draw(params, noise, cond,
    key, guidance=None) -> latents`` replaces ``flow.sample`` when set (a streaming model sampled block by block; it
    owns its schedule; ``guidance`` is ``(uncond, scale)`` for a guided one). ``score(videos, captions) -> {name:
    [N]}``: per-sample scores of the decoded videos (an RL method's rewards), logged as their means and written
    into each video's caption. ``fixed``: its params never change during the run (a frozen teacher), so it is
    sampled at the first validation of each launch only (the same prompts and noise would give the same videos)."""

    tag: str
    apply: flow.ApplyFn
    params: Any
    sigmas: Sequence[float] | torch.Tensor
    sampler: str = "ode"
    guided: bool = False
    draw: Callable[..., torch.Tensor] | None = None
    score: Callable[[torch.Tensor, list[str]], dict[str, torch.Tensor]] | None = None
    fixed: bool = False


class Validator(NamedTuple):
    """What a run validates with, fixed once at its start: prompts, noise and keys are the same at every validation;
    ``uncond(cond)`` is the unconditional cond guided samplers use; ``quality(video)`` scores decoded samples when the
    dataset knows how (``sample_quality(videos, indices)``, e.g. ``fvx.data.toy_world``), logged beside the videos.
    A joint model's other modality: ``audio``, its decoder (``decode(latents) -> waveforms [N, C, S]``,
    ``sample_rate``), and ``audio_quality(waveforms)``, the dataset's scores of them (``audio_quality``)."""

    config: ValidationConfig
    prompts: Prompts
    noise: torch.Tensor
    keys: torch.Tensor
    denormalize: Callable[[torch.Tensor], torch.Tensor] | None
    decode: Callable[[torch.Tensor], torch.Tensor] | None
    folder: pathlib.Path | None
    uncond: Callable[[Any], Any] | None = None
    quality: Callable[[torch.Tensor], dict[str, float]] | None = None
    audio: Any = None
    audio_quality: Callable[[torch.Tensor], dict[str, float]] | None = None


def guided(apply_fn: flow.ApplyFn, uncond: Callable[[Any], Any], guidance_scale: float) -> flow.ApplyFn:
    """``apply_fn`` under classifier-free guidance: ``uncond + g (cond - uncond)`` of the velocities, the
    unconditional call on ``uncond(cond)``; ``apply_fn`` itself when ``g == 1``."""
    if guidance_scale == 1.0:
        return apply_fn

    def apply(params: Any, x_t: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
        return flow.cfg(apply_fn(params, x_t, t, cond), apply_fn(params, x_t, t, uncond(cond)), guidance_scale)

    return apply


def make_validator(config: ValidationConfig, dataset: Any, model: Any, *,
                   decode: Callable[[torch.Tensor], torch.Tensor] | None = None, audio: Any = None,
                   folder: str | os.PathLike | None = None) -> Validator:
    """Read the prompts (in ``model``'s cond) and draw the noise (from ``key(config.seed)``) that every validation of
    the run reuses; decoded videos go through ``model.denormalize`` then ``decode``; a joint model's audio through
    ``audio.decode``."""
    prompts = read_prompts(config, dataset, model)
    noise_key, sampler_key = random.split(random.key(config.seed))
    shapes = latent_shapes(config, dataset, model)
    noise = fixed_noise(noise_key, {name: (prompts.count, *shape) for name, shape in shapes.items()}
                        if isinstance(shapes, Mapping) else (prompts.count, *shapes))
    negative = (None if config.negative_prompt_path is None
                else model.load_negative(config.negative_prompt_path, "validation.negative_prompt_path"))

    def uncond(cond: Any) -> Any:
        return model.uncond(cond, config.cfg_uncond, negative)

    score, hear = getattr(dataset, "sample_quality", None), getattr(dataset, "audio_quality", None)
    quality = (None if score is None or decode is None or prompts.indices is None
               else lambda video: score(video, prompts.indices))
    audio_quality = (None if hear is None or audio is None or prompts.indices is None
                     else lambda waveforms: hear(waveforms, prompts.indices))
    return Validator(config, prompts, noise, prompt_keys(sampler_key, prompts.count), model.denormalize, decode,
                     None if folder is None else pathlib.Path(folder), uncond, quality,
                     audio if isinstance(shapes, Mapping) else None, audio_quality)


def draw(entry: Sampler, noise: Any, cond: Any, keys: torch.Tensor, uncond: Callable[[Any], Any] | None,
         guidance_scale: float, *, denormalize: Callable[[Any], Any] | None = None,
         decode: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[Any, torch.Tensor | None]:
    """(latents, video or None) of ``entry`` from ``noise`` and ``cond`` (:func:`sample_videos`), under classifier-free
    guidance at ``guidance_scale`` with ``uncond`` when the sampler is guided."""
    apply_fn, guidance = entry.apply, None
    if entry.guided and uncond is not None:
        apply_fn = guided(entry.apply, uncond, guidance_scale)
        guidance = (uncond, guidance_scale)
    return sample_videos(apply_fn, entry.params, noise, entry.sigmas, cond, key=keys, sampler=entry.sampler,
                         denormalize=denormalize, decode=decode, draw=entry.draw, guidance=guidance)


def validate(validator: Validator, tracker: Tracker, step: int, samplers: Sequence[Sampler]) -> None:
    """Sample every ``samplers`` entry from the fixed noise and prompts, decode when a decoder is set, and log it."""
    for entry in samplers:
        latents, video = draw(entry, validator.noise, validator.prompts.cond, validator.keys, validator.uncond,
                              validator.config.guidance_scale, denormalize=validator.denormalize,
                              decode=validator.decode)
        if isinstance(latents, Mapping):
            _log_sound(validator, tracker, step, entry.tag, latents)
            latents = latents["video"]
        if validator.quality is not None and video is not None:
            tracker.scalars(step, {f"validation/{entry.tag}/{name}": value
                                   for name, value in validator.quality(video).items()})
        captions = validator.prompts.captions
        if entry.score is not None and video is not None:
            captions, scores = scored_captions(entry.score, video, captions)
            tracker.scalars(step, {f"validation/{entry.tag}/{name}": value for name, value in scores.items()})
        scale = validator.config.display_scale
        if video is not None and scale > 1:
            video = video.repeat_interleave(scale, dim=-1).repeat_interleave(scale, dim=-2)
        keyboard = validator.prompts.cond.get("keyboard")
        if video is not None and keyboard is not None:  # action data: each frame's keys drawn on it, after scaling
            video = actions.overlay_batch(video, keyboard)
        log_validation(tracker, step, entry.tag, latents, video, folder=validator.folder, fps=validator.config.fps,
                       captions=captions)


def _log_sound(validator: Validator, tracker: Tracker, step: int, tag: str,
               latents: Mapping[str, torch.Tensor]) -> None:
    """A joint sample's audio: decoded and logged when the run has an audio decoder, scored when the data can."""
    if validator.audio is None:
        return
    clean = validator.denormalize(latents) if validator.denormalize is not None else latents
    with torch.no_grad():
        waveforms = validator.audio.decode(clean["audio"]).float().clamp(-1, 1)
    if validator.audio_quality is not None:
        tracker.scalars(step, {f"validation/{tag}/{name}": value
                               for name, value in validator.audio_quality(waveforms).items()})
    log_audio(tracker, step, tag, waveforms, validator.audio.sample_rate, folder=validator.folder,
              captions=validator.prompts.captions)


def scored_captions(score: Callable[[torch.Tensor, list[str]], dict[str, torch.Tensor]], video: torch.Tensor,
                    captions: Sequence[str] | None) -> tuple[list[str], dict[str, float]]:
    """``("k: v | ... | caption" per video, {"reward/<k>": mean})`` of ``score``'s per-sample scores of ``video``
    (FastVideo's RL validation captions)."""
    prompts = list(captions) if captions is not None else [""] * video.shape[0]
    values = score(video, prompts)
    texts = [" | ".join([*(f"{k}: {float(v[i]):.4g}" for k, v in values.items()), prompts[i][:1000]])
             for i in range(video.shape[0])]
    return texts, {f"reward/{k}": float(v.float().mean()) for k, v in values.items()}


def callback(validator: Validator, samplers_of: Callable[[Any, Any, ValidationConfig], Sequence[Sampler]],
             others: Sequence[fcallbacks.Callback] = ()) -> fcallbacks.Callback:
    """Validation as a callback: after every ``validator.config.every`` updates (and before the first step of a fresh
    run with ``at_start``) it samples ``samplers_of(state, frozen, config)`` (the method's ``Program.validate``)
    and logs them, between the ``on_validation_begin`` and ``on_validation_end`` hooks of ``others``; a ``fixed``
    sampler only the first time."""
    logged_fixed: set[str] = set()  # the tags of fixed samplers this launch has logged

    def run(context: fcallbacks.Context) -> None:
        if not should_validate(validator.config, context.step):
            return
        fcallbacks.call(others, "on_validation_begin", context)
        samplers = [entry for entry in samplers_of(context.state, context.frozen, validator.config)
                    if not (entry.fixed and entry.tag in logged_fixed)]
        validate(validator, context.tracker, context.step, samplers)
        logged_fixed.update(entry.tag for entry in samplers if entry.fixed)
        fcallbacks.call(others, "on_validation_end", context)

    def at_start(context: fcallbacks.Context) -> None:
        if context.step == 0:  # a resumed run validated at its start step before
            run(context)

    return fcallbacks.Callback("validation", on_train_start=at_start, on_step_end=run)
