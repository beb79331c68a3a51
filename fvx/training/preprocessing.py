"""An experiment's encoders at work: ``preprocess`` (media -> FastVideo parquet) and ``encode-prompts`` (text -> a cond
file), both with the model the experiment trains.

The model is the experiment's student role (or its only model): its config's ``encoders`` record
(``fvx_models.encoders``) opened on ``path``, its diffusers folder, in its ``compute_dtype``. An experiment whose model
has no folder and whose data is the toy world (``data.world``) encodes with the world's own "text encoder" and exact
codec (``fvx.data.toy_world_files.WorldEncoders``), so the whole path runs on a CPU.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Callable

import msgspec
import torch

import fvx
from fvx.core import random
from fvx.data import batching, media, parquet, preprocess, sections as fsections
from fvx.data.toy_world_files import WorldEncoders
from fvx.training import progress as fprogress


def model_role(config: Any) -> tuple[str, Any]:
    """(role, model config) the experiment's data is encoded for: ``student`` if it has one, else its only model."""
    models = dict(getattr(config, "models", {}) or {})
    if "student" in models:
        return "student", models["student"]
    if len(models) == 1:
        return next(iter(models.items()))
    raise ValueError(f"the experiment has models {sorted(models)}: preprocess encodes for the 'student' role, which "
                     "it lacks")


def device() -> torch.device:
    """This process's device: its CUDA device (LOCAL_RANK) when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


Source = tuple[dict[str, Any], Callable[[], Any], tuple[int, int], int]  # identity, factory, frame rule, multiple


def encoder_source(config: Any, parts: tuple[str, ...], *, role: str | None = None,
                   base: str | None = None) -> Source:
    """(identity, encoder factory, (frame base, frame step), pixel multiple) for the experiment's ``role`` (default:
    :func:`model_role`'s) from ``base`` (a diffusers pipeline folder) or its model's ``path``; the toy world's
    encoders when the data is the world's and no folder holds the parts. Every problem (no encoders, no folder, a
    component the folder lacks) raises a one-line ValueError here, before anything is read or written; the factory
    loads the weights."""
    role, model = model_role(config) if role is None else (role, _role_model(config, role))
    family, world = model.family.name, getattr(config.data, "world", None)
    record = model.family.encoders
    folder, who = ((pathlib.Path(base), "--base") if base is not None else
                   (None if model.path is None else pathlib.Path(model.path), f"models.{role}.path"))
    if world is not None and base is None and (folder is None or not _holds(record, folder, parts)):
        encoders = WorldEncoders(world, config.data.kind)
        return {**encoders.identity(), "family": family}, lambda: encoders, (1, 1), 1
    if record is None:
        raise ValueError(f"models.{role}: family {family!r} has no encoders in fvx")
    if folder is None:
        raise ValueError(f"models.{role}.path is not set: fvx encodes with the VAE and text encoder of the model's "
                         "diffusers folder (e.g. models.student.path=/models/Wan2.1-T2V-1.3B-Diffusers; sample: "
                         "--base FOLDER)")
    if "image" in parts and not record.image_wanted(model):
        parts = tuple(part for part in parts if part != "image")  # the model reads no image features
    record.check(folder, parts, who)

    def factory() -> Any:
        return record.open(folder, parts, dtype=model.compute_dtype, device=device(), who=who)

    identity = {"model": str(folder.resolve()), "family": family}
    return identity, factory, (record.frame_base, record.frame_step), record.pixel_multiple


def _role_model(config: Any, role: str) -> Any:
    return config.models[msgspec.structs.asdict(config.method.roles)[role]]


def _holds(record: Any, folder: pathlib.Path, parts: tuple[str, ...]) -> bool:
    """Whether ``folder`` has the components ``record`` needs for ``parts``."""
    if record is None:
        return False
    try:
        record.check(folder, parts, "")
    except ValueError:
        return False
    return True


def prompt_encoder(config: Any, role: str, base: str | None, kind: str) -> Callable[[], Any]:
    """The factory of the encoders ``sample`` needs for ``role`` (:func:`encoder_source`) under data ``kind``: the
    text encoder, and the first-frame and image encoders of an image-to-video model (alone for a model without
    text); a model that makes a video a section at a time from its first frame (kind framepack) also encodes that
    frame with the VAE, and an animation model (kind animate) its character, pose and face videos."""
    parts = tuple(part for part in parts_of(kind) if part not in ("video", "audio") or (kind, part) in (
        ("framepack", "video"), ("animate", "video")))
    return encoder_source(config, parts, role=role, base=base)[1]


def video_decoder(config: Any, role: str, base: str | None) -> Callable[[], Any]:
    """The factory of ``role``'s family VAE, opened to decode (``Opened.decode_video``), from ``base`` or the
    model's folder; a ValueError when neither holds one."""
    return encoder_source(config, ("decode",), role=role, base=base)[1]


def encoded_prompts(config: Any, encoder: Any, prompts: list[str], clip: preprocess.Clip,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``prompts`` through ``encoder``, each describing ``clip`` (a family whose text states it), as a raw batch
    (``text`` at ``data.text_len``, a second stream at ``data.text_2_len``, the captions, and ``extra`` in every
    sample: an image-to-video condition), what a dataset's ``read`` gives a model's ``batch``."""
    rows, seconds = encoder.encode_text(prompts, [clip] * len(prompts)), encoder.encode_text_2(prompts)
    samples = [{"text": row.numpy(), "where": f"prompt {n + 1}", "caption": prompt, **(extra or {})}
               for n, (row, prompt) in enumerate(zip(rows, prompts))]
    for sample, second in zip(samples, seconds or ()):
        sample["text_2"] = second.numpy()
    return collated(config, samples)


def collated(config: Any, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Encoded samples (text, or none: kind matrixgame2's first frame, image features and actions) as a raw batch,
    nothing dropped."""
    return batching.collate(samples, list(range(len(samples))), text_len=config.data.text_len, cfg_rate=0.0,
                            dropout_key=random.key(0), text_2_len=config.data.text_2_len)


def parts_of(kind: str) -> tuple[str, ...]:
    """What a data kind encodes."""
    return {"t2v": ("text", "video"), "i2v": ("text", "video", "first_frame", "image"),
            "t2va": ("text", "video", "audio"), "i2va": ("text", "video", "audio", "first_frame", "image"),
            "text_only": ("text",),
            "matrixgame2": ("video", "first_frame", "image"), "vace": ("text", "video", "context"),
            "framepack": ("text", "video", "image"), "animate": ("text", "video", "animation", "image")}[kind]


def job_of(config: Any) -> tuple[preprocess.Job, Callable[[], Any]]:
    """The preprocessing job of an experiment and its encoder factory; a ValueError for a config that cannot
    preprocess (before any file is read)."""
    data, cut = config.data, config.data.preprocess
    if data.kind == "text_only":  # prompts only: FastVideo's text-only preprocessing
        identity, factory, (frame_base, frame_step), multiple = encoder_source(config, ("text",))
        identity = {**identity, "kind": data.kind, "samples_per_file": cut.samples_per_file}
        return preprocess.Job(identity, data.kind, cut, frame_step, multiple, frame_base=frame_base), factory
    identity, factory, (frame_base, frame_step), multiple = encoder_source(config, parts_of(data.kind))
    world = data.world if model_role(config)[1].path is None else None  # the toy world's encoders (encoder_source)
    if world is not None and (cut.num_frames, cut.train_fps, cut.max_height, cut.max_width) != (
            world.frames, world.fps, world.size, world.size):
        raise ValueError(f"the toy world's clips are {world.frames} frames of {world.size}x{world.size} at "
                         f"{world.fps} fps; set data.preprocess.num_frames={world.frames} train_fps={world.fps} "
                         f"max_height={world.size} max_width={world.size}")
    media.check_size(cut.max_height, cut.max_width, multiple, "data.preprocess.max_height x max_width")
    if media.usable_frames(cut.num_frames, frame_step, frame_base) == 0:
        raise ValueError(f"data.preprocess.num_frames={cut.num_frames} is shorter than the family's shortest clip "
                         f"({frame_base} frames)")
    for height, width in cut.buckets or ():
        media.check_size(height, width, multiple, "data.preprocess.buckets entry")
    audio_rate = None
    if data.kind in parquet.AUDIO_KINDS:
        audio_rate = cut.audio_rate
        if audio_rate is None:
            raise ValueError(f"data.kind={data.kind!r} needs data.preprocess.audio_rate (the audio VAE's sample "
                             "rate, Hz)")
    if data.kind == "animate":
        check_animate_cut(config, cut, frame_base, frame_step)
    sections = None
    if data.kind == "framepack":  # clips become sections: the cut must hold one
        sections = data.sections
        latent_frames = (media.usable_frames(cut.num_frames, frame_step, frame_base) - frame_base) // frame_step + 1
        if fsections.count(latent_frames, sections) < 1:
            needed = fsections.first_frame(sections, 1)  # latent frames of one section
            what = ("a one-frame section (data.sections.order=one_frame: the last latent frame made from the first)"
                    if sections.order == "one_frame" else f"section of data.sections.window={sections.window}"
                    + ("" if sections.order == "chunks" else " after the first"))
            raise ValueError(f"data.preprocess.num_frames={cut.num_frames} makes {latent_frames} latent frames, no "
                             f"{what} (it needs {frame_base + (needed - 1) * frame_step} frames)")
    identity = {**identity, "kind": data.kind, "preprocess": msgspec.to_builtins(cut),
                **({"sections": msgspec.to_builtins(sections)} if sections is not None else {})}
    return preprocess.Job(identity, data.kind, cut, frame_step, multiple, audio_rate, frame_base, sections), factory


def check_animate_cut(config: Any, cut: preprocess.PreprocessConfig, frame_base: int, frame_step: int) -> None:
    """A ValueError unless kind animate's cut fits: face videos at the size the model's motion encoder reads, segments
    of a whole number of latent frames within the clip, longer than the previous frames they begin with."""
    role, model_config = model_role(config)
    animate = cut.animate
    face = model_config.family.conditioning.spec(model_config).get("face_pixels")
    if face is not None and face[2] != animate.face_size:
        raise ValueError(f"data.preprocess.animate.face_size={animate.face_size}, but models.{role} "
                         f"({model_config.family.name}:{model_config.preset}) reads {face[2]} x {face[2]} face videos; "
                         f"set data.preprocess.animate.face_size={face[2]}")
    length = animate.segment_frames
    if length is None:
        return
    clip = media.usable_frames(cut.num_frames, frame_step, frame_base)
    if (length - frame_base) % frame_step or not animate.previous_frames < length <= clip:
        raise ValueError(f"data.preprocess.animate.segment_frames={length} must be {frame_base} + {frame_step} k "
                         f"video frames, more than previous_frames={animate.previous_frames} and at most the clip's "
                         f"{clip} (data.preprocess.num_frames), e.g. {frame_base + frame_step * 19}")


def run_preprocess(config: Any, videos: str, out: str, *, progress: bool) -> dict[str, Any]:
    """``preprocess``: this process's parts (torchrun's RANK of WORLD_SIZE) of the inputs under ``videos`` (a
    folder; for ``data.kind=text_only`` a prompts file: one a line, or FastVideo's validation JSON) into ``out``; a
    ValueError (bad input) before anything is written."""
    job, factory = job_of(config)
    source = pathlib.Path(videos)
    inputs = preprocess.find_prompts(source) if job.kind == "text_only" else preprocess.find_inputs(source, job.kind)
    if job.kind == "matrixgame2":  # every video's action file, before anything is written
        preprocess.check_action_files(job, inputs)
    if job.kind in preprocess.CONTROL_FILES:  # every video's control video (vace), pose and face videos (animate)
        preprocess.check_control_files(inputs, job.kind)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    folder = pathlib.Path(out)
    job = dataclasses.replace(job, identity={**job.identity, "inputs": str(pathlib.Path(videos).resolve()),
                                             "fvx_version": fvx.__version__})
    if preprocess.check_folder(folder, job.identity):
        return {"already": True, **preprocess.summary(folder)}
    return preprocess.run(job, factory, inputs, folder, rank=rank, world=world,
                          bar=lambda total: fprogress.bar(total, desc="preprocess", unit="clip", show=progress))


def run_encode_prompts(config: Any, prompts_file: str, out: str, negative: bool = False) -> tuple[int, pathlib.Path]:
    """``encode-prompts``: the prompts of ``prompts_file`` (``preprocess.read_prompts``: one a line, or FastVideo's
    validation JSON's captions) through the experiment's text encoder into a cond file at ``out`` (the family's cond
    tensors ``[N, ...]`` at ``data.text_len``, a second text stream at ``data.text_2_len``, the captions kept). A
    family whose text states its clip states the clip ``data.preprocess`` cuts (``negative``: as negative prompts)."""
    prompts = preprocess.read_prompts(prompts_file)
    target = pathlib.Path(out)
    if target.suffix != ".safetensors":
        raise ValueError(f"--out {str(target)!r} must end in .safetensors (a cond file)")
    if target.parent.exists() and not target.parent.is_dir():
        raise ValueError(f"--out {str(target)!r}: {str(target.parent)!r} is not a folder")
    _, model = model_role(config)
    _, factory, (frame_base, frame_step), _ = encoder_source(config, ("text",))
    clip = preprocess.cut_clip(config.data.preprocess, frame_step, frame_base)._replace(negative=negative)
    batch = encoded_prompts(config, factory(), prompts, clip)
    target.parent.mkdir(parents=True, exist_ok=True)
    model.write_cond_file(target, batch, prompts)
    return len(prompts), target
