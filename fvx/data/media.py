"""Reading media for preprocessing: video frames (PyAV), images, audio tracks; frame sampling, resizing and cropping.

A clip leaves here as ``[3, T, H, W]`` float32 in [-1, 1] (``uint8 / 127.5 - 1``, as FastVideo's preprocessing makes
pixel values). Which frames, and how they are resized and cropped, follow FastVideo's preprocessing (docs/design.md
section 4, "Preprocessing"); every function but the decoders is pure and tested against hand-computed indices.
"""
from __future__ import annotations

import math
import pathlib
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

VIDEO_SUFFIXES = (".mp4", ".mov", ".webm", ".mkv", ".avi", ".m4v", ".gif")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


class MediaError(ValueError):
    """A file cannot be used as a clip; the message is the reason (the caller names the file)."""


class Video(NamedTuple):
    """A decoded video: ``frames`` uint8 ``[N, H, W, 3]``, its frame rate (Hz) and duration (s)."""

    frames: np.ndarray
    fps: float
    duration: float


def is_image(path: pathlib.Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES


def is_media(path: pathlib.Path) -> bool:
    return path.suffix.lower() in VIDEO_SUFFIXES + IMAGE_SUFFIXES


def read_video(path: pathlib.Path, wanted: Sequence[int] | None = None) -> Video:
    """The frames of ``path``'s first video stream (only those in ``wanted`` when given, by decode order), its fps
    and duration; a MediaError when it does not decode."""
    import av  # the .[data] extra

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError("it has no video stream")
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            keep = None if wanted is None else set(wanted)
            last = None if wanted is None else max(wanted, default=-1)
            frames, count = [], 0
            for frame in container.decode(stream):
                if keep is None or count in keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
                count += 1
                if last is not None and count > last:
                    break
            duration = _duration(container, stream, count, fps)
    except MediaError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as error:
        raise MediaError(f"it does not decode as video: {error}") from None
    if count == 0 or fps <= 0:
        raise MediaError("it holds no decodable frames" if count == 0 else "its frame rate is unknown")
    return Video(np.stack(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8), fps, duration)


def _duration(container, stream, count: int, fps: float) -> float:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000
    return count / fps if fps else 0.0


def probe_video(path: pathlib.Path) -> tuple[float, float]:
    """(fps, duration in s) of ``path``'s first video stream from its header; a MediaError when it has none."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError("it has no video stream")
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = container.duration / 1_000_000
            else:
                duration = float(stream.frames) / fps if fps and stream.frames else 0.0
    except MediaError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as error:
        raise MediaError(f"it does not decode as video: {error}") from None
    if fps <= 0 or duration <= 0:
        raise MediaError("its frame rate or duration is unknown")
    return fps, duration


def read_image(path: pathlib.Path) -> np.ndarray:
    """An image file as uint8 ``[1, H, W, 3]`` (RGB); a MediaError when it does not decode."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))[None]
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
        raise MediaError(f"its audio track does not decode: {error}") from None
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


def usable_frames(count: int, step: int) -> int:
    """The largest ``1 + step * k <= count``: the frames a VAE of temporal compression ``step`` takes."""
    return 1 + step * ((count - 1) // step) if count >= 1 else 0


# ------------------------------------------------------------------------------------------------ resize and crop


def target_size(height: int, width: int, max_height: int, max_width: int, multiple: int) -> tuple[int, int]:
    """The clip's (height, width): ``(max_height, max_width)`` rounded down to ``multiple``."""
    h, w = (max_height // multiple) * multiple, (max_width // multiple) * multiple
    if h <= 0 or w <= 0:
        raise ValueError(f"max_height {max_height} and max_width {max_width} must be at least {multiple} "
                         "(the family's pixel multiple)")
    return h, w


def nearest_bucket(height: int, width: int, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bucket ``(h, w)`` whose aspect ratio is nearest the frame's (in log ratio; the first on ties)."""
    ratio = math.log(height / width)
    return min(buckets, key=lambda hw: abs(math.log(hw[0] / hw[1]) - ratio))


def resize_crop(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """uint8 frames ``[T, H0, W0, 3]`` -> float32 ``[3, T, height, width]`` in [-1, 1]: scaled (bilinear, antialiased)
    so the frame covers the target, then centre-cropped; pixel values rounded back to uint8 first, as FastVideo
    stores them before ``/ 127.5 - 1``."""
    t, h0, w0, _ = frames.shape
    scale = max(height / h0, width / w0)
    rh, rw = max(height, round(h0 * scale)), max(width, round(w0 * scale))
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
    if (rh, rw) != (h0, w0):
        x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False, antialias=True)
    top, left = (rh - height) // 2, (rw - width) // 2
    x = x[:, :, top:top + height, left:left + width].round().clamp(0, 255)
    return (x / 127.5 - 1.0).permute(1, 0, 2, 3).contiguous()
