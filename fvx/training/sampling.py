"""The ``sample`` command: prompts in, videos a person can watch out, from a run folder or an exported folder.

The sampler is the one the run validates the role with (the method's ``Program.validate``: a fine-tuned model's
guided many-step ODE, a DMD2 student's few-step SDE, a flow map's jumps, a causal student streamed block by block on
its KV cache), so ``sample`` and validation share one code path; the request only changes validation's knobs (steps,
guidance, shift, schedule, negative prompt) and the latent shape. Prompts go through the family's text encoder
(``fvx_models.encoders``; the toy world's own for the CPU defaults), the latents through the experiment's ``vae`` or the
family's VAE from the base folder.

Keys. Video ``i`` (prompt ``i // n``, repeat ``i % n``) has the seed ``seed + i``; its noise is
``normal(fold_in(split(key(seed + i))[0], 0))`` and its sampler key ``fold_in(split(key(seed + i))[1], 0)`` (what
validation draws for its first prompt with that seed), so a video does not depend on the others in its batch, and
``samples.json`` beside the files says how to make any of them again.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import msgspec
import torch

from fvx import config as fconfig
from fvx.core import random, tree
from fvx.core.state import RoleState, TrainState
from fvx.data import actions, datasets, media, preprocess, sections
from fvx.storage import files
from fvx.training import (export as fexport, preprocessing, progress as fprogress, run_folder, tracking, validation,
                          wav)
from fvx.training.experiment import build_models, role_configs, run_keys
from fvx.training.sample_inputs import (ACTIONS_KIND, ANIMATE_KIND, SECTIONS_KIND, Start, animation_condition,
                                        given_condition, made_clip, made_cut, noised_start, read_actions,
                                        read_animation, read_control, read_first_frame, read_last_image, read_video,
                                        reflect_pad, section_shape, video_chunks, video_frames, video_shape)

SAMPLES = "samples.json"
SCHEDULES = ("fvx", "diffusers", "model")
SOLVERS = ("euler", "unipc")


class Request(NamedTuple):
    """What ``sample`` is asked for (the command's options; None: as the run validates)."""

    source: str
    prompts: tuple[str, ...]
    overrides: tuple[str, ...] = ()  # dotted overrides of the run's config (e.g. a streaming model's window)
    out: str | None = None
    step: int | None = None
    role: str | None = None
    ema: bool = False
    base: str | None = None
    seed: int = 0
    num_per_prompt: int = 1
    batch_size: int = 1
    frames: int | None = None
    height: int | None = None
    width: int | None = None
    steps: int | None = None
    guidance: float | None = None
    shift: float | None = None
    schedule: str | None = None
    shift_terminal: float | None = None
    solver: str | None = None
    karras: tuple[float, float] | None = None
    negative_prompt: str | None = None
    jumps: int | None = None
    image: str | None = None
    last_image: str | None = None  # FramePack's (inverted anti-drifting sections) last frame to aim for
    video: str | None = None  # a video Helios continues (its chunks)
    actions: str | None = None  # a Matrix-Game model's action file (data.kind=matrixgame2)
    control: str | None = None  # a VACE model's control video (data.kind=vace), its mask and reference image
    mask: str | None = None
    reference: str | None = None
    pose: str | None = None  # a Wan-Animate model's pose and face videos (data.kind=animate), its character --image
    face: str | None = None
    background: str | None = None  # with --mask: the replace mode's background video
    gif: bool = False
    scale: int = 1
    fps: float | None = None


class Source(NamedTuple):
    """The model to sample: the run's config (an export's weights in place of its role's model), the role, its
    checkpoint step and EMA flag, where it came from (for people), and ``weights()``, which loads its whole params."""

    config: Any
    role: str
    step: int
    ema: bool
    where: str
    weights: Callable[[], Any]


class Video(NamedTuple):
    """One video to make: its prompt (index and text), seed and file stem."""

    prompt_index: int
    prompt: str
    seed: int
    stem: str


# ----------------------------------------------------------------------------------------------------------- input


def read_prompts_file(path: str) -> tuple[str, ...]:
    """The prompts of ``--prompts`` (``fvx.data.preprocess.read_prompts``: one a line, or FastVideo's validation
    JSON's captions); a one-line ValueError when it is missing, not UTF-8 text, malformed or holds none."""
    return tuple(preprocess.read_prompts(path, "--prompts"))


def open_source(request: Request) -> Source:
    """The run folder (its checkpoint ``request.step``, default the newest; ``role``; ``ema``) or exported folder
    (``fvx_export.json``: its run's config, the exported weights) ``request.source`` names; a ValueError naming what
    is missing, before any weight loads."""
    folder = pathlib.Path(request.source)
    if not folder.is_dir():
        raise ValueError(f"sample: {str(folder)!r} is neither a run folder nor an exported folder (no such folder)")
    if (folder / fexport.MANIFEST).is_file():
        return _export_source(folder, request)
    if not (folder / run_folder.CHECKPOINTS).is_dir() and not (folder / "run.json").is_file():
        raise ValueError(f"sample: {str(folder)!r} is neither a run folder (run.json, checkpoints/) nor an exported "
                         f"folder ({fexport.MANIFEST})")
    saved = fexport.role_checkpoint(folder, step=request.step, role=request.role, ema=request.ema, who="sample")
    config = fconfig.apply_overrides(saved.config, list(request.overrides))

    def weights() -> Any:
        return fexport.role_params(config, saved.role, saved.model, saved.read())

    where = f"run {folder}, step {saved.step}, role {saved.role}" + (" (EMA)" if request.ema else "")
    return Source(config, saved.role, saved.step, request.ema, where, weights)


def _export_source(folder: pathlib.Path, request: Request) -> Source:
    manifest = json.loads((folder / fexport.MANIFEST).read_text())
    given = [flag for flag, value in (("--step", request.step), ("--role", request.role),
                                      ("--ema", request.ema or None)) if value is not None]
    if given:
        raise ValueError(f"sample: {str(folder)!r} is an export of one role at one step; {given[0]} is for a run "
                         "folder")
    if manifest.get("adapters") or manifest.get("format") != "diffusers":
        what = "adapters" if manifest.get("adapters") else f"the {manifest.get('format')} layout"
        raise ValueError(f"sample: {str(folder)!r} holds {what}; sample the run folder ({manifest.get('run')}) or a "
                         "diffusers export of whole weights")
    run = pathlib.Path(manifest["run"])
    if not (run / "run.json").is_file():
        raise ValueError(f"sample: the export {str(folder)!r} was made from run {str(run)!r}, whose config (run.json) "
                         "sample reads to know the model and its sampler; that run folder is gone")
    config, role = fconfig.apply_overrides(run_folder.load_run(run), list(request.overrides)), manifest["role"]
    name = msgspec.structs.asdict(config.method.roles)[role]
    model = config.models[name]
    changes = {"path": str(folder)} | ({"lora": None} if getattr(model, "lora", None) is not None else {})
    config = msgspec.structs.replace(config, models={**config.models,
                                                     name: msgspec.structs.replace(model, **changes)})
    built = role_configs(config)[role].build()
    where = f"export {folder} (run {run}, step {manifest['step']}, role {role}{', EMA' if manifest['ema'] else ''})"
    return Source(config, role, int(manifest["step"]), bool(manifest["ema"]), where,
                  lambda: built.weights.load(str(folder)))


# ----------------------------------------------------------------------------------------------------------- plan


def validation_config(config: Any, request: Request, shape: tuple[int, int, int, int]) -> validation.ValidationConfig:
    """The run's validation knobs with the request's steps, guidance, shift, schedule and latent shape on top."""
    if request.schedule is not None and request.schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {request.schedule!r}")
    if request.solver is not None and request.solver not in SOLVERS:
        raise ValueError(f"--solver must be one of {', '.join(SOLVERS)}, got {request.solver!r}")
    changes = {name: value for name, value in (("num_steps", request.steps), ("guidance_scale", request.guidance),
                                                ("flow_shift", request.shift), ("schedule", request.schedule),
                                                ("shift_terminal", request.shift_terminal),
                                                ("solver", request.solver), ("karras", request.karras))
               if value is not None}
    for flag, value in (("--steps", request.steps), ("--shift", request.shift)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if request.shift_terminal is not None and not 0 < request.shift_terminal < 1:
        raise ValueError(f"--shift-terminal must be in (0, 1), got {request.shift_terminal}")
    return msgspec.structs.replace(config.validation, latent_shape=shape, **changes)


def latent_shape(config: Any, model: Any, request: Request) -> tuple[int, int, int, int]:
    """``[C, T, H, W]`` to sample: the run's validation shape (or its data's), with ``--frames``, ``--height`` and
    ``--width`` (pixels) converted through the VAE's compression; a ValueError for a size the family cannot make."""
    if None in (request.frames, request.height, request.width):
        channels, frames, height, width = _default_shape(config)
    else:
        channels, frames, height, width = model.latents.channels, 1, 1, 1
    stride_t, stride_h, stride_w = model.latents.vae_stride
    if request.frames is not None:
        if request.frames < 1 or (request.frames - 1) % stride_t:
            raise ValueError(f"--frames {request.frames}: {model.name} makes 1 + {stride_t} k frames "
                             f"(its VAE's {stride_t}x temporal compression), e.g. {1 + stride_t * max(1, frames - 1)}")
        frames = (request.frames - 1) // stride_t + 1
    for flag, value, stride, patch in (("--height", request.height, stride_h, model.patch_size[1]),
                                       ("--width", request.width, stride_w, model.patch_size[2])):
        if value is not None and (value < 1 or value % (stride * patch)):
            raise ValueError(f"{flag} {value} must be a positive multiple of {stride * patch} ({model.name}: the "
                             f"VAE's {stride}x and the patch's {patch}x)")
    height = height if request.height is None else request.height // stride_h
    width = width if request.width is None else request.width // stride_w
    return channels, frames, height, width


def _default_shape(config: Any) -> tuple[int, int, int, int]:
    if config.validation.latent_shape is not None:
        return tuple(config.validation.latent_shape)
    dataset, why = open_data(config)
    if dataset is not None:
        try:
            return validation.latent_shape(config.validation, dataset)
        except ValueError as error:
            why = str(error)
    raise ValueError(f"sample: the run's data, whose first clip's shape is the default, cannot be read ({why}); give "
                     "validation.latent_shape in the run, or --frames, --height and --width") from None


def open_data(config: Any) -> tuple[Any, str | None]:
    """(the run's dataset, None), or (None, why it cannot be opened here)."""
    try:
        return datasets.open_dataset(config.data, run_keys(config.run.seed)[1]), None
    except (ValueError, OSError) as error:
        return None, str(error)


def _trained_shape(config: Any, asked: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """The latent shape the run trained on (its data's first clip; ``asked`` when its data is not here)."""
    try:
        return _default_shape(config)
    except ValueError:
        return asked


def check_length(model: Any, shape: tuple[int, int, int, int], trained: tuple[int, int, int, int]) -> str | None:
    """A warning (or None) for a bidirectional model asked for more latent frames than it was trained on; a
    streaming model makes any whole number of its blocks (a ValueError otherwise)."""
    if model.causal is not None:
        size, stride, most = model.causal.frames_per_block, model.latents.vae_stride[0], model.causal.max_frames
        if shape[1] % size:
            fits = 1 + stride * (-(-shape[1] // size) * size - 1)
            raise ValueError(f"--frames: {model.name} streams blocks of {size} latent frames, and "
                             f"{1 + stride * (shape[1] - 1)} frames make {shape[1]}: not whole blocks (e.g. --frames "
                             f"{fits})")
        if most is not None and shape[1] > most:
            raise ValueError(f"--frames {1 + stride * (shape[1] - 1)} makes {shape[1]} latent frames, more than "
                             f"{model.name}'s position table holds ({most}: --frames {1 + stride * (most - 1)} "
                             "at most)")
        return None
    if shape[1] > trained[1]:
        return (f"{model.name} is bidirectional and was trained on {trained[1]} latent frames; {shape[1]} attend "
                "beyond what it saw (a streaming student makes any length)")
    return None


def videos(prompts: Sequence[str], num_per_prompt: int, seed: int) -> list[Video]:
    """Every video to make, in order: each prompt ``num_per_prompt`` times, video ``i`` with seed ``seed + i``,
    named ``<prompt slug>_<seed>``."""
    if num_per_prompt < 1:
        raise ValueError(f"--num-per-prompt must be >= 1, got {num_per_prompt}")
    out = []
    for p, prompt in enumerate(prompts):
        for r in range(num_per_prompt):
            index = p * num_per_prompt + r
            out.append(Video(p, prompt, seed + index, f"{tracking.slug(prompt) or 'prompt'}_{seed + index}"))
    return out


# --------------------------------------------------------------------------------------------------------- the model


class _OneRole(dict):
    """The frozen params of the one role ``sample`` draws: its base (empty: its params are whole); a method's
    validation asks for other roles' (a teacher's) only to sample them, which ``sample`` does not."""

    def __missing__(self, key: str) -> None:
        return None


def sampler_of(source: Source, models: Mapping[str, Any], params: Any, vcfg: validation.ValidationConfig,
               jumps: int | None) -> validation.Sampler:
    """The sampler the run's method validates ``source.role`` with (its ``Program.validate``), for ``params``."""
    config, method = source.config, source.config.method
    changes = {"validate_teacher": False} if hasattr(method, "validate_teacher") else {}
    if jumps is not None:
        changes.update(_jump_changes(method, models[source.role], jumps))
    method = msgspec.structs.replace(method, **changes)
    needed = {name: getattr(config, name, None) for name in getattr(method, "needs", ())}
    program = method.build(models, total_steps=config.run.steps, **needed)
    state = TrainState(step=torch.zeros((), dtype=torch.int64), key=random.key(0),
                       roles={source.role: RoleState(params, None, None)})
    entries = [entry for entry in program.validate(state, _OneRole(), vcfg) if not entry.fixed]
    if not entries:
        raise ValueError(f"sample: method {type(method).__name__} validates no sampler of role {source.role!r}")
    return next((entry for entry in entries if jumps is not None and entry.tag.endswith(f"{jumps}step")), entries[0])


def unused_options(request: Request, sampler: validation.Sampler) -> list[str]:
    """What the request sets that ``sampler`` does not read (a few-step student keeps its own schedule; an unguided
    sampler takes no guidance), one line each."""
    many_step = sampler.tag.startswith("model")
    given = [flag for flag, value in (
        ("--steps", request.steps), ("--shift", request.shift), ("--schedule", request.schedule),
        ("--shift-terminal", request.shift_terminal), ("--solver", request.solver), ("--karras", request.karras))
        if value is not None]
    lines = [] if many_step else [f"{flag} does not apply: the {sampler.tag!r} sampler keeps the schedule it was "
                                  "trained for" for flag in given]
    if not sampler.guided and (request.guidance is not None or request.negative_prompt is not None):
        lines.append(f"--guidance and --negative-prompt do not apply: the {sampler.tag!r} sampler is unguided")
    return lines


def _jump_changes(method: Any, model: Any, jumps: int) -> dict[str, Any]:
    if jumps < 1:
        raise ValueError(f"--jumps must be >= 1, got {jumps}")
    if not model.rules.two_time:
        raise ValueError(f"--jumps {jumps}: {model.name} has no second time input (not a flow map); it samples "
                         "with --steps")
    if hasattr(method, "sample_steps"):
        return {"sample_steps": (jumps,)}
    if hasattr(method, "student_sample_steps"):
        return {"student_sample_steps": jumps}
    raise ValueError(f"--jumps: method {type(method).__name__} samples its student on its own schedule")


# --------------------------------------------------------------------------------------------------------- sampling


def noise_and_keys(seeds: Sequence[int], shape: Any, segment: int = 0) -> tuple[Any, torch.Tensor]:
    """``(noise [N, ...], sampler keys [N, 2])`` of videos with ``seeds`` (module docstring); a joint model's
    ``shape`` is a dict of shapes and its noise a dict."""
    rows, keys = [], []
    for seed in seeds:
        noise_key, sampler_key = random.split(random.key(seed))
        noise_key = random.fold_in(noise_key, segment) if segment else noise_key  # an animation's later segments
        rows.append(validation.fixed_noise(noise_key, {name: (1, *part) for name, part in shape.items()}
                                           if isinstance(shape, Mapping) else (1, *shape)))
        keys.append(validation.prompt_keys(sampler_key, 1)[0])
    if isinstance(shape, Mapping):
        return {name: torch.cat([row[name] for row in rows]) for name in shape}, torch.stack(keys)
    return torch.cat(rows), torch.stack(keys)


def encoded_cond(config: Any, model: Any, encoder: Any, prompts: Sequence[str], clip: preprocess.Clip,
                 image: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The model's cond ``{name: [N, ...]}`` of ``prompts`` through ``encoder`` (as encode-prompts stores them), with
    ``image``'s condition (``sample_inputs.given_condition``) in every row; a model without text
    (data.kind=matrixgame2) takes ``image`` alone (its actions among it), the prompts naming the videos."""
    if config.data.kind == ACTIONS_KIND:
        raw = preprocessing.collated(config, [{"where": prompt, "caption": prompt, **image} for prompt in prompts])
    else:
        raw = preprocessing.encoded_prompts(config, encoder, list(prompts), clip, image)
    return {name: tensor.float() for name, tensor in model.batch(raw)["cond"].items()}




def draw_sections(sampler: validation.Sampler, noise: torch.Tensor, cond: dict[str, torch.Tensor], keys: torch.Tensor,
                  uncond: Any, guidance: float, config: sections.SectionsConfig,
                  given: Start | None) -> torch.Tensor:
    """Latents ``[N, C, T, H, W]`` of videos made a section at a time in ``config``'s making order
    (``fvx.data.sections``), each section sampled as validation samples (from its window of ``noise``) beside the
    history the frames made so far give it; ``given``: the video's given start (its image the first frame, or with
    Helios's noise, from each video's sampler key ``keys [N, 2]``, the chunks' condition alone: the latents made after
    it; its last image the frame the first section made sees after it, as ``HunyuanVideoFramepackPipeline`` puts
    ``last_image`` in its first section's 1x history; a given video's chunks, which the new sections follow), or
    None."""
    known = torch.zeros_like(noise)
    seen = None if given is None else noised_start(given, keys) if given.noised else given
    made_before = 0 if given is None or given.given is None else given.given.shape[2]  # a given video's chunks
    if seen is not None and seen.before is not None:
        known[:, :, :1] = seen.before
    if made_before:
        known[:, :, 1:1 + made_before] = seen.given
    order = [n for n in sections.making_order(sections.count(noise.shape[2], config), config)
             if sections.first_frame(config, n) > made_before]
    for i, n in enumerate(order):
        start, window = sections.first_frame(config, n), sections.section_frames(config)
        parts = [sections.history_of(row, n, config) for row in known]
        history = torch.stack([p["history"] for p in parts])
        if seen is not None:
            history[:, :, :1] = seen.image
        if i == 0 and seen is not None and seen.last is not None:  # the frame after it: the last image (1x)
            history[:, :, 1:2] = seen.last
        step_cond = {**cond, "framepack_history": history,
                     "frame_indices": torch.stack([p["frame_indices"] for p in parts]).to(noise.device)}
        made, _ = validation.draw(sampler, noise[:, :, start:start + window], step_cond, keys, uncond, guidance)
        known = torch.cat([known[:, :, :start], made.to(known.dtype), known[:, :, start + window:]], dim=2)
    if config.order == "one_frame":  # the frame made alone (decoded alone, as musubi-tuner decodes it)
        return known[:, :, 1:]
    if given is None:
        return known
    if made_before:  # the video made: the given chunks as given, then the new ones
        known[:, :, 1:1 + made_before] = given.given
    return torch.cat([given.image, known[:, :, 1:]], dim=2) if given.shown else known[:, :, 1:]



# ----------------------------------------------------------------------------------------------------------- output


def write_video(folder: pathlib.Path, stem: str, video: torch.Tensor, fps: float, *, gif: bool, scale: int,
                sound: tuple[torch.Tensor, int] | None = None,
                keyboard: torch.Tensor | None = None) -> list[pathlib.Path]:
    """One decoded video ``[3, T, H, W]`` in [0, 1] as ``<stem>.mp4`` (with its sound ``(waveform [C, S], rate)``
    as a track and a ``.wav``), and with ``gif`` a ``.gif``, upscaled ``scale`` times (nearest); with its keys
    ``keyboard [F, K]`` (action data) each frame's drawn on it after the scaling (``fvx.data.actions``)."""
    if scale > 1:
        video = video.repeat_interleave(scale, dim=-1).repeat_interleave(scale, dim=-2)
    if keyboard is not None:
        video = actions.overlay_keys(video, keyboard)
    frames = video.float().clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 3, 0).cpu().numpy()
    paths = [folder / f"{stem}.mp4"]
    audio = None if sound is None else (sound[0].float().clamp(-1, 1).cpu().numpy(), sound[1])
    media.write_mp4(paths[0], frames, fps, *(audio or ()))
    if gif:
        paths.append(folder / f"{stem}.gif")
        paths[-1].write_bytes(media.gif_bytes(frames, fps))
    if audio is not None:
        paths.append(wav.write_wav(folder / f"{stem}.wav", audio[0], audio[1]))
    return paths


def merge_samples(folder: pathlib.Path, rank: int, world: int, record: dict[str, Any]) -> bool:
    """Write this rank's entries; the last of the ``world`` ranks of one request to finish merges them into
    ``samples.json`` (True). A rank's file left by another request (other settings, or another world size) is not
    merged."""
    parts = folder / ".samples"
    parts.mkdir(exist_ok=True)
    files.write_json(parts / f"rank_{rank}_of_{world}.json", record)
    header = {name: value for name, value in record.items() if name != "videos"}
    records = []
    for other in range(world):
        path = parts / f"rank_{other}_of_{world}.json"
        found = json.loads(path.read_text()) if path.is_file() else None
        if found is None or {name: value for name, value in found.items() if name != "videos"} != header:
            return False
        records.append(found)
    videos = sorted((video for found in records for video in found["videos"]), key=lambda video: video["index"])
    files.write_json(folder / SAMPLES, {**record, "videos": videos})
    return True


def default_out(request: Request, source: Source) -> pathlib.Path:
    """``samples/<source folder's name>_step<N>``."""
    return pathlib.Path("samples") / f"{pathlib.Path(request.source).resolve().name}_step{source.step}"


class Plan(NamedTuple):
    """A checked request: what ``sample`` loads and makes (nothing loaded yet)."""

    request: Request
    source: Source
    model: Any  # the sampled role's model, built (no weights)
    models: dict[str, Any]  # role -> built model (no weights)
    sampler: validation.Sampler  # the run's validation sampler of the role, its params still to load
    shape: Any  # [C, T, H, W] of the video latents, or a joint model's {modality: shape}
    vcfg: validation.ValidationConfig
    image: Any  # the --image pixels, uint8 [1, H, W, 3], or None
    control: dict[str, Any] | None  # the --control, --mask and --reference pixels (an animation's --pose and --face,
    # padded to its last segment's end), or None
    front: int  # latent frames before the video's (a reference image's), dropped before decoding
    actions: dict[str, Any] | None  # the --actions rows of the video's frames ({keyboard, mouse} float32), or None
    encoder: Callable[[], Any]
    decoder: Callable[[], Callable[[torch.Tensor], torch.Tensor]]
    sound: Callable[[], Any] | None  # a joint model's audio decoder (``decode``, ``sample_rate``), or None
    out: pathlib.Path
    todo: list[Video]
    segments: tuple[int, ...] = ()  # an animation's segments: the first video frame of each
    frames: int | None = None  # an animation's video frames
    last: Any = None  # the --last-image pixels, uint8 [1, H, W, 3], or None
    video: Any = None  # the --video frames, uint8 [F, H, W, 3], or None


def plan(request: Request, say: Callable[[str], None] = print) -> Plan:
    """Every check of a request, before any weight loads: a one-line ValueError naming the culprit. A model without
    text (data.kind=matrixgame2) needs no prompt: its video is named after its ``--actions`` file."""
    if request.batch_size < 1 or request.scale < 1:
        raise ValueError("--batch-size and --scale must be >= 1")
    source = open_source(request)
    config = source.config
    if config.data.kind == ACTIONS_KIND and not request.prompts and request.actions is not None:
        request = request._replace(prompts=(pathlib.Path(request.actions).stem,))
    if not request.prompts and config.data.kind != ACTIONS_KIND:  # (an action file names its video)
        raise ValueError("sample: give --prompt TEXT or --prompts FILE")
    validated = config.method.held_roles()[0].name
    if source.role != validated:
        raise ValueError(f"sample: role {source.role!r} is not the model the method validates and samples "
                         f"({validated!r}); export it and train or sample it as a model of its own")
    models = build_models(config)
    model = models[source.role]
    image = read_first_frame(request.image, config.data.kind, model, config.data.sections)
    last = read_last_image(request.last_image, config.data.kind, model, config.data.sections)
    video = read_video(request.video, config.data.kind, model, config.data.sections, image)
    animating = config.data.kind == ANIMATE_KIND  # segments of the trained length, as many as --frames takes
    shape = latent_shape(config, model, request._replace(frames=None) if animating else request)
    if config.data.kind == SECTIONS_KIND:
        cut = config.data.sections
        given = 0 if video is None else video_chunks(len(video), model, cut) * cut.window
        shape = section_shape(cut, model, shape, request.frames, image if video is None else video, given)
    acts = read_actions(request.actions, config.data.kind, model, video_frames(model, shape))
    control = read_control(request, config.data.kind, model, video_frames(model, shape))
    segment = video_frames(model, shape)
    frames = (request.frames or segment) if animating else None
    starts = (preprocess.segment_starts(frames, segment, config.data.preprocess.animate.previous_frames,
                                      cover=True) if animating else ())
    animation = read_animation(request, config.data.kind, model, frames or segment)
    if animation is not None:  # the last segment's frames past the video's: padded as WanAnimatePipeline pads them
        animation = {name: reflect_pad(video, starts[-1] + segment) for name, video in animation.items()}
    control = control if animation is None else animation
    front = int(control is not None and "reference" in control)
    shape = (shape[0], shape[1] + front, *shape[2:]) if front else shape
    if acts is not None and request.negative_prompt is not None:
        raise ValueError(f"--negative-prompt: {model.name} reads no text (its guidance is on the actions)")
    warning = None if config.data.kind == SECTIONS_KIND else check_length(model, shape, _trained_shape(config, shape))
    if warning is not None:  # (a section model samples sections of the length it trained on)
        say(f"warning: {warning}")
    vcfg = validation_config(config, request, shape)
    if model.joint:
        shape = validation.latent_shapes(vcfg, open_data(config)[0], model)
    model.check_latents({name: (1, *part) for name, part in shape.items()} if model.joint else (1, *shape),
                        where="the latents to sample (--frames, --height, --width)")
    if vcfg.solver == "unipc" and (model.joint or model.causal is not None):
        raise ValueError(f"--solver unipc: {model.name} " + ("streams block by block" if model.causal is not None
                                                             else "denoises several modalities") +
                         ", which fvx samples with Euler steps only")
    sampler = sampler_of(source, models, {}, vcfg, request.jumps)  # its params come with the weights
    for line in unused_options(request, sampler):
        say(f"warning: {line}")
    out = pathlib.Path(request.out) if request.out is not None else default_out(request, source)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file, not a folder")
    sound = (lambda: config.build_audio_vae()) if model.joint and getattr(config, "audio_vae", None) else None
    return Plan(request, source, model, models, sampler, shape, vcfg, image, control, front, acts,
                preprocessing.prompt_encoder(config, source.role, request.base, config.data.kind),
                _decoder(config, source.role, request.base), sound, out,
                videos(request.prompts, request.num_per_prompt, request.seed), tuple(starts), frames, last, video)


def run_sample(request: Request, *, rank: int = 0, world: int = 1, progress: bool = True,
               say: Callable[[str], None] = print) -> dict[str, Any]:
    """``sample``: :func:`plan`, then this rank's videos (video ``i`` on rank ``i mod world``) into the output
    folder, and ``samples.json`` once every rank is done. Returns the folder, the entries, and this rank's latents
    and decoded frames."""
    p = plan(request, say)
    request, config, device = p.request, p.source.config, preprocessing.device()
    encoder = p.encoder()  # the text encoder first, then freed: it and the DiT are never held together (an animation
    # of several segments keeps it, its text encoder on the CPU, to encode the frames each segment begins with)
    given, first = given_condition(config.data.kind, encoder, p.image, p.control, p.actions,
                                   video_shape(p.shape), p.model, config.data.sections, p.last, p.video)
    fps = request.fps or config.validation.fps
    clip = made_clip(p.model, video_shape(p.shape), fps)  # what the prompts describe (a text that states it)
    cond = tree.to_device(encoded_cond(config, p.model, encoder, request.prompts, clip, given), device)
    uncond = _uncond(config, p.model, encoder, request.negative_prompt, clip._replace(negative=True), p.vcfg, device)
    segment_encoder = encoder if len(p.segments) > 1 else None  # a later segment encodes the frames made before it
    del encoder
    sampler = p.sampler._replace(params=tree.to_device(p.source.weights(), device))
    model, decoder, sound = p.models[p.source.role], p.decoder(), None if p.sound is None else p.sound()
    dataset = open_data(config)[0]  # the toy world scores its own prompts' videos and sounds
    judge, hear = getattr(dataset, "caption_quality", None), getattr(dataset, "caption_audio_quality", None)
    p.out.mkdir(parents=True, exist_ok=True)
    mine, entries, made = p.todo[rank::world], [], []
    bar = fprogress.bar(len(mine), desc="sample", unit="video", show=progress)
    for start in range(0, len(mine), request.batch_size):
        batch = mine[start:start + request.batch_size]
        noise, keys = tree.to_device(noise_and_keys([v.seed for v in batch], p.shape), device)
        rows = torch.tensor([v.prompt_index for v in batch], device=device)
        rows_cond = {name: t[rows] for name, t in cond.items()}
        if len(p.segments) > 1:  # an animation made and decoded segment by segment
            latents, video = draw_animation(p, sampler, segment_encoder, decoder, [v.seed for v in batch], noise,
                                            rows_cond, keys, uncond, config.data.preprocess.animate.previous_frames)
            waveforms = None
        else:
            if config.data.kind == SECTIONS_KIND:
                latents = draw_sections(sampler, noise, rows_cond, keys, uncond, p.vcfg.guidance_scale,
                                        made_cut(config.data.sections, p.image if p.video is None else p.video),
                                        None if first is None else first.to(device, len(batch)))
            else:
                latents, _ = validation.draw(sampler, noise, rows_cond, keys, uncond, p.vcfg.guidance_scale)
            latents = latents if not p.front else latents[:, :, p.front:]  # a reference image's frames are not video
            video, waveforms = decoded(model, decoder, sound, latents)
        made.append((tree.to_device(latents, "cpu"), video))
        for i, item in enumerate(batch):
            audio = None if waveforms is None else (waveforms[i], sound.sample_rate)
            keys = cond["keyboard"][item.prompt_index] if "keyboard" in cond else None
            paths = write_video(p.out, item.stem, video[i], fps, gif=request.gif, scale=request.scale, sound=audio,
                                keyboard=keys)
            entries.append({"index": p.todo.index(item), "prompt": item.prompt, "seed": item.seed,
                            "files": [path.name for path in paths]})
            score = {**({} if judge is None else world_score(judge, video[i:i + 1], item.prompt) or {}),
                     **({} if hear is None or waveforms is None else
                        world_score(hear, waveforms[i:i + 1], item.prompt) or {})}
            if score:
                entries[-1]["world_score"] = score
        bar.update(len(batch))
    bar.close()
    merge_samples(p.out, rank, world, _record(p, sampler, entries, fps, device))
    return {"folder": p.out, "videos": entries, "sampler": sampler.tag, "where": p.source.where,
            "latents": _cat([m[0] for m in made]), "frames": _cat([m[1] for m in made])}



def draw_animation(p: Plan, sampler: validation.Sampler, encoder: Any, decoder: Callable[[torch.Tensor], torch.Tensor],
                   seeds: list[int], noise: torch.Tensor, cond: dict[str, torch.Tensor], keys: torch.Tensor,
                   uncond: Any, previous: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Videos ``[N, 3, frames, H, W]`` in [0, 1] of an animation model made segment by segment, as
    ``WanAnimatePipeline`` makes them: segment ``n`` from its own noise (``noise`` for the first; its seed's key
    folded with ``n`` after), its pose and face frames, and after the first the last ``previous`` frames made,
    encoded into its reference latents; each later segment's first ``previous`` frames dropped. Also every segment's
    latents, concatenated in time."""
    segment, made, latents_made, last = video_frames(p.model, p.shape), [], [], None
    for n, start in enumerate(p.segments):
        step_cond, step_noise = cond, noise
        if n > 0:
            window = {name: frames[start:start + segment] for name, frames in p.control.items()}
            rows = [animation_condition(encoder, p.image, window, p.shape, p.model, previous=frames) for frames in last]
            step_cond = {**cond, **{name: torch.stack([torch.from_numpy(row[name]) for row in rows]).to(noise.device)
                                    for name in ("reference_latents", "pose_latents", "face_pixels")}}
            step_noise = noise_and_keys(seeds, p.shape, segment=n)[0].to(noise.device)
        latents, _ = validation.draw(sampler, step_noise, step_cond, keys, uncond, p.vcfg.guidance_scale)
        with torch.no_grad():
            video = decoder(p.model.denormalize(latents)).float().cpu()
        last = video[:, :, -previous:] * 2 - 1
        made.append(video if n == 0 else video[:, :, previous:])
        latents_made.append(latents)
    return torch.cat(latents_made, dim=2), torch.cat(made, dim=2)[:, :, :p.frames]


def world_score(judge: Callable[..., dict[str, float]], made: torch.Tensor, prompt: str) -> dict[str, float] | None:
    """The toy world's figures of one video ``[1, 3, T, H, W]`` (or sound ``[1, 2, S]``) of ``prompt``, or None when
    the world has no true clips (or tones) of its size to compare with."""
    try:
        return judge(made, [prompt])
    except ValueError:
        return None


def decoded(model: Any, decoder: Callable[[torch.Tensor], torch.Tensor], sound: Any,
            latents: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(video ``[N, 3, T, H, W]`` in [0, 1], waveforms ``[N, C, S]`` in [-1, 1] or None) on the CPU of sampled
    latents (a joint model's dict: its video, and its audio when there is a ``sound`` decoder)."""
    with torch.no_grad():
        clean = model.denormalize(latents)
        video = decoder(clean["video"] if isinstance(clean, Mapping) else clean).float().cpu()
        waveforms = None
        if sound is not None and isinstance(clean, Mapping):
            waveforms = sound.decode(clean["audio"]).float().clamp(-1, 1).cpu()
    return video, waveforms


def _cat(parts: list[Any]) -> Any:
    if not parts:
        return None
    if isinstance(parts[0], Mapping):
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
    return torch.cat(parts)


def _uncond(config: Any, model: Any, encoder: Any, negative_prompt: str | None, clip: preprocess.Clip,
            vcfg: validation.ValidationConfig, device: torch.device) -> Callable[[Any], Any]:
    """The unconditional cond of guided sampling: ``--negative-prompt`` encoded (for a negative ``clip``), else the
    run's validation's."""
    if negative_prompt is not None:
        negative = tree.to_device(encoded_cond(config, model, encoder, [negative_prompt], clip), device)
        return lambda cond: model.uncond(cond, "negative_prompt", negative)
    negative = (None if vcfg.negative_prompt_path is None
                else tree.to_device(model.load_negative(vcfg.negative_prompt_path, "validation.negative_prompt_path"),
                                    device))
    return lambda cond: model.uncond(cond, vcfg.cfg_uncond, negative)


def _decoder(config: Any, role: str, base: str | None) -> Callable[[], Callable[[torch.Tensor], torch.Tensor]]:
    """A factory of the decoder: the experiment's ``vae`` (validation's), else the family's VAE from the base
    folder; a ValueError when neither exists (before any weight loads)."""
    if getattr(config, "vae", None) is not None:
        return lambda: config.build_vae().decode
    factory = preprocessing.video_decoder(config, role, base)
    return lambda: factory().decode_video


def _record(p: Plan, sampler: validation.Sampler, entries: list[dict[str, Any]], fps: float,
            device: torch.device) -> dict[str, Any]:
    """``samples.json``: what every video was made with, enough to make it again."""
    request, source, vcfg = p.request, p.source, p.vcfg
    shape = ({name: list(part) for name, part in p.shape.items()} if isinstance(p.shape, Mapping)
             else list(p.shape))
    return {
        "source": str(pathlib.Path(request.source).absolute()), "where": source.where, "step": source.step,
        "role": source.role, "ema": source.ema, "model": p.model.name, "sampler": sampler.tag,
        "kind": sampler.sampler, "steps": vcfg.num_steps, "guidance": vcfg.guidance_scale if sampler.guided else None,
        "shift": vcfg.flow_shift, "schedule": vcfg.schedule, "shift_terminal": vcfg.shift_terminal,
        "solver": vcfg.solver if p.sampler.tag.startswith("model") else None, "karras": vcfg.karras,
        "negative_prompt": request.negative_prompt, "jumps": request.jumps, "latent_shape": shape, "fps": fps,
        "batch_size": request.batch_size,
        "base": request.base, "image": None if request.image is None else str(pathlib.Path(request.image).absolute()),
        **{name: None if path is None else str(pathlib.Path(path).absolute())
           for name, path in (("last_image", request.last_image), ("video", request.video),
                              ("actions", request.actions), ("control", request.control), ("mask", request.mask),
                              ("reference", request.reference), ("pose", request.pose), ("face", request.face),
                              ("background", request.background))},
        **({"frames": p.frames, "segments": list(p.segments)} if p.segments else {}),
        "overrides": list(request.overrides), "device": device.type, "videos": entries,
    }
