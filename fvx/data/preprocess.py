"""``preprocess``: a folder of videos (or images) and captions -> FastVideo's parquet of latents and text embeddings.

Inputs (:func:`find_inputs`): FastVideo's merged layout (``videos/`` beside ``videos2caption.json``, a list of
``{"path": ..., "cap": ...}``), or a folder of media files each beside a caption file of the same stem (``clip.mp4`` +
``clip.txt``, musubi-tuner's and diffusion-pipe's convention; images are one-frame clips). Kind "matrixgame2" also
reads each video's action file (:func:`read_action_file`: ``.npz`` of keyboard and mouse, or ``.npy`` of the keyboard):
``"action_path"`` of its entry in the merged layout (from ``videos/``, as FastVideo joins it), else ``clip.npz`` or
``clip.npy`` beside ``clip.mp4``. Kind "vace" reads each video's control video ``clip.control.<ext>`` (required), its
mask ``clip.mask.<ext>`` (white: to be made; none: all of it) and reference image ``clip.ref.<ext>`` beside it, cut
and sized as the clip (:func:`encode_context`); those files are not inputs of their own. Each clip is decoded
(``fvx.data.media``), encoded by the model's encoders (the family's ``Encoders`` record, or the toy world's) and written
as rows of ``fvx.data.parquet``'s schema for the data kind.

Output folder ``DATASET``::

    metadata.json                    what made it (model folder, family, kind, geometry, fvx version); the row count
                                     once complete. A folder made for another model or geometry is refused.
    combined_parquet_dataset/part_NNNNN.parquet   the encoded rows of inputs [N s, (N + 1) s), s = samples_per_file
    .parts/part_NNNNN.json           a part is done: its row count and its skipped inputs (file and reason)
    skipped.json                     every skipped input, once complete
    COMPLETE                         written last

Parts are the unit of work and of resumption: under torchrun rank ``r`` of ``w`` encodes parts ``r, r + w, ...``; a
part is written atomically and marked done after; a run started again skips done parts, so a killed job ends with the
files an uninterrupted one writes (a part's bytes depend on its inputs alone). The last rank to finish writes
``skipped.json``, the count and ``COMPLETE``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Annotated, Any, Callable, Literal, NamedTuple, Protocol, Sequence

import msgspec
import numpy as np
import torch
from tqdm import tqdm

from fvx.config import Config
from fvx.data import media, parquet, sections as fsections
from fvx.data.sections import SectionsConfig
from fvx.storage import files

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
PARTS, DONE, COMPLETE = "combined_parquet_dataset", ".parts", "COMPLETE"
UNCHECKED = ("count", "fvx_version")  # metadata.json entries a resumed run may differ in


class AnimateCut(Config):
    """How ``preprocess`` cuts Wan-Animate's clips (``data.preprocess.animate``, kind "animate"): face videos resized
    to ``face_size`` square (the model's motion encoder reads 512); clips longer than ``segment_frames`` video frames
    into segments of that many (a whole number of latent frames), each after the first starting on the previous one's
    last ``previous_frames`` frames, given (Wan-Animate's ``prev_segment_conditioning_frames``, 1 or 5): a segment
    after the first learns to continue them, as the pipeline's later segments do. None: the clip is one segment."""

    face_size: PositiveInt = 512
    segment_frames: PositiveInt | None = None
    previous_frames: Literal[1, 5] = 1


class PreprocessConfig(Config):
    """How ``preprocess`` cuts clips (FastVideo's knobs; ``data.preprocess``): ``num_frames`` frames sampled at
    ``train_fps`` from the start (rounded down to the family's ``frame_base + k * frame_step``); frames centre-cropped
    to the aspect ratio of ``max_height`` x ``max_width`` and resized to it (multiples of the family's pixel multiple,
    else refused); a video longer than ``video_length_tolerance_range`` clips, or shorter than one, is skipped (5.0,
    what FastVideo's example scripts pass). ``buckets``: (height, width) pairs; each clip goes to the one nearest its
    aspect ratio instead (a batch never mixes them). ``samples_per_file``: inputs a parquet file. ``audio_rate``: the Hz
    a t2va or i2va clip's sound is resampled to (the family's audio VAE's; those kinds need it). ``animate``:
    Wan-Animate's face size and segments (:class:`AnimateCut`)."""

    num_frames: PositiveInt = 81
    train_fps: PositiveInt = 16
    max_height: PositiveInt = 480
    max_width: PositiveInt = 832
    video_length_tolerance_range: Annotated[float, msgspec.Meta(gt=0.0)] = 5.0
    samples_per_file: PositiveInt = 64
    buckets: tuple[tuple[PositiveInt, PositiveInt], ...] | None = None
    audio_rate: PositiveInt | None = None
    animate: AnimateCut = AnimateCut()


class Clip(NamedTuple):
    """What a prompt describes, for a family whose text states it (Cosmos 3's duration and resolution sentences): a
    clip of ``frames`` video frames (1: an image) at ``fps``, ``height x width`` pixels; ``negative``: the prompt is
    a negative one (such a family states the inverse)."""

    frames: int
    fps: float
    height: int
    width: int
    negative: bool = False


class Encoder(Protocol):
    """What preprocessing encodes with (``fvx_models.encoders.Opened`` or the toy world's ``WorldEncoders``);
    ``clips``: each prompt's :class:`Clip` (a family whose text does not state it ignores them)."""

    def encode_text(self, prompts: list[str], clips: list[Clip] | None = None) -> list[torch.Tensor]: ...

    def encode_text_2(self, prompts: list[str]) -> list[torch.Tensor] | None: ...

    def encode_video(self, video: torch.Tensor) -> torch.Tensor: ...

    def encode_first_frame(self, video: torch.Tensor) -> torch.Tensor: ...

    def encode_image(self, frame: torch.Tensor) -> torch.Tensor | None: ...

    def encode_audio(self, waveform: torch.Tensor, rate: int) -> torch.Tensor: ...

    def encode_context(self, video: torch.Tensor, mask: torch.Tensor | None,
                       references: list[torch.Tensor]) -> torch.Tensor: ...

    def encode_references(self, references: list[torch.Tensor]) -> torch.Tensor: ...

    def encode_animation(self, reference: torch.Tensor, pose: torch.Tensor, face: torch.Tensor,
                         previous: torch.Tensor | None = None, background: torch.Tensor | None = None,
                         mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]: ...


@dataclasses.dataclass(frozen=True)
class Input:
    """One input: its media file, caption (None: missing), name (its path from the input root), action file (kind
    matrixgame2; None: none found) and control files (:data:`CONTROL_FILES` of its kind: role -> path)."""

    path: pathlib.Path
    caption: str | None
    name: str
    action: pathlib.Path | None = None
    control: dict[str, pathlib.Path] = dataclasses.field(default_factory=dict)


# the files beside a clip that kinds read, by role: clip.control.mp4, clip.mask.mp4, clip.ref.png; clip.pose.mp4, ...
CONTROL_FILES = {"vace": ("control", "mask", "ref"), "animate": ("pose", "face", "ref", "background", "mask")}


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything a preprocessing run needs: ``identity`` (what made the folder, checked on resume), the data
    ``kind``, the cut ``config``, the family's ``frame_step`` and ``pixel_multiple``, the audio rate (t2va, i2va), the
    family's ``frame_base``, how clips become sections (kind framepack)."""

    identity: dict[str, Any]
    kind: str
    config: PreprocessConfig
    frame_step: int
    pixel_multiple: int
    audio_rate: int | None = None
    frame_base: int = 1
    sections: SectionsConfig | None = None


# ----------------------------------------------------------------------------------------------------------- inputs


def find_inputs(root: pathlib.Path, kind: str = "t2v") -> list[Input]:
    """Every input under ``root`` in a fixed order (by name): FastVideo's merged layout when ``root`` holds
    ``videos2caption.json`` (a caption list gives its first), else media files with ``<stem>.txt`` captions (for kinds
    "vace" and "animate", but the control files beside them, :data:`CONTROL_FILES`, which each input gets; in either
    layout)."""
    if not root.is_dir():
        raise ValueError(f"--videos {str(root)!r} is not a folder")
    listing = root / "videos2caption.json"
    if listing.is_file():
        return _merged_layout(root, listing, kind)
    found = sorted((p for p in root.rglob("*") if p.is_file() and media.is_media(p)),
                   key=lambda p: p.relative_to(root).as_posix())
    if kind in CONTROL_FILES:
        found = [p for p in found if pathlib.Path(p.stem).suffix[1:] not in CONTROL_FILES[kind]]
    if not found:
        raise ValueError(f"--videos {str(root)!r} holds no videos or images ({', '.join(media.VIDEO_SUFFIXES)}, "
                         f"{', '.join(media.IMAGE_SUFFIXES)}) and no videos2caption.json")
    inputs = []
    for path in found:
        text = path.with_suffix(".txt")
        caption = text.read_text(encoding="utf-8", errors="replace").strip() if text.is_file() else None
        action = next((found for found in (path.with_suffix(".npz"), path.with_suffix(".npy")) if found.is_file()),
                      None)
        control = control_files(path, kind)
        inputs.append(Input(path, caption, path.relative_to(root).as_posix(), action, control))
    return inputs


def control_files(path: pathlib.Path, kind: str) -> dict[str, pathlib.Path]:
    """The control files of ``kind`` beside media file ``path`` (``<stem>.<role>.<ext>``, :data:`CONTROL_FILES`), by
    role."""
    found = {}
    for role in CONTROL_FILES.get(kind, ()):
        named = sorted(p for p in path.parent.glob(f"{path.stem}.{role}.*") if p.is_file() and media.is_media(p))
        if named:
            found[role] = named[0]
    return found


PROMPTS_FORMATS = 'one prompt a line, or FastVideo\'s validation JSON {"data": [{"caption": ...}, ...]}'


def read_prompts(path: str | pathlib.Path, who: str = "prompts file") -> list[str]:
    """The prompts of ``path``: a ``.json`` file is FastVideo's validation set ``{"data": [{"caption": str}, ...]}``
    (other keys of an entry ignored), any other file text, one prompt a line (blank lines skipped); each stripped. A
    one-line ValueError naming ``who`` (the option or role of the file), the file and, in a JSON, the bad entry."""
    source = pathlib.Path(path)
    where = f"{who} {str(source)!r}"
    if not source.is_file():
        raise ValueError(f"{where} does not exist")
    try:
        text = source.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where} is not UTF-8 text ({PROMPTS_FORMATS})") from None
    if "\x00" in text:
        raise ValueError(f"{where} is not text ({PROMPTS_FORMATS})")
    prompts = _json_captions(text, where) if source.suffix.lower() == ".json" else \
        [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{where} holds no prompts ({PROMPTS_FORMATS})")
    return prompts


def _json_captions(text: str, where: str) -> list[str]:
    """The captions of FastVideo's validation JSON, in order (:func:`read_prompts`)."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not valid JSON ({error})") from None
    entries = document.get("data") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f'{where} must be FastVideo\'s validation JSON, an object with a list "data" of '
                         '{"caption": ...} entries')
    captions = []
    for n, entry in enumerate(entries):
        caption = entry.get("caption") if isinstance(entry, dict) else None
        if not isinstance(caption, str) or not caption.strip():
            raise ValueError(f"{where}: entry data[{n}] needs a non-empty string \"caption\", got "
                             f"{json.dumps(entry)[:80]}")
        captions.append(caption.strip())
    return captions


def find_prompts(path: pathlib.Path) -> list[Input]:
    """The prompts of a prompts file (:func:`read_prompts`: one a line, or FastVideo's validation JSON) as the inputs of
    text-only data (FastVideo's text-only preprocessing: its ``text_prompt_N`` names)."""
    lines = read_prompts(path, "prompts file of text-only data")
    return [Input(path, line, f"text_prompt_{n}") for n, line in enumerate(lines)]


def _merged_layout(root: pathlib.Path, listing: pathlib.Path, kind: str) -> list[Input]:
    try:
        entries = json.loads(listing.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{str(listing)!r} is not readable JSON: {error}") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("path"), str)
                                                for e in entries):
        raise ValueError(f"{str(listing)!r} must be a JSON list of {{\"path\": ..., \"cap\": ...}} objects")
    inputs = []
    for entry in sorted(entries, key=lambda e: e["path"]):
        cap = entry.get("cap")
        cap = cap[0] if isinstance(cap, list) and cap else cap
        caption = cap.strip() if isinstance(cap, str) else None
        action, path = entry.get("action_path"), root / "videos" / entry["path"]
        inputs.append(Input(path, caption, entry["path"], root / "videos" / action if isinstance(action, str) and action
                            else None, control_files(path, kind)))
    return inputs


# ----------------------------------------------------------------------------------------------------------- actions


def read_action_file(path: pathlib.Path) -> dict[str, np.ndarray]:
    """A Matrix-Game action file: an ``.npz`` of ``keyboard [N, K]`` and ``mouse [N, 2]`` (one row per video frame),
    or an ``.npy`` of the keyboard array alone; float32 ``keyboard`` and, when given, ``mouse``. FastVideo's own
    ``.npy`` of a pickled dict is refused with the command that converts it: fvx never unpickles. A ValueError naming
    the file when it is missing, unreadable or not of that form."""
    where = f"action file {str(path)!r}"
    if not path.is_file():
        raise ValueError(f"{where} does not exist")
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic[:2] != b"PK" and magic != b"\x93NUMPY":
        raise ValueError(f"{where} is not a readable .npy or .npz file")
    try:
        data = np.load(path, allow_pickle=False)
    except ValueError as error:
        if "allow_pickle" not in str(error):
            raise ValueError(f"{where} is not a readable .npy or .npz file: {error}") from None
        raise ValueError(f"{where} holds a pickled object (FastVideo's dict form), which fvx does not unpickle; if "
                         "you trust it, load it once with numpy's allow_pickle and save its 'keyboard' and 'mouse' "
                         f"arrays with np.savez as {str(path.with_suffix('.npz'))!r}") from None
    except (OSError, EOFError) as error:
        raise ValueError(f"{where} is not a readable .npy or .npz file: {error}") from None
    found = {name: data[name] for name in data.files} if isinstance(data, np.lib.npyio.NpzFile) else {"keyboard": data}
    if "keyboard" not in found:
        raise ValueError(f"{where} holds a dict without 'keyboard' (keys {sorted(found)}); FastVideo's action files "
                         "hold {'keyboard': [N, K], 'mouse': [N, 2]} or a keyboard array [N, K]")
    actions = {}
    for name in ("keyboard", "mouse"):
        if name not in found:
            continue
        try:
            array = np.asarray(found[name], dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: {name!r} is not numeric") from None
        if array.ndim != 2 or array.shape[0] == 0 or (name == "mouse" and array.shape[1] != 2):
            shape = "[N, 2]" if name == "mouse" else "[N, K]"
            raise ValueError(f"{where}: {name!r} must be {shape} (one row per video frame), got shape "
                             f"{list(array.shape)}")
        actions[name] = array
    return actions


def check_action_files(job: Job, inputs: Sequence[Input]) -> None:
    """Kind matrixgame2, before anything is written: a ValueError naming the file unless every video has an action
    file (:func:`read_action_file`) whose keyboard is as wide as the first one's and whose rows reach every frame its
    clip takes (a video that does not probe is left to be skipped)."""
    width = None
    for item in inputs:
        if item.action is None:
            stem = item.path.with_suffix("")
            raise ValueError(f"video {str(item.path)!r} has no action file (kind 'matrixgame2' reads "
                             f"'{stem.name}.npz' or '{stem.name}.npy' beside it, or its entry's \"action_path\")")
        actions = read_action_file(item.action)
        width = actions["keyboard"].shape[1] if width is None else width
        if actions["keyboard"].shape[1] != width:
            raise ValueError(f"action file {str(item.action)!r}: keyboard is {list(actions['keyboard'].shape)}, "
                             f"{actions['keyboard'].shape[1]} keys wide, but the first action file's is {width} wide")
        try:
            indices = clip_indices(job, item)
        except media.MediaError:
            continue
        for name, array in actions.items():
            if indices and array.shape[0] <= indices[-1]:
                raise ValueError(f"action file {str(item.action)!r}: {name} has {array.shape[0]} rows, but the clip "
                                 f"of {item.name!r} takes video frames up to {indices[-1]} ({len(indices)} frames at "
                                 f"data.preprocess.train_fps={job.config.train_fps}): one row per video frame")


def check_control_files(inputs: Sequence[Input], kind: str) -> None:
    """Kinds vace and animate, before anything is written: a ValueError naming the file unless every video has the
    kind's required files (vace: a control video ``<stem>.control.<ext>``; animate: a pose video and a face video) and
    each given one is a video, or an image for a reference."""
    required = {"vace": ("control",), "animate": ("pose", "face")}[kind]
    for item in inputs:
        files, stem = item.control, item.path.with_suffix("").name
        if kind == "animate" and ("background" in files) != ("mask" in files):
            have, lack = ("background", "mask") if "background" in files else ("mask", "background")
            raise ValueError(f"video {str(item.path)!r} has a {have} video but no {lack} video: the replace mode "
                             f"reads both, '{stem}.background.mp4' and '{stem}.mask.mp4' (white: the character's "
                             "place, to be made)")
        for role in required:
            if role not in files:
                given = " and ".join(f"'{stem}.{r}.mp4'" for r in required)
                optional = {"vace": f"an optional '{stem}.mask.mp4' and '{stem}.ref.png'",
                            "animate": f"an optional character image '{stem}.ref.png' (none: the clip's first frame)"}
                raise ValueError(f"video {str(item.path)!r} has no {role} video (kind {kind!r} reads {given} beside "
                                 f"it, with {optional[kind]})")
        for role, path in files.items():
            if media.is_image(path) != (role == "ref"):
                raise ValueError(f"{role} file {str(path)!r} must be {'an image' if role == 'ref' else 'a video'}")


# ------------------------------------------------------------------------------------------------------------ clips


def clip_indices(job: Job, item: Input) -> list[int]:
    """The source frames of a video's clip (``media.frame_indices`` at the job's cut); a MediaError when it cannot be
    cut."""
    config = job.config
    fps, duration = media.probe_video(item.path)
    wanted = media.usable_frames(config.num_frames, job.frame_step, job.frame_base)
    return media.frame_indices(fps, duration, num_frames=wanted, train_fps=config.train_fps,
                               tolerance=config.video_length_tolerance_range).tolist()


def cut(job: Job, item: Input) -> tuple[torch.Tensor, dict[str, Any]]:
    """The clip ``[3, T, H, W]`` in [-1, 1] of ``item`` and its metadata columns (FastVideo's: ``file_name`` and ``id``
    the input's path, the clip's size, the source fps, ``duration_sec`` the sampled frames over it); a MediaError with
    the reason when it cannot be used."""
    clip, meta, _ = _cut(job, item)
    return clip, meta


def _cut(job: Job, item: Input) -> tuple[torch.Tensor, dict[str, Any], list[int]]:
    """:func:`cut`, and the source frames the clip took (``[0]`` for an image)."""
    if not item.caption and job.kind != "matrixgame2":  # Matrix-Game's data has no text
        raise media.MediaError("its caption is missing" if item.caption is None else "its caption is empty")
    if not item.path.is_file():
        raise media.MediaError("the file does not exist")
    config, image = job.config, media.is_image(item.path)
    if image and job.kind in (*parquet.FIRST_FRAME_KINDS, *parquet.AUDIO_KINDS, "framepack"):
        raise media.MediaError(f"it is an image; kind {job.kind!r} needs videos")
    if image:
        frames, fps, indices = media.read_image(item.path), 0.0, [0]
    else:
        fps, duration = media.probe_video(item.path)
        indices = clip_indices(job, item)
        frames = media.read_frames(item.path, indices)
    height, width = ((config.max_height, config.max_width) if not config.buckets
                     else media.nearest_bucket(*frames.shape[1:3], config.buckets))
    clip = media.resize_crop(frames, height, width)
    meta = {"file_name": item.name, "caption": item.caption or "", "media_type": "image" if image else "video",
            "width": width, "height": height, "duration_sec": clip.shape[1] / fps if fps else 0.0, "fps": fps}
    return clip, meta, indices


TEXT_BATCH = 8  # captions a text encoder call takes: its activations stay small whatever samples_per_file is


def encode_part(job: Job, encoder: Encoder, items: Sequence[Input]) -> tuple[list[dict], list[dict]]:
    """The rows of ``items`` (``fvx.data.parquet.write_parquet``'s samples) and the skipped ones (file, reason).
    Each clip is encoded as soon as it is cut, so a part holds latents, never its clips' pixels; then the captions,
    :data:`TEXT_BATCH` at a time."""
    rows, skipped = [], []
    for item in items:
        try:
            if job.kind == "text_only":
                rows.append({"id": item.name, "caption": item.caption})
            elif job.kind == "animate":
                rows.extend(animation_rows(job, encoder, item))
            else:
                row = encode_media(job, encoder, item)
                rows.extend(section_rows(row, job.sections) if job.kind == "framepack" else [row])
        except media.MediaError as error:
            skipped.append({"file": item.name, "reason": str(error)})
    for start in range(0, len(rows) if job.kind != "matrixgame2" else 0, TEXT_BATCH):  # matrixgame2: no text
        batch = rows[start:start + TEXT_BATCH]
        captions = [row["caption"] for row in batch]
        seconds = encoder.encode_text_2(captions)
        texts = encoder.encode_text(captions, [clip_of(job, row) for row in batch])
        for number, (row, text) in enumerate(zip(batch, texts)):
            row["text"] = text
            if seconds is not None:
                row["text_2"] = seconds[number]
    return rows, skipped


def clip_of(job: Job, row: dict[str, Any]) -> Clip:
    """What a row's caption describes: its clip (its frames, ``round(duration_sec * fps)`` of the source's rate, at
    the cut's rate; an image is one frame), or for text-only data the clip the cut makes (:func:`cut_clip`)."""
    if job.kind == "text_only":
        return cut_clip(job.config, job.frame_step, job.frame_base)
    frames = round(row["duration_sec"] * row["fps"]) if row["fps"] else 1
    return Clip(frames, float(job.config.train_fps), row["height"], row["width"])


def cut_clip(config: PreprocessConfig, frame_step: int, frame_base: int = 1) -> Clip:
    """The clip ``config`` cuts from a long enough video: its usable frames at its rate and size."""
    return Clip(media.usable_frames(config.num_frames, frame_step, frame_base), float(config.train_fps),
                config.max_height, config.max_width)


def encode_media(job: Job, encoder: Encoder, item: Input) -> dict[str, Any]:
    """One clip's row but its text: cut, encoded (its first frame, image features and sound per the kind)."""
    clip, meta, indices = _cut(job, item)
    sound = None
    if job.kind in parquet.AUDIO_KINDS:  # from the clip's start (its first frame is the video's), as long as it
        sound = media.read_audio(item.path, job.audio_rate, 0.0, clip.shape[1] / job.config.train_fps)
    one_frame = job.kind == "framepack" and job.sections.order == "one_frame"
    latents = one_frame_latents(encoder, clip) if one_frame else encoder.encode_video(clip)
    row = {"id": item.name, **meta, "num_frames": latents.shape[1], "latents": latents}
    if job.kind in parquet.FIRST_FRAME_KINDS:
        row["first_frame_latents"] = encoder.encode_first_frame(clip)
        row["pil_image"] = ((clip[:, 0] + 1) * 127.5).round().to(torch.uint8)
        image = encoder.encode_image((clip[:, 0] + 1) / 2)
        if image is not None:
            row["image_embeds"] = image
    if job.kind == "matrixgame2":  # the actions of the clip's own frames (checked to reach them before any writing)
        if item.action is None:
            raise media.MediaError("it has no action file")
        actions = read_action_file(item.action)
        row.update({name: torch.from_numpy(array[indices]) for name, array in actions.items()})
    if job.kind == "vace":
        row.update(encode_context(encoder, item, clip, indices, latents))
    if job.kind in parquet.AUDIO_KINDS:
        row["audio_latents"] = encoder.encode_audio(sound, job.audio_rate)
        row["audio_sample_rate"] = job.audio_rate
    if job.kind == "framepack":  # the start image's features (section_rows cuts the latents)
        row["image_embeds"] = encoder.encode_image((clip[:, 0] + 1) / 2)
    return row


def one_frame_latents(encoder: Encoder, clip: torch.Tensor) -> torch.Tensor:
    """A one-frame pair's latents ``[C, 2, h, w]`` (``data.sections.order=one_frame``): the clip's first frame (the
    control) and its last (the frame made), each encoded alone, as musubi-tuner encodes its control and target images
    (``fpack_cache_latents.py``: one frame at a time)."""
    return torch.cat([encoder.encode_video(clip[:, :1]), encoder.encode_video(clip[:, -1:])], dim=1)


def section_rows(row: dict[str, Any], config: SectionsConfig) -> list[dict[str, Any]]:
    """Kind framepack: a clip's row as one row per section (``fvx.data.sections``), ids ``<id>#<n>``."""
    parts = fsections.cut(row["latents"], config)
    return [{**row, "id": f"{row['id']}#{n}", "num_frames": part["latents"].shape[1], "latents": part["latents"],
             "framepack_history": part["history"], "frame_indices": part["frame_indices"]}
            for n, part in enumerate(parts)]


def encode_context(encoder: Encoder, item: Input, clip: torch.Tensor, indices: list[int],
                   latents: torch.Tensor) -> dict[str, torch.Tensor]:
    """Kind vace's tensors of one clip ``[3, T, H, W]``: its control video and mask (the clip's source frames
    ``indices``) and reference image as :func:`control_inputs` prepares them, through the encoder's context, and with a
    reference the clip's ``latents`` with its latent frame in front, as the pipeline lays them out (a MediaError when a
    file does not decode or is too short)."""

    def frames(role: str) -> np.ndarray | None:
        if role not in item.control:
            return None
        try:
            return media.read_frames(item.control[role], indices)
        except media.MediaError as error:
            raise media.MediaError(f"its {role} video {item.control[role].name!r}: {error}") from None

    reference = media.read_image(item.control["ref"]) if "ref" in item.control else None
    control, mask, refs = control_inputs(frames("control"), frames("mask"), reference, *clip.shape[2:])
    out = {"vace_context": encoder.encode_context(control, mask, refs)}
    if refs:
        out["latents"] = torch.cat([encoder.encode_references(refs), latents], dim=1)
    return out


def animation_rows(job: Job, encoder: Encoder, item: Input) -> list[dict[str, Any]]:
    """Kind animate's rows of one clip (:class:`AnimateCut`): one per segment (ids ``<id>#<n>`` when the clip is
    cut), each through :func:`encode_segment`, the first without previous frames, each later one given the first
    ``previous_frames`` of its own frames (the previous segment's last). A MediaError when a file does not decode or
    the clip is shorter than a segment."""
    clip, meta, indices = _cut(job, item)
    cut = job.config.animate

    def frames(role: str) -> np.ndarray:
        try:
            return media.read_frames(item.control[role], indices)
        except media.MediaError as error:
            raise media.MediaError(f"its {role} video {item.control[role].name!r}: {error}") from None

    height, width = clip.shape[2:]
    pose, face = media.resize_crop(frames("pose"), height, width), face_pixels(frames("face"), cut.face_size)
    background, mask = (replacement(frames("background"), frames("mask"), height, width)
                        if "background" in item.control else (None, None))
    reference = (media.resize_crop(media.read_image(item.control["ref"]), height, width)[:, 0] if "ref" in item.control
                 else clip[:, 0])
    features = encoder.encode_image((reference + 1) / 2)
    length = clip.shape[1] if cut.segment_frames is None else cut.segment_frames
    starts = segment_starts(clip.shape[1], length, cut.previous_frames)
    if not starts:
        raise media.MediaError(f"its {clip.shape[1]} frames are fewer than a segment's {length} "
                               "(data.preprocess.animate.segment_frames)")
    rows = []
    for n, start in enumerate(starts):
        window = slice(start, start + length)
        previous = None if n == 0 else clip[:, start:start + cut.previous_frames]
        replace = None if background is None else (background[:, window], mask[:, window])
        row = encode_segment(job, encoder, clip[:, window], reference, pose[:, window], face[:, window], previous,
                             replace)
        rows.append({"id": item.name if cut.segment_frames is None else f"{item.name}#{n}", **meta, **row,
                     "num_frames": row["latents"].shape[1], "image_embeds": features})
    return rows


def segment_starts(frames: int, length: int, previous: int, *, cover: bool = False) -> list[int]:
    """The first video frame of each segment of ``length`` frames of a clip of ``frames``: 0, then each segment
    ``previous`` frames before the last one's end (the pipeline's ``effective_segment_length``), while one fits or,
    with ``cover``, until they reach ``frames`` (the last may run past it: ``WanAnimatePipeline`` pads its inputs)."""
    if cover:
        return list(range(0, max(frames - previous, 1), length - previous))
    return list(range(0, frames - length + 1, length - previous)) if length <= frames else []


def kept_cells(mask: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The replace mode's mask ``[1, F, H, W]`` (1: to be made) as the cells it keeps ``[F, height, width]`` at a
    latent grid (nearest), where the condition mask is one."""
    return torch.nn.functional.interpolate(1 - mask.float().transpose(0, 1), size=(height, width), mode="nearest")[:, 0]


def replacement(background: np.ndarray | None, mask: np.ndarray | None, height: int,
                width: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The replace mode's uint8 background and mask frames ``[F, H0, W0, 3]`` as the background video ``[3, F, H, W]``
    in [-1, 1] and its mask ``[1, F, H, W]`` (the mean over colours, white 1: to be made), cropped and resized as the
    clip; (None, None) without them (the animate mode)."""
    if background is None:
        return None, None
    return (media.resize_crop(background, height, width),
            (media.resize_crop(mask, height, width).mean(0, keepdim=True) + 1) / 2)


def encode_segment(job: Job, encoder: Encoder, clip: torch.Tensor, reference: torch.Tensor, pose: torch.Tensor,
                   face: torch.Tensor, previous: torch.Tensor | None,
                   replace: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, Any]:
    """One segment's tensors: its clip ``[3, F, H, W]``, pose video and face video (uint8, held for 4 video frames a
    latent frame when the family's VAE packs fewer) with the character image, the previous frames (None: a first
    segment) and the replace mode's background and mask (None: the animate mode) through the encoder's animation
    inputs; the latents with the reference's in front."""
    out = encoder.encode_animation(reference, pose, hold(face, 4 // job.frame_step), previous, *(replace or ()))
    return {"latents": torch.cat([out.pop("reference"), encoder.encode_video(clip)], dim=1), **out}


def face_pixels(frames: np.ndarray, size: int) -> torch.Tensor:
    """uint8 face frames ``[F, H0, W0, 3]`` as uint8 ``[3, F, size, size]``: resized whole (bilinear, antialiased; the
    pipeline does not crop them either), unchanged when already that size (Wan-Animate's preprocessing makes 512)."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    if tuple(video.shape[2:]) != (size, size):
        video = torch.nn.functional.interpolate(video.float(), size=(size, size), mode="bilinear", antialias=True)
        video = video.round().clamp(0, 255).to(torch.uint8)
    return video.transpose(0, 1).contiguous()


def hold(video: torch.Tensor, times: int) -> torch.Tensor:
    """``video [C, F, H, W]`` with every frame after the first repeated ``times`` times (a face video for a VAE that
    packs ``4 / times`` video frames a latent frame: the face encoder takes 4)."""
    return torch.cat([video[:, :1], video[:, 1:].repeat_interleave(times, dim=1)], dim=1)


def control_inputs(control: np.ndarray, mask: np.ndarray | None, reference: np.ndarray | None, height: int,
                   width: int) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """uint8 control frames ``[F, H0, W0, 3]``, mask frames (or None) and a reference image ``[1, H0, W0, 3]`` (or
    None) as an encoder's context takes them at ``height x width``: the control video ``[3, F, H, W]`` cropped and
    resized as a clip, the mask ``[1, F, H, W]`` the mean over colours (white 1), the reference ``[3, H, W]`` fit on
    white as ``WanVACEPipeline`` prepares it."""
    mask = None if mask is None else (media.resize_crop(mask, height, width).mean(0, keepdim=True) + 1) / 2
    refs = [] if reference is None else [media.fit_on_white(reference, height, width)]
    return media.resize_crop(control, height, width), mask, refs


# ------------------------------------------------------------------------------------------------------------ output


def check_folder(out: pathlib.Path, identity: dict[str, Any]) -> bool:
    """Whether ``out`` is already complete; a ValueError when it was made for another model, family or geometry
    (or is some other non-empty folder). Writes ``metadata.json`` for a new folder (every rank of a launch writes the
    same bytes, atomically, so ranks that start together agree whichever writes first)."""
    path = out / "metadata.json"
    if not path.is_file():
        foreign = [p.name for p in out.iterdir() if not _ours(p.name)] if out.is_dir() else []
        if foreign:
            raise ValueError(f"--out {str(out)!r} is a non-empty folder that preprocess did not make (it holds "
                             f"{foreign[0]!r} and no metadata.json)")
        if not path.is_file():  # another rank may have written it since
            files.write_json(path, identity)
            return False
    try:
        stored = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--out {str(out)!r}: metadata.json is not readable JSON: {error}") from None
    ours = {k: v for k, v in stored.items() if k not in UNCHECKED}
    theirs = {k: v for k, v in json.loads(json.dumps(identity)).items() if k not in UNCHECKED}  # as JSON has it
    if ours != theirs:
        diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        first = diff[0]
        raise ValueError(f"--out {str(out)!r} was made with {first}={ours.get(first)!r}, not "
                         f"{theirs.get(first)!r} (differing: {', '.join(diff)}); use another folder")
    return (out / COMPLETE).is_file()


def _ours(name: str) -> bool:
    """What preprocess itself writes in its folder (another rank of the launch may be at work)."""
    return name in (PARTS, DONE, "metadata.json", "skipped.json", COMPLETE) or name.startswith(".metadata.json.")


def part_name(number: int) -> str:
    return f"part_{number:05d}"


def run(job: Job, encoder_factory: Callable[[], Encoder], inputs: Sequence[Input], out: pathlib.Path, *,
        rank: int = 0, world: int = 1, log: Callable[[str], None] = print,
        bar: Callable[[int], Any] = lambda total: tqdm(total=total, disable=True)) -> dict[str, Any]:
    """Encode this rank's parts of ``inputs`` into ``out`` (the module docstring), counting clips on ``bar(total)``
    (a tqdm); the last rank to finish completes the folder. Returns {"rows", "skipped", "complete"}; the encoder is
    made only when a part is left to do."""
    per_file = job.config.samples_per_file
    parts = math.ceil(len(inputs) / per_file)
    mine = [n for n in range(rank, parts, world) if not (out / DONE / f"{part_name(n)}.json").is_file()]
    (out / PARTS).mkdir(parents=True, exist_ok=True)
    (out / DONE).mkdir(exist_ok=True)
    meter = bar(sum(len(inputs[n * per_file:(n + 1) * per_file]) for n in mine))
    encoder = encoder_factory() if mine else None
    for n in mine:
        items = inputs[n * per_file:(n + 1) * per_file]
        rows, skipped = encode_part(job, encoder, items)
        for entry in skipped:
            log(f"skipped {entry['file']}: {entry['reason']}")
        if rows:
            parquet.write_parquet(out / PARTS / f"{part_name(n)}.parquet", rows, kind=job.kind,
                                  rows_per_group=per_file)
        files.write_json(out / DONE / f"{part_name(n)}.json", {"rows": len(rows), "skipped": skipped})
        meter.update(len(items))
    meter.close()
    return finish(job, out, parts)


def finish(job: Job, out: pathlib.Path, parts: int) -> dict[str, Any]:
    """When every part is done: ``skipped.json``, the count in ``metadata.json`` and ``COMPLETE``."""
    marks = [out / DONE / f"{part_name(n)}.json" for n in range(parts)]
    if not all(m.is_file() for m in marks):
        return {"rows": None, "skipped": None, "complete": False}
    done = [json.loads(m.read_text()) for m in marks]
    rows, skipped = sum(d["rows"] for d in done), [s for d in done for s in d["skipped"]]
    files.write_json(out / "skipped.json", skipped)
    if rows:
        files.write_json(out / "metadata.json", {**job.identity, "count": rows})
        files.write_json(out / COMPLETE, {"rows": rows, "skipped": len(skipped)})
    return {"rows": rows, "skipped": skipped, "complete": bool(rows)}


def summary(out: pathlib.Path) -> dict[str, Any]:
    """A complete folder's rows and skipped inputs."""
    return {"rows": json.loads((out / COMPLETE).read_text())["rows"],
            "skipped": json.loads((out / "skipped.json").read_text()), "complete": True}
