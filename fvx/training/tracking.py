"""Experiment tracking: scalars, text, hyperparameters, images, videos and sound in TensorBoard event files, on rank 0.

``open_tracker(logdir, rank=rank)`` gives every rank a :class:`Tracker` with the same interface; only rank 0's one
writes anything (its ``torch.utils.tensorboard.SummaryWriter`` creates ``logdir``), the others' calls check their
arguments' types and shapes and return, so every rank runs the same logging code and a bad call fails on every rank
alike.

Videos are animated GIFs inside image summaries (TensorBoard's image dashboard plays them): ``SummaryWriter.add_video``
needs moviepy and silently logs nothing without it. Sound is a 16-bit PCM WAV in an audio summary, every channel
kept (stereo plays as stereo; ``SummaryWriter.add_audio`` would take mono only). ``read_scalars`` / ``read_images`` /
``read_texts`` / ``read_hparams`` / ``read_audio`` load a run's event files back with TensorBoard's
``EventAccumulator``, keeping every event (no sampling, no purge of steps written again after a restart).
"""
from __future__ import annotations

import io
import json
import math
import numbers
import os
import re
import struct
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import DEFAULT_SIZE_GUIDANCE, EventAccumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.plugins.hparams.metadata import SESSION_START_INFO_TAG
from tensorboard.plugins.hparams.summary_v2 import hparams_pb
from tensorboard.summary.writer.record_writer import RecordWriter, masked_crc32c
from torch.utils.tensorboard import SummaryWriter

from fvx.data import media
from fvx.training import wav

Metric = float | torch.Tensor
_CHANNELS = (1, 3, 4)  # grayscale, RGB, RGBA
_TEXT_SUFFIX = "/text_summary"  # SummaryWriter.add_text stores tag "t" as "t/text_summary"
_CONFIG_TAG = "config"


# ---------------------------------------------------------------------------------------------------------------------
# Argument checks (metadata only: no device sync, so inactive ranks run them too)


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, got {step!r}")
    return int(step)


def _check_tag(tag) -> str:
    if not isinstance(tag, str) or not tag:
        raise TypeError(f"tag must be a non-empty str, got {tag!r}")
    return tag


def _check_metrics(metrics: Mapping[str, Metric]) -> None:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a Mapping[str, float | 0-dim tensor], got {type(metrics).__name__}")
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"metric names must be non-empty str, got {name!r}")
        if isinstance(value, torch.Tensor):
            if value.dim() != 0:
                raise ValueError(f"metric {name!r} must be a 0-dim tensor, got shape {tuple(value.shape)}")
        elif not isinstance(value, numbers.Real):
            raise TypeError(f"metric {name!r} must be a real number or a 0-dim tensor, got {type(value).__name__}")


def _as_tensor(x, name: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    return x


def _check_pixels(x: torch.Tensor, name: str) -> None:
    if x.dtype != torch.uint8 and not x.is_floating_point():
        raise TypeError(f"{name} must be uint8 or floating point in [0, 1], got dtype {x.dtype}")


def _channels_first(shape: tuple[int, ...], name: str, layouts: str) -> bool:
    """Whether an image ``shape`` (last three dims) is [C,H,W]; channels-first wins when both ends could be C."""
    if shape[-3] in _CHANNELS:
        return True
    if shape[-1] in _CHANNELS:
        return False
    raise ValueError(f"{name} must be {layouts} with C in {_CHANNELS}, got shape {tuple(shape)}")


def _check_image(image) -> tuple[torch.Tensor, bool]:
    image = _as_tensor(image, "image")
    if image.dim() != 3:
        raise ValueError(f"image must be [C,H,W] or [H,W,C], got shape {tuple(image.shape)}")
    _check_pixels(image, "image")
    return image, _channels_first(tuple(image.shape), "image", "[C,H,W] or [H,W,C]")


def _check_frames(frames) -> tuple[torch.Tensor, bool]:
    frames = _as_tensor(frames, "frames")
    if frames.dim() != 4 or frames.shape[0] == 0:
        raise ValueError(f"frames must be [T,C,H,W] or [T,H,W,C] with T >= 1, got shape {tuple(frames.shape)}")
    _check_pixels(frames, "frames")
    return frames, _channels_first(tuple(frames.shape), "frames", "[T,C,H,W] or [T,H,W,C]")


def _check_waveform(waveform) -> torch.Tensor:
    waveform = _as_tensor(waveform, "waveform")
    if waveform.dim() != 2 or waveform.shape[0] == 0 or not waveform.is_floating_point():
        raise ValueError(f"waveform must be a float [C, S] in [-1, 1] with C >= 1, got shape "
                         f"{tuple(waveform.shape)} of {waveform.dtype}")
    return waveform


def _check_sample_rate(sample_rate) -> int:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Integral) or sample_rate <= 0:
        raise ValueError(f"sample_rate must be a positive int (Hz), got {sample_rate!r}")
    return int(sample_rate)


def _check_fps(fps) -> float:
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps must be a positive number, got {fps!r}")
    return float(fps)


# ---------------------------------------------------------------------------------------------------------------------
# Pure conversions


def _to_float(value: Metric) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _to_uint8_last(x: torch.Tensor, channels_first: bool) -> np.ndarray:
    """[..., C,H,W] or [..., H,W,C] uint8 / float in [0,1] (clamped, NaN -> 0) -> numpy uint8 [..., H,W,C]."""
    x = x.detach()
    if x.is_floating_point():
        x = x.float().nan_to_num(nan=0.0).clamp(0.0, 1.0).mul(255.0).round().to(torch.uint8)
    if channels_first:
        x = x.movedim(-3, -1)
    return np.ascontiguousarray(x.cpu().numpy())


def _pil(hwc: np.ndarray) -> Image.Image:
    return Image.fromarray(hwc[..., 0] if hwc.shape[-1] == 1 else hwc)


def _png_bytes(hwc: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    _pil(hwc).save(buffer, format="PNG")
    return buffer.getvalue()


def _image_summary(tag: str, encoded: bytes, hwc_shape: tuple[int, ...]) -> Summary:
    height, width, channels = hwc_shape
    image = Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=encoded)
    return Summary(value=[Summary.Value(tag=tag, image=image)])


def _audio_summary(tag: str, encoded: bytes, sample_rate: int, channels: int, length: int) -> Summary:
    audio = Summary.Audio(sample_rate=sample_rate, num_channels=channels, length_frames=length,
                          encoded_audio_string=encoded, content_type="audio/wav")
    return Summary(value=[Summary.Value(tag=tag, audio=audio)])


def _scalar_summary(values: Mapping[str, float]) -> Summary:
    return Summary(value=[Summary.Value(tag=name, simple_value=value) for name, value in values.items()])


def _flatten(config: Mapping, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> one dict with dotted keys (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``); an empty one is a leaf."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _python_scalar(value):
    """0-dim tensors and numpy scalars -> the Python scalar they hold; anything else unchanged."""
    if (isinstance(value, torch.Tensor) and value.dim() == 0) or isinstance(value, np.generic):
        return value.item()
    return value


def _hparam_value(value) -> bool | float | int | str:
    """A value the HParams plugin takes (bool, int, float, str); anything else (None, lists, tensors) as its ``str``."""
    value = _python_scalar(value)
    return value if isinstance(value, (bool, int, float, str)) else str(value)


def _config_text(flat: Mapping[str, Any]) -> str:
    """One ``dotted.key=value`` line per leaf (the fvx override syntax, values as JSON), as a markdown code block."""
    lines = [f"{key}={json.dumps(_python_scalar(value), default=str)}" for key, value in flat.items()]
    return "\n".join("    " + line for line in lines)


def _write_mp4(path: Path, thwc: np.ndarray, fps: float) -> bool:
    """H.264 MP4 through imageio-ffmpeg; False (nothing written) when it is not installed. Odd sizes are padded."""
    try:
        import imageio_ffmpeg
    except ImportError:
        return False
    height, width, channels = thwc.shape[1:]
    writer = imageio_ffmpeg.write_frames(
        str(path), (width, height), fps=fps, pix_fmt_in={1: "gray", 3: "rgb24", 4: "rgba"}[channels],
        macro_block_size=1, ffmpeg_log_level="error", output_params=["-vf", "pad=ceil(iw/2)*2:ceil(ih/2)*2"])
    writer.send(None)
    for frame in thwc:
        writer.send(frame.tobytes())
    writer.close()
    return True


# ---------------------------------------------------------------------------------------------------------------------
# Tracker


class Tracker:
    """Logs to one TensorBoard run, and the same to each of ``mirrors`` (e.g. ``fvx.training.wandb_mirror.WandbMirror``:
    ``scalars``, ``video``, ``hparams``, ``close``); with ``writer=None`` (ranks other than 0) every call only checks
    its arguments."""

    def __init__(self, writer: SummaryWriter | None, mirrors: Sequence[Any] = ()):
        self._writer = writer
        self._mirrors = tuple(mirrors) if writer is not None else ()
        self._closed = False

    @property
    def active(self) -> bool:
        """Whether this tracker writes anything (rank 0)."""
        return self._writer is not None

    @property
    def logdir(self) -> Path | None:
        return Path(self._writer.log_dir) if self._writer is not None else None

    def _open_writer(self) -> SummaryWriter | None:
        if self._closed:
            raise RuntimeError("tracker is closed")
        return self._writer

    def _emit(self, summary: Summary, step: int) -> None:
        self._writer._get_file_writer().add_summary(summary, step)

    def scalars(self, step: int, metrics: Mapping[str, Metric]) -> None:
        """Logs each metric (float or 0-dim tensor, read with ``.item()``) at ``step``, as float32; NaN and inf are
        logged as they are."""
        step = _check_step(step)
        _check_metrics(metrics)
        if self._open_writer() is None or not metrics:
            return
        values = {name: _to_float(value) for name, value in metrics.items()}
        self._emit(_scalar_summary(values), step)
        for mirror in self._mirrors:
            mirror.scalars(step, values)

    def text(self, step: int, tag: str, text: str) -> None:
        """Logs markdown ``text`` under ``tag`` (TensorBoard's text dashboard)."""
        step, tag = _check_step(step), _check_tag(tag)
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if self._open_writer() is not None:
            self._writer.add_text(tag, text, step)

    def hparams(self, config: Mapping) -> None:
        """Logs a (nested) config as hyperparameters with dotted keys (values HParams cannot take are stringified),
        and as text under ``"config"`` at step 0. For a msgspec config pass ``msgspec.to_builtins(config)``."""
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a Mapping, got {type(config).__name__}")
        flat = _flatten(config)
        if self._open_writer() is None:
            return
        self._emit(hparams_pb({key: _hparam_value(value) for key, value in flat.items()}), 0)
        self._writer.add_text(_CONFIG_TAG, _config_text(flat), 0)
        for mirror in self._mirrors:
            mirror.hparams(flat)

    def image(self, step: int, tag: str, image: torch.Tensor | np.ndarray) -> None:
        """Logs a PNG of ``image``: [C,H,W] or [H,W,C] (C in 1, 3, 4; channels-first when both ends could be C),
        uint8 or float in [0, 1] (clamped)."""
        step, tag = _check_step(step), _check_tag(tag)
        image, channels_first = _check_image(image)
        if self._open_writer() is None:
            return
        hwc = _to_uint8_last(image, channels_first)
        self._emit(_image_summary(tag, _png_bytes(hwc), hwc.shape), step)

    def video(self, step: int, tag: str, frames: torch.Tensor | np.ndarray, *, fps: float = 16,
              folder: str | Path | None = None, label: str | None = None) -> list[Path]:
        """Logs ``frames`` ([T,C,H,W] or [T,H,W,C], uint8 or float in [0, 1], clamped) as an animated GIF image summary.

        With ``folder``, also writes ``<folder>/<tag, / -> _>[_<label>]_<step>.gif``, ``.png`` (first frame) and,
        only when imageio-ffmpeg is installed, ``.mp4`` (skipped silently otherwise); ``label`` (a caption) is
        written into the name as a slug (:func:`slug`). Returns the paths written (none on inactive ranks)."""
        step, tag, fps = _check_step(step), _check_tag(tag), _check_fps(fps)
        frames, channels_first = _check_frames(frames)
        if self._open_writer() is None:
            return []
        thwc = _to_uint8_last(frames, channels_first)
        gif = media.gif_bytes(thwc, fps)
        self._emit(_image_summary(tag, gif, thwc.shape[1:]), step)
        for mirror in self._mirrors:
            mirror.video(step, tag, thwc, fps)
        if folder is None:
            return []
        stem = media_stem(folder, tag, label, step)
        stem.parent.mkdir(parents=True, exist_ok=True)
        paths = [stem.with_suffix(".gif"), stem.with_suffix(".png")]
        paths[0].write_bytes(gif)
        paths[1].write_bytes(_png_bytes(thwc[0]))
        if _write_mp4(stem.with_suffix(".mp4"), thwc, fps):
            paths.append(stem.with_suffix(".mp4"))
        return paths

    def audio(self, step: int, tag: str, waveform: torch.Tensor | np.ndarray, sample_rate: int, *,
              folder: str | Path | None = None, label: str | None = None) -> list[Path]:
        """Logs ``waveform`` ([C, S] float in [-1, 1]; clipped, NaN as 0) at ``sample_rate`` Hz as a 16-bit PCM WAV
        audio summary with all C channels (TensorBoard plays it; ``SummaryWriter.add_audio`` would need the mono
        channel mean).

        With ``folder``, also writes ``<folder>/<tag, / -> _>[_<label>]_<step>.wav`` (named as :meth:`video`'s files,
        so a sample's sound sits beside its GIF; durably, ``fvx.training.wav.write_wav``). Returns the paths written
        (none on inactive ranks). The W&B mirrors get no sound."""
        step, tag = _check_step(step), _check_tag(tag)
        waveform, sample_rate = _check_waveform(waveform), _check_sample_rate(sample_rate)
        if self._open_writer() is None:
            return []
        samples = waveform.detach().float().nan_to_num(nan=0.0).clamp(-1.0, 1.0).cpu()
        encoded = wav.wav_bytes(samples, sample_rate)
        self._emit(_audio_summary(tag, encoded, sample_rate, samples.shape[0], samples.shape[1]), step)
        if folder is None:
            return []
        return [wav.write_wav(media_stem(folder, tag, label, step).with_suffix(".wav"), samples, sample_rate)]

    def flush(self) -> None:
        """Writes pending events to disk."""
        if self._open_writer() is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file; closing again does nothing, any other call afterwards raises."""
        if not self._closed and self._writer is not None:
            self._writer.close()
            for mirror in self._mirrors:
                mirror.close()
        self._closed = True

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def media_stem(folder: str | Path, tag: str, label: str | None, step: int) -> Path:
    """``<folder>/<tag, / -> _>[_<slug(label)>]_<step>``: the name, less its suffix, of a logged video's or sound's
    files."""
    return Path(folder) / "_".join([tag.replace("/", "_"), *([slug(label)] if label and slug(label) else []),
                                    str(step)])


def slug(text: str, limit: int = 48) -> str:
    """``text`` as a file-name part a person reads: lower case, runs of anything but letters and digits one ``-``, at
    most ``limit`` characters (cut at a word)."""
    words = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return words if len(words) <= limit else words[:limit].rsplit("-", 1)[0]


def open_tracker(logdir: str | Path, *, rank: int = 0, mirrors: Callable[[], Sequence[Any]] = tuple) -> Tracker:
    """A tracker writing to ``logdir`` on rank 0 (created there), with the trackers ``mirrors()`` opens there; one
    that writes nothing on other ranks."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    if rank != 0:
        return Tracker(None)
    return Tracker(SummaryWriter(str(logdir)), mirrors())


# ---------------------------------------------------------------------------------------------------------------------
# Reading runs back


def _accumulator(logdir: str | Path) -> EventAccumulator:
    if not Path(logdir).is_dir():
        raise FileNotFoundError(f"no TensorBoard run at {str(logdir)!r}")
    keep_all = dict.fromkeys(DEFAULT_SIZE_GUIDANCE, 0)
    return EventAccumulator(str(logdir), size_guidance=keep_all, purge_orphaned_data=False).Reload()


def _plugin_content(accumulator: EventAccumulator, plugin: str) -> Mapping[str, bytes]:
    try:
        return accumulator.PluginTagToContent(plugin)
    except KeyError:  # no summary of this plugin in the run
        return {}


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar event in ``logdir`` (not its subfolders): tag -> [(step, value)] in write order."""
    accumulator = _accumulator(logdir)
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def read_images(logdir: str | Path) -> dict[str, list[tuple[int, bytes]]]:
    """Every image summary in ``logdir`` (videos included): tag -> [(step, encoded PNG or GIF bytes)]."""
    accumulator = _accumulator(logdir)
    return {tag: [(e.step, e.encoded_image_string) for e in accumulator.Images(tag)]
            for tag in accumulator.Tags()["images"]}


def read_texts(logdir: str | Path) -> dict[str, list[tuple[int, str]]]:
    """Every text summary in ``logdir``: tag (as given to ``Tracker.text``) -> [(step, text)]."""
    accumulator = _accumulator(logdir)
    return {tag.removesuffix(_TEXT_SUFFIX): [(e.step, e.tensor_proto.string_val[0].decode()) for e in
                                            accumulator.Tensors(tag)] for tag in _plugin_content(accumulator, "text")}


def read_audio(logdir: str | Path, tag: str) -> list[tuple[int, int, int]]:
    """Every audio summary of ``tag`` in ``logdir``: [(step, sample_rate, length in samples per channel)] in write
    order ([] when there is none)."""
    accumulator = _accumulator(logdir)
    if tag not in accumulator.Tags()["audio"]:
        return []
    return [(e.step, int(e.sample_rate), int(e.length_frames)) for e in accumulator.Audio(tag)]


def read_hparams(logdir: str | Path) -> dict[str, bool | float | str]:
    """The hyperparameters last logged in ``logdir`` (dotted keys; numbers come back as float), {} when none."""
    content = _plugin_content(_accumulator(logdir), "hparams").get(SESSION_START_INFO_TAG)
    if content is None:
        return {}
    values = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    return {key: getattr(value, value.WhichOneof("kind")) for key, value in values.items()}


# ---------------------------------------------------------------------------------------------------------- resume


STEP_RECORD = "step_time_s"
"""The tag that marks the loop's record of a step's metrics (one event holding them all): what a resumed run logs
again for its first step, where what the hooks logged at that step (validation of the state it resumes from) stays."""


def truncate_events(logdir: Path, from_step: int, report: Callable[[str], None] = lambda line: None) -> int:
    """Drop from every TensorBoard event file in ``logdir`` (each file rewritten beside itself, then renamed over it)
    the summaries a run resumed at step ``from_step`` logs again: every summary of a later step, and at
    ``from_step`` the loop's step record (:data:`STEP_RECORD`); what the hooks logged at ``from_step`` (a
    validation of the state the run resumes from) is kept. Returns how many events were dropped. A damaged record
    (its length or bytes fail their CRC, or a torn tail) is dropped too and reported (``report``, one line naming the
    file and byte offset); the intact records before and after it are kept, so no history hides behind it."""
    dropped = 0
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        records, damaged = read_records(path)
        for offset in damaged:
            report(f"note: {path} has a damaged TensorBoard record at byte {offset}; it is dropped and the records "
                   "around it are kept")
        kept = [r for r in records if _before(r, from_step)]
        if len(kept) == len(records) and not damaged:
            continue
        partial = path.with_name(f".{os.getpid()}.truncating")
        with open(partial, "wb") as f:
            writer = RecordWriter(f)
            for record in kept:
                writer.write(record)
        os.replace(partial, path)
        dropped += len(records) - len(kept)
    return dropped


def read_records(path: Path) -> tuple[list[bytes], list[int]]:
    """The intact records of a TFRecord event file, and the byte offsets where damaged spans begin (reading resumes at
    the next intact record, found by scanning)."""
    data = path.read_bytes()
    records, damaged, pos = [], [], 0
    while pos < len(data):
        record = _record_at(data, pos)
        if record is None:
            damaged.append(pos)
            pos += 1
            while pos < len(data) and _record_at(data, pos) is None:
                pos += 1
            continue
        records.append(record[0])
        pos = record[1]
    return records, damaged


def _record_at(data: bytes, pos: int) -> tuple[bytes, int] | None:
    """(the record's bytes, the offset after it) of an intact TFRecord at ``pos``: uint64 length, masked CRC-32C of
    the length, the bytes, their masked CRC-32C; None if anything fails."""
    if pos + 12 > len(data):
        return None
    header = data[pos:pos + 8]
    if struct.unpack("<I", data[pos + 8:pos + 12])[0] != masked_crc32c(header):
        return None
    end = pos + 12 + struct.unpack("<Q", header)[0]
    if end + 4 > len(data):
        return None
    body = data[pos + 12:end]
    if struct.unpack("<I", data[end:end + 4])[0] != masked_crc32c(body):
        return None
    return body, end + 4


def wait_for_a_new_second(logdir: Path) -> None:
    """Wait (at most a second) until the clock has passed the creation second of every event file in ``logdir``.

    TensorBoard reads event files in name order, and a name starts with the second its writer opened; a file opened in
    the same second as an existing one (a run resumed at once) would be ordered by host and pid instead."""
    stamps = [int(part) for path in logdir.glob("events.out.tfevents.*")
              if (part := path.name.split(".")[3]).isdigit()]
    deadline = time.monotonic() + 1.1
    while stamps and time.time() < max(stamps) + 1 and time.monotonic() < deadline:
        time.sleep(0.02)


def _before(record: bytes, step: int) -> bool:
    """Whether a resumed run at ``step`` keeps ``record`` (:func:`truncate_events`)."""
    event = event_pb2.Event.FromString(record)
    if not event.HasField("summary") or event.step < step:
        return True
    return event.step == step and not any(value.tag == STEP_RECORD for value in event.summary.value)
