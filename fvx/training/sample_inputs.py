"""What ``sample`` reads beside the prompts, by the run's data kind, and the condition each makes as the data
stores it: a first frame (image-to-video, world models, sections of a model reading the start image's features, or
optionally Helios's chunks) and FramePack's last image, a file of per-frame actions, a control video with its mask
and reference image, an animation's pose and face videos (and the replace mode's background and mask). Each reader
refuses in one line an input its model does not take, or the lack of one it needs.

Helios's chunks from an image (``HeliosPipeline(image=...)``): the chunks are made after the image, as ``vanilla``
sections are (:func:`made_cut`: one latent frame more, the image's slot); each chunk's history holds the image's latent
in its first-frame slot, and the frame before the first chunk is the last latent of the image held still for a
chunk's frames, encoded (the pipeline's ``fake_image_latents``); both are noised, ``x = s e + (1 - s) x`` with ``s ~
U(0.111, 0.135)`` drawn for each (:func:`noised_start`). The video is the chunks alone, as the pipeline's (its VAE
decodes them chunk by chunk), so ``--frames`` counts the same frames from text or from an image.

Helios's chunks after a video (``HeliosPipeline(video=...)``): the video's first frame is encoded alone as the prefix
and its last whole chunks each on its own (:func:`video_start`); the chunks made after them see them as the frames
before (a video shorter than the history left-padded with zeros), each latent frame noised at its own ``s``, the
prefix at one. The video made is the given chunks, clean, then the new ones; ``--frames`` counts the new ones.

A model that continues a video's first latent frames (its cond reads :data:`GIVEN_VIDEO`, Cosmos 3's ``video=``) takes
``--video`` whatever the run's data kind: the video cut to the made video's frames (its last frame repeated when it is
shorter, as the pipeline pads it) and size, encoded as the data's latents; the model reads its first frames."""
from __future__ import annotations

import pathlib
from typing import Any, Callable, Mapping, NamedTuple

import msgspec
import torch

from fvx.core import random
from fvx.data import media, parquet, preprocess, sections

ACTIONS_KIND = "matrixgame2"  # the data kind whose videos are steered by per-frame actions, not text
IMAGE_KINDS = parquet.FIRST_FRAME_KINDS  # the data kinds whose videos start from a given first frame
CONTROL_KIND = "vace"  # the data kind whose videos follow a control video (its mask, a reference image)
SECTIONS_KIND = "framepack"  # the data kind whose videos are made a section at a time (FramePack, Helios)
ANIMATE_KIND = "animate"  # the data kind whose videos animate a character image by pose and face videos (Wan-Animate)
GIVEN_VIDEO = "given_latents"  # the cond of a model that continues a given video's first latent frames (its latents)


def video_frames(model: Any, shape: Any) -> int:
    """The video frames of latents ``shape``: ``1 + r (T - 1)`` at the VAE's time stride ``r`` (``T`` without the
    model's lead frames: Wan-Animate's reference slot)."""
    return 1 + model.latents.vae_stride[0] * (video_shape(shape)[1] - model.lead_frames - 1)


def video_shape(shape: Any) -> tuple[int, int, int, int]:
    """The video's latent shape ``[C, T, H, W]`` of ``shape`` (a joint model's ``{modality: shape}``)."""
    return shape["video"] if isinstance(shape, Mapping) else shape


def read_first_frame(path: str | None, kind: str, model: Any, cut: sections.SectionsConfig) -> Any:
    """The ``--image`` file as uint8 ``[1, H, W, 3]``; a ValueError when it is missing for an image-to-video model
    (the run's data ``kind`` one of :data:`IMAGE_KINDS`, sections of a model that reads the start image's features:
    FramePack, or an animation's character), given to a model that takes none (Helios's chunks, ``cut``, take one or
    none), or does not decode."""
    needs = kind in (*IMAGE_KINDS, ANIMATE_KIND) or (kind == SECTIONS_KIND and "image_embeds" in model.cond)
    if path is None:
        if needs:
            raise ValueError(f"sample: {model.name} makes videos from an image (the run's data.kind={kind}): give "
                             "--image" + (" (the character to animate)" if kind == ANIMATE_KIND else ""))
        return None
    if not (needs or (kind == SECTIONS_KIND and cut.order == "chunks")):
        raise ValueError(f"--image: {model.name} makes videos from text only (the run's data.kind={kind}); drop "
                         "--image")
    return read_file("--image", path, media.read_image)


def read_video(path: str | None, kind: str, model: Any, cut: sections.SectionsConfig, image: Any) -> Any:
    """The ``--video`` file's frames as uint8 ``[F, H, W, 3]`` (None: none); a ValueError unless the model continues a
    video (Helios's chunks, a model reading :data:`GIVEN_VIDEO`) and no ``--image`` is given too, when a model reading
    :data:`GIVEN_VIDEO` has none, or when it does not decode."""
    given = GIVEN_VIDEO in model.cond
    if path is None:
        if given:
            raise ValueError(f"sample: {model.name} continues a video's first frames: give --video")
        return None
    if not (given or (kind == SECTIONS_KIND and cut.order == "chunks")):
        raise ValueError(f"--video: {model.name} does not continue a video (Helios's chunks; this run: "
                         f"data.kind={kind}, data.sections.order={cut.order}); drop --video")
    if image is not None:
        raise ValueError("--video: give --image or --video, not both")
    return read_file("--video", path, media.read_all_frames)


def chunk_frames(model: Any, cut: sections.SectionsConfig) -> int:
    """The video frames of one section of ``cut.window`` latent frames: ``1 + r (window - 1)``, ``r`` the VAE's time
    stride."""
    return 1 + model.latents.vae_stride[0] * (cut.window - 1)


def video_chunks(frames: int, model: Any, cut: sections.SectionsConfig) -> int:
    """The whole chunks (:func:`chunk_frames` each) of a given video of ``frames`` frames; a ValueError when it holds
    none."""
    chunk = chunk_frames(model, cut)
    if frames < chunk:
        raise ValueError(f"--video: {model.name} continues whole chunks of {chunk} frames "
                         f"(data.sections.window={cut.window} latent frames); the video has {frames}")
    return frames // chunk


def read_last_image(path: str | None, kind: str, model: Any, cut: sections.SectionsConfig) -> Any:
    """The ``--last-image`` file as uint8 ``[1, H, W, 3]`` (None: none); a ValueError unless the model makes sections
    last first from a start image's features (FramePack's ``inverted_anti_drifting``, as
    ``HunyuanVideoFramepackPipeline`` takes ``last_image``), or when it does not decode."""
    if path is None:
        return None
    if not (kind == SECTIONS_KIND and "image_embeds" in model.cond and cut.order == "inverted_anti_drifting"):
        raise ValueError(f"--last-image: {model.name} does not make its video last section first from a start image "
                         f"(FramePack's inverted_anti_drifting sections; this run: data.kind={kind}, "
                         f"data.sections.order={cut.order}); drop --last-image")
    return read_file("--last-image", path, media.read_image)


def read_file(flag: str, path: str, read: Callable[[pathlib.Path], Any]) -> Any:
    """The file ``path`` of option ``flag`` through ``read`` (``media.read_image``: uint8 ``[1, H, W, 3]``;
    ``media.read_all_frames``: ``[F, H, W, 3]``); a ValueError naming both when it is missing or does not decode."""
    if not pathlib.Path(path).is_file():
        raise ValueError(f"{flag} {path!r} does not exist")
    try:
        return read(pathlib.Path(path))
    except media.MediaError as error:
        raise ValueError(f"{flag} {path!r}: {error}") from None


def read_actions(path: str | None, kind: str, model: Any, frames: int) -> dict[str, Any] | None:
    """The ``--actions`` file (``fvx.data.preprocess.read_action_file``: keyboard and mouse rows, one per video frame)
    cut to the ``frames`` video frames sampled; a ValueError when it is missing for an action-steered model, given to
    another one, unreadable, or shorter than the video."""
    if path is None:
        if kind == ACTIONS_KIND:
            raise ValueError(f"sample: {model.name} is steered by per-frame actions (the run's data.kind={kind}): give "
                             "--actions FILE (.npz of keyboard [F, K] and mouse [F, 2], or .npy of the keyboard)")
        return None
    if kind != ACTIONS_KIND:
        raise ValueError(f"--actions: {model.name} takes no actions (the run's data.kind={kind}); drop --actions")
    found = preprocess.read_action_file(pathlib.Path(path))
    for name, rows in found.items():
        if rows.shape[0] < frames:
            raise ValueError(f"--actions {path!r}: {name} has {rows.shape[0]} rows, but the video has {frames} frames "
                             "(one row per video frame; fewer --frames, or a longer file)")
    return {name: rows[:frames] for name, rows in found.items()}


def read_control(request: Any, kind: str, model: Any, frames: int) -> dict[str, Any] | None:
    """The ``--control`` video's first ``frames`` frames, the ``--mask`` video's and the ``--reference`` image (uint8
    ``[F, H, W, 3]``, ``[1, H, W, 3]``; None: not given); a ValueError when the control video is missing for a
    control model (the run's data ``kind`` is :data:`CONTROL_KIND`), any is given to another model, or one does not
    exist, decode or reach ``frames`` frames."""
    given = {"control": request.control, "mask": request.mask, "reference": request.reference}
    if kind != CONTROL_KIND:
        extra = [f"--{name}" for name, path in given.items()
                 if path is not None and (name, kind) != ("mask", ANIMATE_KIND)]  # (the replace mode's mask)
        if extra:
            raise ValueError(f"{extra[0]}: {model.name} takes no control video (the run's data.kind={kind}); drop "
                             f"{' '.join(extra)}")
        return None
    if request.control is None:
        raise ValueError(f"sample: {model.name} follows a control video (the run's data.kind={kind}): give --control "
                         "VIDEO (and optionally --mask VIDEO, white where to make the video, and --reference IMAGE)")
    read = {}
    for name, path in given.items():
        if path is None:
            continue
        if not pathlib.Path(path).is_file():
            raise ValueError(f"--{name} {path!r} does not exist")
        try:
            read[name] = (media.read_image(pathlib.Path(path)) if name == "reference"
                          else media.read_frames(pathlib.Path(path), range(frames)))
        except media.MediaError as error:
            takes = "" if name == "reference" else f" (the video takes its first {frames} frames)"
            raise ValueError(f"--{name} {path!r}: {error}{takes}") from None
    return read


def read_animation(request: Any, kind: str, model: Any, frames: int) -> dict[str, Any] | None:
    """The ``--pose`` and ``--face`` videos' first ``frames`` frames (uint8 ``[F, H, W, 3]``), and the replace mode's
    ``--background`` and ``--mask`` when given; a ValueError when the pose or face video is missing for an animation
    model (the run's data ``kind`` is :data:`ANIMATE_KIND`), a background comes without its mask or the reverse, one is
    given to another model, or does not exist, decode or reach ``frames`` frames."""
    given = {"pose": request.pose, "face": request.face, "background": request.background}
    if kind != ANIMATE_KIND:
        extra = [f"--{name}" for name, path in given.items() if path is not None]
        if extra:
            raise ValueError(f"{extra[0]}: {model.name} animates no character (the run's data.kind={kind}); drop "
                             f"{' '.join(extra)}")
        return None
    missing = [f"--{name} VIDEO" for name in ("pose", "face") if given[name] is None]
    if missing:
        raise ValueError(f"sample: {model.name} animates the --image character by a pose and a face video (the run's "
                         f"data.kind={kind}): give {' and '.join(missing)}")
    if (request.background is None) != (request.mask is None):
        raise ValueError("--background and --mask go together: the replace mode puts the character into the "
                         "background video where the mask video is white")
    read = {}
    for name, path in {**given, "mask": request.mask}.items():
        if path is None:
            continue
        if not pathlib.Path(path).is_file():
            raise ValueError(f"--{name} {path!r} does not exist")
        try:
            read[name] = media.read_frames(pathlib.Path(path), range(frames))
        except media.MediaError as error:
            raise ValueError(f"--{name} {path!r}: {error} (the video takes its first {frames} frames)") from None
    return read


def made_cut(cut: sections.SectionsConfig, start: Any) -> sections.SectionsConfig:
    """How a video is cut into the sections it is made in: the data's ``cut``, but Helios's chunks from a ``start``
    (an image or a video) are made after it, as ``vanilla`` sections are (module docstring)."""
    return msgspec.structs.replace(cut, order="vanilla") if start is not None and cut.order == "chunks" else cut


def section_shape(cut: sections.SectionsConfig, model: Any, shape: tuple[int, int, int, int],
                  frames_asked: int | None, start: Any = None, given: int = 0) -> tuple[int, int, int, int]:
    """The latents made a section at a time in ``cut``'s sections: the video's, ``--frames``' (checked to hold whole
    sections) or two sections by default (the data's shape is one section's), and for Helios's chunks from a
    ``start`` one frame before them, the start's slot, and the ``given`` latent frames of a video's chunks (module
    docstring)."""
    video = _section_shape(cut, model, shape, frames_asked)
    lead = int(made_cut(cut, start) is not cut)
    return (video[0], video[1] + lead + given, *video[2:])


def _section_shape(cut: sections.SectionsConfig, model: Any, shape: tuple[int, int, int, int],
                   frames_asked: int | None) -> tuple[int, int, int, int]:
    if cut.order == "one_frame":  # the image, then the one frame made from it
        if frames_asked is not None:
            raise ValueError(f"--frames {frames_asked}: {model.name} makes one frame from --image "
                             "(data.sections.order=one_frame); drop --frames")
        return (shape[0], 2, *shape[2:])
    if frames_asked is None:
        return (shape[0], sections.first_frame(cut, 2), *shape[2:])
    made = sections.count(shape[1], cut)
    if made < 1 or sections.first_frame(cut, made) != shape[1]:
        stride = model.latents.vae_stride[0]
        whole = [1 + stride * (sections.first_frame(cut, k) - 1) for k in (1, 2, 3)]
        raise ValueError(f"--frames {frames_asked}: {model.name} makes a video of whole sections of "
                         f"data.sections.window={cut.window} latent frames ({cut.order}): e.g. "
                         f"{', '.join(map(str, whole))} frames")
    return shape


def reflect_pad(frames: Any, count: int) -> Any:
    """``frames [F, ...]`` padded to ``count`` by reflection (1 2 3 -> 1 2 3 2 1 2 ...), as ``WanAnimatePipeline``
    pads its pose and face videos."""
    period = max(2 * (len(frames) - 1), 1)
    index = [i % period for i in range(max(count, len(frames)))]
    return frames[[i if i < len(frames) else period - i for i in index]]


def made_clip(model: Any, shape: tuple[int, int, int, int], fps: float) -> preprocess.Clip:
    """What ``sample``'s prompts describe (a family whose text states it): the made video of latents ``shape``, its
    frames at ``fps`` and its pixel size."""
    _, stride_h, stride_w = model.latents.vae_stride
    return preprocess.Clip(video_frames(model, shape), float(fps), shape[2] * stride_h, shape[3] * stride_w)


def video_condition(encoder: Any, video: Any, shape: tuple[int, int, int, int], model: Any) -> dict[str, Any]:
    """A video-to-video condition as the data gives it: the video's first frames centre-cropped and resized to the
    made video's size, its last frame repeated to the made video's length when shorter, encoded: the data's
    ``latents``, from which the model's cond takes :data:`GIVEN_VIDEO`."""
    _, stride_h, stride_w = model.latents.vae_stride
    frames = video_frames(model, shape)
    clip = media.resize_crop(video[:frames], shape[2] * stride_h, shape[3] * stride_w)  # [3, F, H, W] in [-1, 1]
    clip = torch.cat([clip, clip[:, -1:].expand(-1, frames - clip.shape[1], -1, -1)], dim=1)
    return {"latents": encoder.encode_video(clip).numpy()}


def image_condition(encoder: Any, image: Any, shape: tuple[int, int, int, int], model: Any) -> dict[str, Any]:
    """An image-to-video condition as the data stores it: the image centre-cropped and resized to the video's pixel
    size, as the first of its frames (the rest zeros), encoded (``first_frame_latents``), and its image features
    (``image_embeds``) when the model reads them."""
    stride_t, stride_h, stride_w = model.latents.vae_stride
    frames, height, width = 1 + stride_t * (shape[1] - 1), shape[2] * stride_h, shape[3] * stride_w
    first = media.resize_crop(image, height, width)  # [3, 1, H, W] in [-1, 1]
    clip = torch.cat([first, torch.zeros(3, frames - 1, height, width)], dim=1)
    extra = {"first_frame_latents": encoder.encode_first_frame(clip).numpy()}
    features = encoder.encode_image((first[:, 0] + 1) / 2)
    if features is not None:
        extra["image_embeds"] = features.numpy()
    return extra


class Start(NamedTuple):
    """A section video's given start, latents ``[N, C, 1, h, w]`` in the model's scale: ``image``, the video's first
    frame and the history's first-frame slot; ``before``, the frame the first section's history sees before it
    (FramePack: the image; Helios: the image held still, encoded, module docstring); ``noised``: both get Helios's
    noise before sampling, and the video is the sections alone (:attr:`shown`); ``last``: the frame the first section
    made sees after it (FramePack's last image), or None; ``given``: a given video's chunks ``[N, C, k W, h, w]``,
    made before the first section (Helios's video, whose ``before`` is None: zeros), or None."""

    image: torch.Tensor
    before: torch.Tensor | None
    noised: bool = False
    last: torch.Tensor | None = None
    given: torch.Tensor | None = None

    @property
    def shown(self) -> bool:
        """Whether the image is the video's first frame (FramePack's) or only the chunks' condition (Helios's)."""
        return not self.noised

    def to(self, device: Any, count: int) -> "Start":
        """On ``device``, one row per video of ``count``."""
        def rows(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(device).expand(count, -1, -1, -1, -1)

        return Start(rows(self.image), rows(self.before), self.noised, rows(self.last), rows(self.given))


IMAGE_NOISE = (0.111, 0.135)  # HeliosPipeline's image_noise_sigma_min/max (and video_noise_sigma_min/max)
IMAGE_NOISE_STREAM = 0x5EC7  # fold_in(sampler key, it): a video's draws of its start's noise


def noised_start(start: Start, keys: torch.Tensor) -> Start:
    """``start`` as ``HeliosPipeline`` noises a given image or video (module docstring), each video from its sampler
    key ``keys [N, 2]``: for the image, the frame before and each frame of the given chunks, ``s ~ U(0.111, 0.135)``
    and ``e ~ N(0, I)``."""
    low, high = IMAGE_NOISE

    def noised(x: torch.Tensor | None, stream: int, frames: int) -> torch.Tensor | None:
        if x is None:
            return None
        draws = torch.vmap(lambda k: random.split(random.fold_in(random.fold_in(k, IMAGE_NOISE_STREAM), stream)))(keys)
        s = torch.stack([random.uniform(k, (frames,)) for k in draws[:, 0]]).to(x.device)
        s = (low + (high - low) * s).view(-1, 1, frames, 1, 1)
        return s * random.normal_each(draws[:, 1], tuple(x.shape[1:]), device=x.device) + (1 - s) * x

    given = None if start.given is None else noised(start.given, 2, start.given.shape[2])
    return start._replace(image=noised(start.image, 0, 1), before=noised(start.before, 1, 1), given=given)


def video_start(encoder: Any, frames: Any, height: int, width: int, model: Any,
                cut: sections.SectionsConfig) -> Start:
    """A given video's :class:`Start` (uint8 ``frames [F, H0, W0, 3]`` at ``height x width`` pixels) as
    ``HeliosPipeline.prepare_video_latents`` encodes it: the first frame alone, the last whole chunks each on its own
    (the frames before them dropped)."""
    video = media.resize_crop(frames, height, width)  # [3, F, H, W] in [-1, 1]
    chunk = chunk_frames(model, cut)
    count = video_chunks(video.shape[1], model, cut)
    begin = video.shape[1] - count * chunk
    latents = [model.normalize(encoder.encode_video(video[:, s:s + chunk])[None].float())
               for s in range(begin, video.shape[1], chunk)]
    prefix = model.normalize(encoder.encode_video(video[:, :1])[None].float())
    return Start(prefix, None, noised=True, given=torch.cat(latents, dim=2))


def section_condition(encoder: Any, image: Any, shape: tuple[int, int, int, int], model: Any,
                      cut: sections.SectionsConfig, last: Any = None,
                      video: Any = None) -> tuple[dict[str, Any], Start | None]:
    """A section model's condition as its data stores it (the start image's features when the model reads them; a
    placeholder history the sampler replaces section by section) and, given an ``image``, its :class:`Start`
    (Helios's chunks: ``cut.order`` chunks; the module docstring). A ``last`` image (FramePack's) is the frame after
    the video, its features averaged with the start image's, as ``HunyuanVideoFramepackPipeline`` takes
    ``last_image``; a ``video`` (Helios's) is continued (:func:`video_start`)."""
    channels, frames, height, width = shape
    blank = torch.zeros(channels, frames, height, width)
    start = image if video is None else video
    extra = {"framepack_history": torch.zeros(channels, sections.HISTORY, height, width).numpy(),
             "frame_indices": sections.history_of(blank, 0, made_cut(cut, start))["frame_indices"].numpy()}
    _, stride_h, stride_w = model.latents.vae_stride
    if video is not None:
        return extra, video_start(encoder, video, height * stride_h, width * stride_w, model, cut)
    if image is None:
        return extra, None
    first = media.resize_crop(image, height * stride_h, width * stride_w)  # [3, 1, H, W] in [-1, 1]
    end = None if last is None else media.resize_crop(last, height * stride_h, width * stride_w)
    if "image_embeds" in model.cond:
        features = encoder.encode_image((first[:, 0] + 1) / 2)
        if end is not None:
            features = (features + encoder.encode_image((end[:, 0] + 1) / 2)) / 2
        extra["image_embeds"] = features.numpy()
    latents = model.normalize(encoder.encode_video(first)[None].float())
    if cut.order != "chunks":
        after = None if end is None else model.normalize(encoder.encode_video(end)[None].float())
        return extra, Start(latents, latents, last=after)
    held = first.expand(-1, chunk_frames(model, cut), -1, -1)  # the image as a still chunk
    return extra, Start(latents, model.normalize(encoder.encode_video(held)[None, :, -1:].float()), noised=True)


def control_condition(encoder: Any, control: dict[str, Any], shape: tuple[int, int, int, int],
                      model: Any) -> dict[str, Any]:
    """A control model's condition as the data stores it: the control video, mask and reference image at the video's
    pixel size (``shape``'s latents) as preprocessing prepares them (``preprocess.control_inputs``), through the
    encoder's context (``vace_context``)."""
    _, stride_h, stride_w = model.latents.vae_stride
    video, mask, refs = preprocess.control_inputs(control["control"], control.get("mask"), control.get("reference"),
                                                  shape[2] * stride_h, shape[3] * stride_w)
    return {"vace_context": encoder.encode_context(video, mask, refs).numpy()}


def animation_condition(encoder: Any, image: Any, animation: dict[str, Any], shape: tuple[int, int, int, int],
                        model: Any, previous: torch.Tensor | None = None) -> dict[str, Any]:
    """An animation model's condition as preprocessing stores it (``preprocess.encode_segment``):
    the character image and pose video at the video's pixel size (``shape``'s latents, the reference's slot in
    front), the face video at the size the model reads and the frames made before a later segment (``previous [3, P,
    H, W]`` in [-1, 1]; None: a first segment), through the encoder's animation inputs, and the character's image
    features; the face pixels in [-1, 1] as the data reads them."""
    stride_t, stride_h, stride_w = model.latents.vae_stride
    face_size = model.cond["face_pixels"][2]
    height, width = shape[2] * stride_h, shape[3] * stride_w
    reference = media.resize_crop(image, height, width)[:, 0]
    face = preprocess.hold(preprocess.face_pixels(animation["face"], face_size), 4 // stride_t)
    replace = preprocess.replacement(animation.get("background"), animation.get("mask"), height, width)
    out = encoder.encode_animation(reference, media.resize_crop(animation["pose"], height, width), face, previous,
                                   *replace)
    return {"reference_latents": out["reference_latents"].numpy(), "pose_latents": out["pose_latents"].numpy(),
            "face_pixels": (out["face_pixels"].float() / 127.5 - 1).numpy(),
            "image_embeds": encoder.encode_image((reference + 1) / 2).numpy()}


def given_condition(kind: str, encoder: Any, image: Any, control: dict[str, Any] | None,
                    actions: dict[str, Any] | None, shape: tuple[int, int, int, int], model: Any,
                    cut: sections.SectionsConfig, last: Any = None,
                    video: Any = None) -> tuple[dict[str, Any] | None, Start | None]:
    """The condition ``sample``'s inputs make for videos of latents ``shape`` (the first segment's, for an
    animation), with the actions' rows, and a section model's given :class:`Start` (None: none; ``last``: its last
    image; ``video``: the video it continues)."""
    given, first = None, None
    if kind == SECTIONS_KIND:
        given, first = section_condition(encoder, image, shape, model, cut, last, video)
    elif kind == ANIMATE_KIND and control is not None:
        segment = {name: video[:video_frames(model, shape)] for name, video in control.items()}
        given = animation_condition(encoder, image, segment, shape, model)
    elif control is not None:
        given = control_condition(encoder, control, shape, model)
    elif video is not None and GIVEN_VIDEO in model.cond:
        given = video_condition(encoder, video, shape, model)
    elif image is not None:
        given = image_condition(encoder, image, shape, model)
    return (given if actions is None else {**given, **actions}), first
