"""WAV files of sound: a waveform ``[C, S]`` in [-1, 1] as 16-bit PCM (stdlib ``wave``), written durably, and read back.

Samples are clipped to [-1, 1] and stored as ``round(32767 x)``, so reading gives them back to within ``0.5 / 32767``;
channels are interleaved as WAV requires.
"""
from __future__ import annotations

import io
import numbers
import os
import pathlib
import wave

import numpy as np
import torch

from fvx.storage.files import write_atomic

FULL_SCALE = 32767  # int16 value of +1.0


def wav_bytes(waveform: torch.Tensor | np.ndarray, sample_rate: int) -> bytes:
    """The bytes of a 16-bit PCM WAV file of ``waveform [C, S]`` (float, clipped to [-1, 1]) at ``sample_rate`` Hz;
    ValueError for a waveform that is not 2-D float with C >= 1 and finite, or a rate that is not a positive int."""
    samples = _checked(waveform)
    rate = _checked_rate(sample_rate)
    pcm = np.round(np.clip(samples, -1.0, 1.0) * FULL_SCALE).astype("<i2")  # [C, S]
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(pcm.shape[0])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.ascontiguousarray(pcm.T).tobytes())  # frames of interleaved channels
    return buffer.getvalue()


def write_wav(path: str | os.PathLike, waveform: torch.Tensor | np.ndarray, sample_rate: int) -> pathlib.Path:
    """Write ``waveform [C, S]`` in [-1, 1] (clipped) as a 16-bit PCM WAV at ``path`` (its folder made first),
    atomically and durably (``fvx.storage.files.write_atomic``); returns the path."""
    payload = wav_bytes(waveform, sample_rate)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, payload)
    return path


def read_wav(path: str | os.PathLike) -> tuple[torch.Tensor, int]:
    """A 16-bit PCM WAV file as ``(waveform [C, S] float32 in [-1, 1], sample_rate)`` (int16 / 32767)."""
    with wave.open(str(path), "rb") as source:
        if source.getsampwidth() != 2:
            raise ValueError(f"read_wav: {str(path)!r} holds {8 * source.getsampwidth()}-bit samples; "
                             "only 16-bit PCM is read")
        channels, rate = source.getnchannels(), source.getframerate()
        frames = source.readframes(source.getnframes())
    pcm = np.frombuffer(frames, dtype="<i2").reshape(-1, channels).T  # [C, S]
    return torch.from_numpy(pcm.astype(np.float32) / FULL_SCALE), rate


def _checked(waveform: torch.Tensor | np.ndarray) -> np.ndarray:
    """``waveform`` as float64 numpy ``[C, S]``; ValueError unless 2-D, floating, C >= 1 and finite."""
    if isinstance(waveform, torch.Tensor):
        if not waveform.is_floating_point():
            raise ValueError(f"waveform must be a float tensor [C, S] in [-1, 1], got dtype {waveform.dtype}")
        waveform = waveform.detach().to("cpu", torch.float64).numpy()
    elif isinstance(waveform, np.ndarray):
        if not np.issubdtype(waveform.dtype, np.floating):
            raise ValueError(f"waveform must be a float array [C, S] in [-1, 1], got dtype {waveform.dtype}")
        waveform = waveform.astype(np.float64)
    else:
        raise ValueError(f"waveform must be a torch tensor or numpy array [C, S], got {type(waveform).__name__}")
    if waveform.ndim != 2 or waveform.shape[0] == 0:
        raise ValueError(f"waveform must be 2-D [C, S] with C >= 1 channels, got shape {list(waveform.shape)}")
    if not np.isfinite(waveform).all():
        raise ValueError(f"waveform must be finite, got {int((~np.isfinite(waveform)).sum())} NaN or Inf samples")
    return waveform


def _checked_rate(sample_rate) -> int:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Integral) or sample_rate <= 0:
        raise ValueError(f"sample_rate must be a positive int (Hz), got {sample_rate!r}")
    return int(sample_rate)
