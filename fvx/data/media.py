"""Media files: reading them for preprocessing (video frames with PyAV, images, audio tracks; frame sampling, resizing
and cropping) and writing videos (lossless mp4 for data, playable mp4 with sound and GIF for people).

A clip leaves here as ``[3, T, H, W]`` float32 in [-1, 1] (``2 uint8 / 255 - 1``, as FastVideo's preprocessing makes
pixel values). Which frames, and how they are resized and cropped, follow FastVideo's preprocessing (docs/design.md
section 2, "Preprocessing"); every function but the decoders and the writer is pure and tested against hand-computed
indices.
"""
from __future__ import annotations

import contextlib
import fractions
import io
import math
import pathlib
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

AAC_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)  # an mp4's sound
VIDEO_SUFFIXES = (".mp4", ".mov", ".webm", ".mkv", ".avi", ".m4v", ".gif")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


class MediaError(ValueError):
    """A file cannot be used as a clip; the message is the reason (the caller names the file)."""


def is_image(path: pathlib.Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES


def is_media(path: pathlib.Path) -> bool:
    return path.suffix.lower() in VIDEO_SUFFIXES + IMAGE_SUFFIXES


@contextlib.contextmanager
def _video_stream(path: pathlib.Path) -> Iterator[tuple[Any, Any, float]]:
    """(container, first video stream, its fps) of ``path``; FFmpeg's errors as a MediaError with the reason."""
    import av  # the .[data] extra

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError("it has no video stream")
            stream = container.streams.video[0]
            yield container, stream, float(stream.average_rate or stream.guessed_rate or 0)
    except (av.error.FFmpegError, OSError, ValueError) as error:
        raise MediaError(f"it does not decode as video: {_reason(error)}") from None


def _reason(error: Exception) -> str:
    """An FFmpeg error's reason without its errno and file name (the caller names the file)."""
    return getattr(error, "strerror", None) or str(error)


def probe_video(path: pathlib.Path) -> tuple[float, float]:
    """(fps, duration in s) of ``path``'s first video stream from its header; a MediaError when it has none."""
    with _video_stream(path) as (container, stream, fps):
        if stream.duration is not None and stream.time_base is not None:
            duration = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            duration = container.duration / 1_000_000
        else:
            duration = float(stream.frames) / fps if fps and stream.frames else 0.0
    if fps <= 0 or duration <= 0:
        raise MediaError("its frame rate or duration is unknown")
    return fps, duration


def read_frames(path: pathlib.Path, indices: Sequence[int]) -> np.ndarray:
    """uint8 frames ``[len(indices), H, W, 3]`` (RGB) of ``path``'s first video stream, frame ``indices[i]`` (in
    decode order; repeats allowed) at ``i``, decoding no further than the last; a MediaError when one is missing."""
    indices = list(indices)
    wanted, frames = set(indices), {}
    last = max(wanted, default=-1)
    with _video_stream(path) as (container, stream, _):
        for number, frame in enumerate(container.decode(stream)):
            if number > last:
                break
            if number in wanted:
                frames[number] = frame.to_ndarray(format="rgb24")
    missing = sorted(wanted - set(frames))
    if missing:
        raise MediaError(f"it decodes to {len(frames)} of the frames its header promises (frame {missing[0]} is "
                         "missing)")
    return np.stack([frames[i] for i in indices])


def read_all_frames(path: pathlib.Path) -> np.ndarray:
    """uint8 frames ``[F, H, W, 3]`` (RGB) of every frame of ``path``'s first video stream; a MediaError when it
    decodes to none."""
    with _video_stream(path) as (container, stream, _):
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    if not frames:
        raise MediaError("it decodes to no frame")
    return np.stack(frames)


def write_video(path: pathlib.Path, frames: np.ndarray, fps: int) -> None:
    """uint8 frames ``[T, H, W, 3]`` as a lossless mp4 (RGB H.264, ``crf`` 0) at ``fps``: decodes to the same pixels."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264rgb", rate=fps, options={"crf": "0", "preset": "ultrafast"})
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "rgb24"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode(None))


def write_mp4(path: pathlib.Path, frames: np.ndarray, fps: float, audio: np.ndarray | None = None,
              sample_rate: int | None = None) -> None:
    """uint8 frames ``[T, H, W, 3]`` as an mp4 every player shows: H.264 in yuv420p (``crf`` 17, odd sizes padded by
    a repeated edge), with ``audio`` ``[C, S]`` float in [-1, 1] at ``sample_rate`` as an AAC track when given
    (resampled to the next rate AAC has when it has not this one)."""
    import av

    height, width = frames.shape[1:3]
    padded = np.pad(frames, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")
    rate = fractions.Fraction(fps).limit_denominator(1001)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=rate, options={"crf": "17", "preset": "medium"})
        stream.height, stream.width = padded.shape[1:3]
        stream.pix_fmt = "yuv420p"
        sound = None
        if audio is not None:
            track_rate = min((r for r in AAC_RATES if r >= sample_rate), default=AAC_RATES[-1])
            sound = container.add_stream("aac", rate=track_rate)
            sound.layout = "stereo" if audio.shape[0] == 2 else "mono"
        for frame in padded:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode(None))
        if sound is not None:
            planes = np.ascontiguousarray(np.clip(audio, -1.0, 1.0).astype(np.float32))
            chunk = av.AudioFrame.from_ndarray(planes, format="fltp", layout=sound.layout.name)
            chunk.sample_rate = int(sample_rate)
            resampler = av.AudioResampler(format="fltp", layout=sound.layout.name, rate=track_rate)
            for part in [*resampler.resample(chunk), *resampler.resample(None)]:
                container.mux(sound.encode(part))
            container.mux(sound.encode(None))


def gif_bytes(frames: np.ndarray, fps: float) -> bytes:
    """uint8 frames ``[T, H, W, C]`` as a looping animated GIF. GIF delays are whole 1/100 s (16 fps plays at 60 ms a
    frame), and Pillow merges identical consecutive frames into one longer frame."""
    from PIL import Image

    images = [Image.fromarray(frame[..., 0] if frame.shape[-1] == 1 else frame) for frame in frames]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:],
                   duration=max(1, round(1000.0 / fps)), loop=0)
    return buffer.getvalue()


def read_image(path: pathlib.Path) -> np.ndarray:
    """An image file as uint8 ``[1, H, W, 3]`` (RGB); a MediaError when it does not decode."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return np.array(image.convert("RGB"))[None]
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise MediaError(f"it does not decode as an image: {error}") from None


def read_audio(path: pathlib.Path, rate: int, start: float, duration: float) -> torch.Tensor:
    """Stereo float32 ``[2, round(duration * rate)]`` in [-1, 1] of ``path``'s first audio stream from ``start`` s,
    resampled to ``rate`` Hz (mono is duplicated); a MediaError when there is none or it does not decode."""
    import av

    wanted = round(duration * rate)
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise MediaError("it has no audio track")
            resampler = av.AudioResampler(format="fltp", layout="stereo", rate=rate)
            chunks = []
            for frame in container.decode(container.streams.audio[0]):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray())
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray())
    except MediaError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as error:
        raise MediaError(f"its audio track does not decode: {_reason(error)}") from None
    if not chunks:
        raise MediaError("its audio track holds no samples")
    audio = np.concatenate(chunks, axis=1)
    first = round(start * rate)
    audio = audio[:, first:first + wanted]
    if audio.shape[1] < wanted:
        raise MediaError(f"its audio track is {audio.shape[1] / rate:.2f} s from {start:.2f} s, shorter than the "
                         f"clip's {duration:.2f} s")
    return torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))


# ---------------------------------------------------------------------------------------------------- frame choice


def frame_indices(fps: float, duration: float, *, num_frames: int, train_fps: float, tolerance: float) -> np.ndarray:
    """The source frames of a clip (FastVideo's ``FrameSamplingStage``): every ``fps / train_fps``-th frame from 0,
    ``int(arange(0, ceil(fps * duration), fps / train_fps))``, the first ``num_frames`` of them. A MediaError when the
    video is longer than ``tolerance`` clips (``ceil(fps * duration) / fps > tolerance * num_frames / train_fps``)
    or yields fewer than ``num_frames`` frames."""
    total = math.ceil(fps * duration)
    if total / fps > tolerance * (num_frames / train_fps):
        raise MediaError(f"it lasts {total / fps:.2f} s, longer than video_length_tolerance_range={tolerance:g} "
                         f"clips of {num_frames / train_fps:.2f} s ({num_frames} frames at {train_fps:g} fps)")
    indices = np.arange(0, total, fps / train_fps).astype(int)
    if len(indices) < num_frames:
        raise MediaError(f"it yields {len(indices)} frames at train_fps={train_fps:g} ({duration:.2f} s at "
                         f"{fps:g} fps), fewer than num_frames={num_frames}")
    return indices[:num_frames]


def usable_frames(count: int, step: int, base: int = 1) -> int:
    """The largest ``base + step * k <= count``: the frames a VAE of temporal compression ``step`` takes (0: none)."""
    return base + step * ((count - base) // step) if count >= base else 0


# ------------------------------------------------------------------------------------------------ resize and crop


def check_size(height: int, width: int, multiple: int, what: str) -> None:
    """A ValueError naming ``what`` unless ``height`` and ``width`` are positive multiples of ``multiple``."""
    if height % multiple or width % multiple:
        raise ValueError(f"{what} {height}x{width} is not a multiple of {multiple} in both sides (the family's VAE "
                         f"compression times its patch); e.g. {max(multiple, height - height % multiple)}x"
                         f"{max(multiple, width - width % multiple)}")


def nearest_bucket(height: int, width: int, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bucket ``(h, w)`` whose aspect ratio is nearest the frame's (in log ratio; the first on ties)."""
    ratio = math.log(height / width)
    return min(buckets, key=lambda hw: abs(math.log(hw[0] / hw[1]) - ratio))


def crop_box(height: int, width: int, target_height: int, target_width: int) -> tuple[int, int, int, int]:
    """(top, left, crop height, crop width): the centred crop of a ``height x width`` frame to the target's aspect
    ratio (FastVideo's ``CenterCropResizeVideo``: ``int`` of the kept side, ``round`` of the offsets)."""
    ratio = target_height / target_width
    if height / width > ratio:
        crop_h, crop_w = int(width * ratio), width
    else:
        crop_h, crop_w = height, int(height / ratio)
    return round((height - crop_h) / 2), round((width - crop_w) / 2), crop_h, crop_w


def resize_crop(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """uint8 frames ``[T, H0, W0, 3]`` -> float32 ``[3, T, height, width]`` in [-1, 1]: centre-cropped to the target's
    aspect ratio, then resized to exactly ``height x width`` (bilinear, ``align_corners=True``, antialiased, on the
    uint8 pixels) and mapped by ``2 x / 255 - 1``, as FastVideo's preprocessing does."""
    top, left, crop_h, crop_w = crop_box(frames.shape[1], frames.shape[2], height, width)
    x = torch.from_numpy(np.ascontiguousarray(frames[:, top:top + crop_h, left:left + crop_w])).permute(0, 3, 1, 2)
    if (crop_h, crop_w) != (height, width):
        x = F.interpolate(x.contiguous(), size=(height, width), mode="bilinear", align_corners=True, antialias=True)
    return ((x.float() / 255.0) * 2.0 - 1.0).clamp(-1.0, 1.0).permute(1, 0, 2, 3).contiguous()


def fit_on_white(image: np.ndarray, height: int, width: int) -> torch.Tensor:
    """A uint8 image ``[1, H0, W0, 3]`` -> float32 ``[3, height, width]`` in [-1, 1]: mapped by ``2 x / 255 - 1``,
    scaled to fit (bilinear, ``align_corners=False``) and centred on white, as diffusers' ``WanVACEPipeline`` prepares
    a reference image."""
    x = torch.from_numpy(np.ascontiguousarray(image[0])).permute(2, 0, 1)[None].float() / 255.0 * 2.0 - 1.0
    scale = min(height / x.shape[2], width / x.shape[3])
    size = (int(x.shape[2] * scale), int(x.shape[3] * scale))
    resized = F.interpolate(x, size=size, mode="bilinear", align_corners=False)[0]
    top, left = (height - size[0]) // 2, (width - size[1]) // 2
    canvas = torch.ones(3, height, width)
    canvas[:, top:top + size[0], left:left + size[1]] = resized
    return canvas
