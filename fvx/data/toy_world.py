"""A synthetic video world that a tiny model learns on a CPU in minutes, with a codec that decodes its latents exactly.

Prompt ``p`` of ``colours x directions`` is "<colour> bars moving <direction>": bars of that colour on black, ``width``
pixels wide and apart, across the direction of motion, drift ``speed`` pixels per frame over ``frames`` frames of ``size
x size`` pixels (``shape="square"``: one ``width``-pixel square instead); sample ``i`` has prompt ``i mod P`` and a
phase (a start position) drawn from ``fold_in(key, i)`` on a ``grid``-pixel grid. A prompt's text embedding is a fixed
random ``[text_len, text_dim]`` matrix (``fold_in(key(seed), p)``), so the prompts of a run's data and of its validation
agree; with ``text="words"`` it is its caption's words as token ids ``[words, 1]`` (their places in :data:`WORDS`), for
a DiT that embeds its prompt's tokens itself. Videos are ``[3, T, H, W]`` in ``[-1, 1]``; latents are their
space-to-depth rearrangement ``[3 f^2, T, H / f, W / f]`` (:class:`SpaceToDepth`, ``f = factor``): the codec is exact,
so a decoded sample shows exactly what the model made. Because every true video of a prompt is known,
:meth:`WorldDataset.sample_quality` scores decoded samples: the pixel MSE to the nearest true video of the prompt (0 for
a perfect sample; pure noise scores about 0.39), and the fraction of samples that close to one that they are the
prompted clip (sharp, moving the right way), and the fraction whose nearest true video, among all prompts', is of the
prompt asked for.

Kind "t2va" data (and "i2va", beside the first frame) adds sound (:mod:`fvx.data.toy_audio`): each prompt's own pure
stereo tone lasting the clip (``frames / fps`` s at ``audio_rate`` Hz), as latents ``[2, 32, A]`` (A = ``audio_rate *
frames / fps / 32``; 32 for the default 4 frames at 16 fps and 4096 Hz) that ``toy_audio.AudioFrames`` decodes
exactly, scored by :meth:`WorldDataset.audio_quality`. Kind "matrixgame2" data is the world with actions
(:mod:`fvx.data.toy_world_actions`: squares that move as per-frame keys say).
"""
from __future__ import annotations

import sys
from typing import Annotated, Any, Callable, Literal, Sequence

import msgspec
import numpy as np
import torch

from fvx.config import Config
from fvx.core import random
from fvx.data import parquet, toy_audio

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]

COLOURS = {"red": (1.0, -1.0, -1.0), "green": (-1.0, 1.0, -1.0), "blue": (-1.0, -1.0, 1.0), "white": (1.0, 1.0, 1.0)}
DIRECTIONS = {"right": (0, 1), "left": (0, -1), "down": (1, 0), "up": (-1, 0)}  # (rows, columns) per frame
# the data kinds whose samples continue a given first frame, their own clips the truth (continuation_mse); animate's
# follow a pose video from a reference frame
GIVEN_FIRST_FRAME = ("i2v", "i2va", "vace", "animate")
WORDS = ("a", "bars", "square", "moving", *COLOURS, *DIRECTIONS)  # the captions' words, token ids by place
HIT = 0.03  # a sample this close (pixel MSE) to a true clip of its prompt counts as a hit: blur and wrong motion miss


class WorldConfig(Config):
    """The world's size (see the module docstring); ``colours`` and ``directions`` name the prompts. A square needs
    the model to agree, over all its tokens, on one place for it, which the tiny presets do not learn in a CPU
    run's few hundred steps (docs/design.md); bars, whose phase each token can read off its neighbours, they do.
    ``fps`` (the clip's frame rate), ``audio_rate`` (Hz) and ``audio_pitch`` (the first prompt's tone, Hz) shape the
    sound of kind "t2va" and "i2va" data (:mod:`fvx.data.toy_audio`). ``score_window``: kind "matrixgame2" samples are
    also scored per window of this many frames (a long streamed clip; None: the whole clip only). ``text``: a prompt's
    text is a random embedding ``[text_len, text_dim]`` or its caption's word ids (module docstring)."""

    num_samples: PositiveInt = 512
    frames: PositiveInt = 4
    size: PositiveInt = 16
    width: PositiveInt = 4
    speed: Annotated[int, msgspec.Meta(ge=0)] = 2
    factor: PositiveInt = 8
    grid: PositiveInt = 2
    shape: Literal["bars", "square"] = "bars"
    colours: tuple[str, ...] = ("red", "blue")
    directions: tuple[str, ...] = ("right", "left", "down", "up")
    text_len: PositiveInt = 4
    text_dim: PositiveInt = 32
    text: Literal["embedding", "words"] = "embedding"
    seed: int = 0
    fps: PositiveInt = 16
    audio_rate: PositiveInt = 4096
    audio_pitch: Annotated[float, msgspec.Meta(gt=0.0)] = 440.0
    score_window: PositiveInt | None = None

    def __post_init__(self) -> None:
        for name in self.colours:
            if name not in COLOURS:
                raise ValueError(f"data.world.colours: unknown colour {name!r}; known: {', '.join(COLOURS)}")
        for name in self.directions:
            if name not in DIRECTIONS:
                raise ValueError(f"data.world.directions: unknown direction {name!r}; known: {', '.join(DIRECTIONS)}")
        if not self.colours or not self.directions:
            raise ValueError("data.world needs at least one colour and one direction")
        if self.size % self.factor:
            raise ValueError(f"data.world.size {self.size} must be a multiple of data.world.factor {self.factor}")
        if self.shape == "square" and self.width + self.speed * (self.frames - 1) > self.size:
            raise ValueError(f"data.world: a square of {self.width} px moving {self.speed} px per frame for "
                             f"{self.frames} frames leaves a {self.size} px frame; make it smaller or slower")
        self._check_audio()

    def _check_audio(self) -> None:
        """The sound fits: a whole number of audio latents per clip, and distinct tones below the Nyquist rate."""
        if min(self.frames, self.fps, self.audio_rate) <= 0 or not self.audio_pitch > 0:
            return  # not positive: validation names the field
        if (self.audio_rate * self.frames) % (self.fps * toy_audio.SAMPLES_PER_LATENT):
            samples = self.audio_rate * self.frames / self.fps
            raise ValueError(f"data.world.audio_rate {self.audio_rate} Hz gives {samples:g} samples for {self.frames} "
                             f"frames at data.world.fps {self.fps}, not a whole number of "
                             f"{toy_audio.SAMPLES_PER_LATENT}-sample audio latents; e.g. 4096 Hz at 16 fps")
        tones = self.pitches
        if min(tones) <= 0 or max(tones) >= self.audio_rate / 2:
            raise ValueError(f"data.world.audio_pitch {self.audio_pitch:g} Hz: the prompts' tones "
                             f"({min(tones):g}..{max(tones):g} Hz) must lie above 0 and below half "
                             f"data.world.audio_rate ({self.audio_rate / 2:g} Hz)")
        if len(set(tones)) != len(tones):
            raise ValueError(f"data.world.audio_pitch {self.audio_pitch:g} Hz is too low for {len(tones)} prompts in "
                             f"a {self.frames / self.fps:g} s clip: their tones, whole cycles per clip, coincide; "
                             "raise it")

    @property
    def prompts(self) -> list[tuple[str, str]]:
        return [(c, d) for c in self.colours for d in self.directions]

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        side = self.size // self.factor
        return 3 * self.factor ** 2, self.frames, side, side

    @property
    def audio_samples(self) -> int:
        """Samples per channel of a clip's sound: ``audio_rate * frames / fps``."""
        return self.audio_rate * self.frames // self.fps

    @property
    def audio_latent_shape(self) -> tuple[int, int, int]:
        """``(2, 32, A)``: a clip's audio latents (kind "t2va")."""
        return 2, toy_audio.SAMPLES_PER_LATENT, self.audio_samples // toy_audio.SAMPLES_PER_LATENT

    @property
    def pitches(self) -> list[float]:
        """Each prompt's tone, Hz (:func:`fvx.data.toy_audio.pitches`)."""
        return toy_audio.pitches(self.audio_pitch, len(self.prompts), self.frames / self.fps)


def caption(config: WorldConfig, colour: str, direction: str) -> str:
    return f"a {colour} square moving {direction}" if config.shape == "square" else f"{colour} bars moving {direction}"


def prompt_texts(config: WorldConfig) -> list[np.ndarray]:
    """Each prompt's text (module docstring): its fixed random embedding ``[text_len, text_dim]``, or with
    ``text="words"`` its caption's token ids ``[words, 1]`` (float32)."""
    if config.text == "words":
        return [np.array([[WORDS.index(word)] for word in caption(config, c, d).split()], dtype=np.float32)
                for c, d in config.prompts]
    text_key = random.key(config.seed)
    return [random.normal(random.fold_in(text_key, p), (config.text_len, config.text_dim)).numpy()
            for p in range(len(config.prompts))]


def starts(config: WorldConfig, direction: str) -> list[tuple[int, int]]:
    """Every start on the grid: for bars each phase (an offset across them), for a square each (row, column) of its
    top-left corner that keeps it in frame for the whole clip."""
    dr, dc = DIRECTIONS[direction]
    if config.shape == "bars":
        phases = range(0, 2 * config.width, config.grid)
        return [(p, 0) for p in phases] if dr else [(0, p) for p in phases]
    travel = config.speed * (config.frames - 1)
    span = config.size - config.width

    def axis(step: int) -> range:
        return range(-step * travel if step < 0 else 0, span - max(step, 0) * travel + 1, config.grid)

    return [(r, c) for r in axis(dr) for c in axis(dc)]


def render(config: WorldConfig, colour: str, direction: str, start: tuple[int, int]) -> np.ndarray:
    """The clip ``[3, T, size, size]`` float32 in [-1, 1]: black, with the bars (or the square) from ``start``
    moving."""
    video = -np.ones((3, config.frames, config.size, config.size), dtype=np.float32)
    dr, dc = DIRECTIONS[direction]
    colour_value = np.asarray(COLOURS[colour], dtype=np.float32)[:, None]
    if config.shape == "bars":  # across the motion, ``width`` px wide and apart, drifting
        period, axis = 2 * config.width, np.arange(config.size)
        for t in range(config.frames):
            offset = (start[0] + dr * config.speed * t) if dr else (start[1] + dc * config.speed * t)
            on = ((axis - offset) % period) < config.width
            if dr:
                video[:, t, on, :] = colour_value[..., None]
            else:
                video[:, t, :, on] = colour_value
        return video
    for t in range(config.frames):
        r, c = start[0] + dr * config.speed * t, start[1] + dc * config.speed * t
        video[:, t, r:r + config.width, c:c + config.width] = colour_value[..., None]
    return video


def tokens_of_first_frame(latents: np.ndarray) -> np.ndarray:
    """The first frame of latents ``[C, T, h, w]`` as tokens ``[h w, C]`` (row-major): the toy image embedding."""
    first = latents[:, 0]
    return np.ascontiguousarray(first.reshape(first.shape[0], -1).T)


def first_frame_only(video: np.ndarray) -> np.ndarray:
    """A clip or its latents ``[C, T, H, W]`` with every frame but the first zero (mid-grey pixels; zero latents of a
    frame-wise codec): what an image-to-video model is given, as FastVideo encodes it."""
    out = np.zeros_like(video)
    out[:, :1] = video[:, :1]
    return out


def extension_context(latents: np.ndarray, mask_channels: int) -> np.ndarray:
    """Kind "vace"'s context ``[2 C + M, T, h, w]`` of a clip's latents ``[C, T, h, w]``: VACE's extension task
    (``fvx_models.wan_vace``'s layout). The control video is the clip's first frame then mid-grey frames, its mask
    zero on the first frame (kept) and one after (to be made), so the exact, frame-wise codec gives the first frame's
    latents then zeros outside the mask, zeros inside it, then the mask, ``f x f`` pixels to a cell (``M = f^2``)."""
    mask = np.ones((mask_channels, *latents.shape[1:]), dtype=latents.dtype)
    mask[:, 0] = 0
    return np.concatenate([first_frame_only(latents), np.zeros_like(latents), mask])


def space_to_depth(video: np.ndarray | torch.Tensor, factor: int) -> Any:
    """``[..., 3, T, H, W] -> [..., 3 f^2, T, H / f, W / f]``: channel ``(c, i, j)`` holds pixel ``(f y + i, f x + j)``
    of colour ``c``."""
    *lead, ch, t, h, w = video.shape
    x = video.reshape(*lead, ch, t, h // factor, factor, w // factor, factor)
    n = len(lead)
    order = (*range(n), n, n + 3, n + 5, n + 1, n + 2, n + 4)
    x = x.transpose(order) if isinstance(x, np.ndarray) else x.permute(order)
    return x.reshape(*lead, ch * factor * factor, t, h // factor, w // factor)


def depth_to_space(latents: torch.Tensor, factor: int) -> torch.Tensor:
    """The inverse of :func:`space_to_depth`: ``[B, 3 f^2, T, h, w] -> [B, 3, T, f h, f w]``."""
    b, ch, t, h, w = latents.shape
    x = latents.reshape(b, ch // factor ** 2, factor, factor, t, h, w).permute(0, 1, 4, 5, 2, 6, 3)
    return x.reshape(b, ch // factor ** 2, t, h * factor, w * factor)


class SpaceToDepth(Config, tag="space_to_depth"):
    """The world's codec as a validation decoder (an experiment's ``vae``): ``build(key).decode(latents)``."""

    factor: PositiveInt = 8

    def build(self, key: torch.Tensor | None = None) -> "Codec":
        return Codec(self.factor)


class Codec:
    """Exact space-to-depth: ``decode`` maps latents ``[B, 3 f^2, T, h, w]`` to videos ``[B, 3, T, f h, f w]`` in
    [0, 1] (as a VAE decoder: ``(x / 2 + 0.5).clamp(0, 1)``) and ``encode`` maps such videos back (``2 v - 1``), the
    contract of ``fvx_models.wan_vae``'s encode and decode."""

    def __init__(self, factor: int):
        self.factor = factor

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        return space_to_depth(2 * video.float() - 1, self.factor)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return (depth_to_space(latents.float(), self.factor) / 2 + 0.5).clamp(0, 1)


class WorldDataset:
    """The world as a dataset (``fvx.data.datasets``'s protocol: ``len``, ``read(indices)``, ``where(index)``), plus
    :meth:`sample_quality` and :meth:`audio_quality`."""

    def __init__(self, config: WorldConfig, key: torch.Tensor, *, kind: str, collate: Callable[..., dict]):
        self.config, self.key, self.kind, self._collate = config, key, kind, collate
        self.prompts = config.prompts
        self.texts = prompt_texts(config)
        self.starts = {d: starts(config, d) for d in config.directions}
        self._references: torch.Tensor | None = None
        self._tones: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.config.num_samples

    def sample(self, index: int) -> dict[str, Any]:
        prompt = index % len(self.prompts)
        colour, direction = self.prompts[prompt]
        sample = {"text": self.texts[prompt], "caption": caption(self.config, colour, direction),
                  "where": self.where(index)}
        if self.kind != "text_only":
            sample["latents"] = space_to_depth(self.clip(index), self.config.factor)
        if self.kind in ("i2v", "i2va"):  # the codec is frame-wise: the first frame's latents, then zero frames
            sample["first_frame_latents"] = first_frame_only(sample["latents"])
        if self.kind == "vace":  # the first frame given as VACE's control context
            sample["vace_context"] = extension_context(sample["latents"], self.config.factor ** 2)
        if self.kind in parquet.AUDIO_KINDS:  # the prompt's tone, exactly encoded
            sample["audio_latents"] = toy_audio.frame(self.tones()[prompt].numpy() * toy_audio.SCALE)
            sample["audio_sample_rate"] = self.config.audio_rate
        return sample

    def clip(self, index: int) -> np.ndarray:
        """Sample ``index``'s clip ``[3, T, size, size]`` in [-1, 1]: its prompt's shapes from a start drawn from
        ``fold_in(key, index)``."""
        colour, direction = self.prompts[index % len(self.prompts)]
        options = self.starts[direction]
        start = options[int(random.randint(random.fold_in(self.key, index), (), 0, len(options)))]
        return render(self.config, colour, direction, start)

    def read(self, indices: Sequence[int]) -> dict[str, Any]:
        indices = [int(i) for i in indices]
        for i in indices:
            if not 0 <= i < len(self):
                raise IndexError(f"world sample {i} out of range [0, {len(self)})")
        return self._collate([self.sample(i) for i in indices], indices)

    def where(self, index: int) -> str:
        return f"world sample {index}"

    def references(self) -> torch.Tensor:
        """Every true clip, ``[P, S, 3, T, H, W]`` in [0, 1] (:func:`references`)."""
        if self._references is None:
            self._references = references(self.config)
        return self._references

    def sample_quality(self, videos: torch.Tensor, indices: Sequence[int]) -> dict[str, float]:
        """For decoded samples ``[N, 3, T, H, W]`` in [0, 1] of the prompts of dataset samples ``indices``:
        ``nearest_mse`` (mean over samples of the pixel MSE to the nearest true clip of its prompt), ``hit_rate`` (the
        fraction of samples within :data:`HIT` of one: the prompted bars, sharp, moving the right way) and
        ``prompt_match`` (the fraction whose nearest true clip of any prompt is of its prompt). A clip ``k`` times the
        world's length (a long streamed sample; bars only, whose every window is a true clip) is scored per window of
        the world's frames, ``window_i/<figure>``, and the figures are their means, so a person sees whether quality
        holds along the clip. Data that gives the first frame (kinds "i2v", "i2va", "vace") adds
        :meth:`continuation_mse`."""
        return self.prompt_quality(videos, [int(i) % len(self.prompts) for i in indices], indices)

    def caption_quality(self, videos: torch.Tensor, captions: Sequence[str]) -> dict[str, float]:
        """:meth:`prompt_quality` of videos made from ``captions``, the world's prompts' captions (a ValueError names
        one that is none of them)."""
        return self.prompt_quality(videos, self.prompt_ids(captions))

    def caption_audio_quality(self, waveforms: torch.Tensor, captions: Sequence[str]) -> dict[str, float]:
        """:meth:`audio_quality` of sounds ``[N, 2, S]`` made from ``captions`` (as :meth:`caption_quality`)."""
        return self.audio_quality(waveforms, self.prompt_ids(captions))

    def prompt_ids(self, captions: Sequence[str]) -> list[int]:
        """The world's prompt number of each caption; a ValueError names one that is none of its prompts'."""
        ids = {caption(self.config, c, d): p for p, (c, d) in enumerate(self.prompts)}
        unknown = [c for c in captions if c not in ids]
        if unknown:
            raise ValueError(f"{unknown[0]!r} is none of the toy world's prompts ({', '.join(map(repr, ids))}), so "
                             "the world cannot score it")
        return [ids[c] for c in captions]

    def prompt_quality(self, videos: torch.Tensor, prompt_ids: Sequence[int],
                       indices: Sequence[int] | None = None) -> dict[str, float]:
        """:meth:`sample_quality` of samples of the world's prompts ``prompt_ids`` (``indices``: their world samples,
        for image-to-video's continuation score)."""
        refs = self.references()  # [P, S, 3, T, H, W]
        frames, shape = refs.shape[3], tuple(videos.shape[1:])
        long_clip = self.config.shape == "bars" and shape[1] > frames and shape[1] % frames == 0
        if shape[:1] + shape[2:] != tuple(refs.shape[2:3] + refs.shape[4:]) or not (shape[1] == frames or long_clip):
            raise ValueError(f"sample_quality: videos of shape {shape} are not the world's clips "
                             f"{tuple(refs.shape[2:])} (or, for bars, a whole number of them in time)")
        prompts = torch.tensor(list(prompt_ids))
        windows = [_quality(videos[:, :, w:w + frames], prompts, refs) for w in range(0, shape[1], frames)]
        if self.kind in GIVEN_FIRST_FRAME and len(windows) == 1 and indices is not None:
            return {**windows[0], "continuation_mse": self.continuation_mse(videos, indices)}
        if len(windows) == 1:
            return windows[0]
        means = {name: sum(w[name] for w in windows) / len(windows) for name in windows[0]}
        return {**means, **{f"window_{i}/{name}": value for i, w in enumerate(windows) for name, value in w.items()}}

    def tones(self) -> torch.Tensor:
        """Every prompt's true sound, ``[P, 2, S]`` float32 in [-1, 1] (:func:`tones`)."""
        if self._tones is None:
            self._tones = tones(self.config)
        return self._tones

    def audio_quality(self, waveforms: torch.Tensor, indices: Sequence[int]) -> dict[str, float]:
        """For decoded sounds ``[N, 2, S]`` in [-1, 1] of the prompts of dataset samples ``indices`` (prompt ``i mod
        P``, so a prompt number works too): ``audio_mse`` (mean over samples of the MSE to the prompt's true tone; 0
        when perfect, about 0.43 for uniform noise, 0.10 for silence) and ``pitch_match`` (the fraction whose
        dominant FFT frequency is the prompt's pitch)."""
        refs = self.tones()
        if tuple(waveforms.shape[1:]) != tuple(refs.shape[1:]) or len(waveforms) != len(indices):
            raise ValueError(f"audio_quality: waveforms of shape {tuple(waveforms.shape)} are not {len(indices)} of "
                             f"the world's sounds {tuple(refs.shape[1:])}")
        prompts = torch.tensor([int(i) % len(self.prompts) for i in indices], dtype=torch.int64)
        duration = self.config.frames / self.config.fps
        bins = torch.tensor([round(p * duration) for p in self.config.pitches], dtype=torch.int64)
        return toy_audio.audio_quality(waveforms.detach().cpu(), prompts, refs, bins)

    def continuation_mse(self, videos: torch.Tensor, indices: Sequence[int]) -> float:
        """For image-to-video samples ``[N, 3, T, H, W]`` in [0, 1] conditioned on the first frames of dataset samples
        ``indices``: the mean pixel MSE to those samples' own clips, the motion continued from the given frame."""
        own = torch.from_numpy(np.stack([self.clip(int(i)) for i in indices])) / 2 + 0.5
        return float(((videos.float() - own) ** 2).mean())


def references(config: WorldConfig) -> torch.Tensor:
    """Every true clip of the world, ``[P, S, 3, T, H, W]`` in [0, 1] (``S``: the most starts of any direction,
    padded by repeating the first)."""
    all_starts = {d: starts(config, d) for d in config.directions}
    most = max(len(s) for s in all_starts.values())
    clips = []
    for colour, direction in config.prompts:
        options = all_starts[direction] + [all_starts[direction][0]] * (most - len(all_starts[direction]))
        clips.append(np.stack([render(config, colour, direction, s) for s in options]))
    return torch.from_numpy(np.stack(clips)) / 2 + 0.5


def tones(config: WorldConfig) -> torch.Tensor:
    """Every prompt's true sound, ``[P, 2, S]`` float32 in [-1, 1]: its pitch, panned by its direction."""
    return torch.from_numpy(np.stack([
        toy_audio.tone(pitch, toy_audio.pan(direction), config.audio_samples, config.audio_rate)
        for pitch, (_, direction) in zip(config.pitches, config.prompts)]))


def clip_mse(videos: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
    """``[N, P, S]``: the pixel MSE of each clip ``[N, 3, T, H, W]`` to each true clip ``refs [P, S, 3, T, H, W]``."""
    flat, table = videos.float().flatten(1), refs.flatten(2)  # [N, D], [P, S, D]
    return ((flat ** 2).sum(-1)[:, None, None] + (table ** 2).sum(-1)[None]
            - 2 * torch.einsum("nd,psd->nps", flat, table)) / flat.shape[1]


def _quality(videos: torch.Tensor, prompts: torch.Tensor, refs: torch.Tensor) -> dict[str, float]:
    """:meth:`WorldDataset.sample_quality`'s figures of clips ``[N, 3, T, H, W]`` of ``prompts [N]`` against the true
    clips ``refs [P, S, 3, T, H, W]``."""
    mse = clip_mse(videos, refs)
    own = mse[torch.arange(len(prompts)), prompts].min(-1).values
    nearest_prompt = mse.min(-1).values.argmin(-1)
    return {"nearest_mse": float(own.mean()), "hit_rate": float((own < HIT).float().mean()),
            "prompt_match": float((nearest_prompt == prompts).float().mean())}


# ------------------------------------------------------------------------------------------- the command line


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fvx.data.toy_world", description=(
        "The toy video world as files: write-videos DIR writes its clips as mp4 files with caption files, the input "
        "`python -m fvx.run preprocess` reads"))
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write-videos", help="write the world's clips and captions into DIR")
    write.add_argument("dir", help="the folder to write (created)")
    write.add_argument("--samples", type=int, default=WorldConfig().num_samples,
                       help="how many clips (default: %(default)s)")
    write.add_argument("--frames", type=int, default=WorldConfig().frames,
                       help="frames a clip (default: %(default)s)")
    write.add_argument("--seed", type=int, default=0, help="draws the clips' phases (default: %(default)s)")
    write.add_argument("--kind", choices=("t2v", "matrixgame2", "vace", "animate"), default="t2v", help=(
        "matrixgame2: the world with actions, each clip with its keys as a FastVideo action file <stem>.npz; vace: "
        "each clip with the control video <stem>.control.mp4 and mask <stem>.mask.mp4 of VACE's extension task; "
        "animate: each clip with its pose video <stem>.pose.mp4 and face video <stem>.face.mp4 (default: "
        "%(default)s)"))
    args = parser.parse_args(argv)
    for name in ("samples", "frames"):
        if getattr(args, name) <= 0:
            print(f"error: --{name} must be positive, got {getattr(args, name)}", file=sys.stderr)
            return 2
    from fvx.data.toy_world_files import write_videos

    names = write_videos(WorldConfig(num_samples=args.samples, frames=args.frames), args.dir, seed=args.seed,
                         kind=args.kind)
    extra = {"matrixgame2": " and action files", "vace": " and control videos and masks",
             "animate": " and pose and face videos"}.get(args.kind, "")
    print(f"wrote {len(names)} clips ({names[0]} ... {names[-1]}) with their captions{extra} to {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
