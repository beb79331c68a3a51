"""The toy world's sound: one pure stereo tone per prompt, and an exact audio codec, so a joint video+audio model's
decoded sound can be scored against the one true waveform of its prompt.

Prompt ``p`` of ``P`` sounds ``base * 2 ** (p / P)`` Hz (one octave spread over the prompts), rounded to a whole
number of cycles per clip, so every tone loops seamlessly and its FFT peak is exactly one bin; phase 0, so each prompt
has exactly one true waveform. Its direction pans it: "left" louder in the left channel, "right" in the right, others
centred. Waveforms are ``[2, S]`` in [-1, 1]; latents are their framing ``[2, 32, S / 32]`` (:func:`frame`: latent
column ``a`` holds samples ``32 a .. 32 a + 31``) times :data:`SCALE`, like the video's space-to-depth: the codec
is exact.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Sequence

import msgspec
import numpy as np
import torch

from fvx.config import Config

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]

SAMPLES_PER_LATENT = 32  # one latent column: the features of t2va audio latents [2, 32, A]
SCALE = 2.0  # latents = SCALE * waveform: the tones (amplitude AMPLITUDE) fill [-1, 1] as the world's video latents do
AMPLITUDE = 0.5  # of the louder channel
PANS = {"left": (1.0, 0.5), "right": (0.5, 1.0)}  # (left, right) gains by direction; other directions: (1, 1)


def frame(waveform: torch.Tensor | np.ndarray) -> Any:
    """``[..., C, A * 32] -> [..., C, 32, A]``: latent ``(k, a)`` of a channel is its sample ``32 a + k``."""
    *lead, channels, samples = waveform.shape
    if samples % SAMPLES_PER_LATENT:
        raise ValueError(f"frame: waveform of {samples} samples is not a whole number of {SAMPLES_PER_LATENT}-sample "
                         "latent columns")
    x = waveform.reshape(*lead, channels, samples // SAMPLES_PER_LATENT, SAMPLES_PER_LATENT)
    return x.swapaxes(-1, -2) if isinstance(x, np.ndarray) else x.transpose(-1, -2)


def unframe(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`frame`: ``[..., C, 32, A] -> [..., C, A * 32]``."""
    *lead, channels, rows, columns = latents.shape
    if rows != SAMPLES_PER_LATENT:
        raise ValueError(f"unframe: latents must be [..., C, {SAMPLES_PER_LATENT}, A], got {list(latents.shape)}")
    return latents.transpose(-1, -2).reshape(*lead, channels, rows * columns)


class AudioFrames(Config, tag="audio_frames"):
    """The toy world's audio codec as a validation decoder (an experiment's audio decoder):
    ``build(key).decode(latents [B, 2, 32, A]) -> waveform [B, 2, 32 A]`` in [-1, 1], ``.sample_rate`` its rate (set
    it to the world's ``data.world.audio_rate``)."""

    sample_rate: PositiveInt = 4096

    def build(self, key: torch.Tensor | None = None) -> "AudioCodec":
        return AudioCodec(self.sample_rate)


class AudioCodec:
    """Exact framing: ``encode`` maps waveforms ``[..., C, A * 32]`` in [-1, 1] to latents ``[..., C, 32, A]``
    (``SCALE * frame(w)``) and ``decode`` maps latents back (``unframe(z) / SCALE``, clamped to [-1, 1])."""

    def __init__(self, sample_rate: int):
        self.sample_rate = sample_rate

    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        return frame(waveform.float() * SCALE)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return (unframe(latents.float()) / SCALE).clamp(-1, 1)


def pitches(base: float, count: int, duration: float) -> list[float]:
    """The tone of each of ``count`` prompts, Hz: ``base * 2 ** (p / count)`` rounded to a whole number of cycles in
    a clip of ``duration`` seconds (a multiple of ``1 / duration``: one FFT bin of the clip)."""
    return [round(base * 2 ** (p / count) * duration) / duration for p in range(count)]


def tone(pitch: float, gains: Sequence[float], samples: int, sample_rate: int) -> np.ndarray:
    """A pure tone ``[len(gains), samples]`` float32: channel ``c`` is ``AMPLITUDE * gains[c] * sin(2 pi pitch n /
    sample_rate)`` at sample ``n`` (phase 0)."""
    wave = np.sin(2 * math.pi * pitch * np.arange(samples, dtype=np.float64) / sample_rate)
    return (AMPLITUDE * np.asarray(gains, dtype=np.float64)[:, None] * wave).astype(np.float32)


def pan(direction: str) -> tuple[float, float]:
    """The (left, right) gains of a direction's tone (:data:`PANS`)."""
    return PANS.get(direction, (1.0, 1.0))


def dominant_bins(waveforms: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64: for waveforms ``[N, C, S]``, the FFT bin (frequency ``bin * rate / S``) above DC with the most
    power summed over channels."""
    power = torch.fft.rfft(waveforms.double(), dim=-1).abs().pow(2).sum(1)  # [N, S // 2 + 1]
    return power[:, 1:].argmax(-1) + 1


def audio_quality(waveforms: torch.Tensor, prompts: torch.Tensor, tones: torch.Tensor,
                  bins: torch.Tensor) -> dict[str, float]:
    """Scores of decoded waveforms ``[N, C, S]`` of ``prompts [N]`` against each prompt's true tone ``tones [P, C, S]``
    whose FFT bin is ``bins [P]``: ``audio_mse`` (mean over samples of the MSE to the true tone; 0 when perfect) and
    ``pitch_match`` (the fraction whose dominant FFT bin is the prompt's)."""
    waveforms = waveforms.double()
    mse = ((waveforms - tones[prompts].double()) ** 2).flatten(1).mean(-1)
    return {"audio_mse": float(mse.mean()),
            "pitch_match": float((dominant_bins(waveforms) == bins[prompts]).double().mean())}
