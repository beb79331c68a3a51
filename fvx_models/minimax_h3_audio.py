"""MiniMax-H3's audio VAE (diffusers ``AutoencoderKLMiniMaxH3Audio``), frozen, as a validation decoder: stereo audio
latents ``[B, 2, 32, A]`` -> waveforms ``[B, 2, A * hop]`` in [-1, 1] at ``sample_rate``.

The VAE is mono (a DAC-style encoder, a BigVGAN decoder; the release hops 800 samples at 32 kHz, 40 latents a second)
and MiniMax-H3 carries stereo as two batch items at its boundary. ``decode`` does what diffusers'
``MiniMaxH3AudioDecodeStep`` does for each sample: denormalise with the VAE config's per-feature ``latents_mean`` and
``latents_std`` (``z std + mean``; FastVideo's t2va data holds normalised latents), decode the two stereo channels as
a batch of two, and lay the result out as ``[2, samples]``. Weights come from a local diffusers folder (``path``: the
``audio_vae/`` folder, or a pipeline root holding it) and never change: a plain module in eval mode under no_grad.
"""
from __future__ import annotations

import json
import pathlib

import torch
from diffusers import AutoencoderKLMiniMaxH3Audio

from fvx.config import Config
from fvx_models import diffusers_folder as dfolder

WHAT = "minimax_h3_audio"
STEREO = 2  # MiniMax-H3's audio channels, decoded as batch items


class AudioDecoder:
    """A loaded audio VAE: ``decode(latents [B, 2, F, A]) -> waveform [B, 2, A * hop]`` fp32 in [-1, 1], at
    ``sample_rate`` Hz, on the latents' device (the VAE moves there on first use); ``samples_per_latent`` is the hop
    (800 in the release)."""

    def __init__(self, module: AutoencoderKLMiniMaxH3Audio):
        self.module = module
        self.sample_rate = int(module.config.sampling_rate)
        self.samples_per_latent = int(module.hop_length)
        self.features = int(module.config.latent_channels)
        self.mean = torch.tensor(module.config.latents_mean, dtype=torch.float32).view(1, -1, 1)
        self.std = torch.tensor(module.config.latents_std, dtype=torch.float32).view(1, -1, 1)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised stereo latents ``[B, 2, F, A]`` -> waveforms ``[B, 2, A * hop]`` fp32 on the latents' device."""
        if not (isinstance(latents, torch.Tensor) and latents.dim() == 4 and latents.shape[0] > 0
                and tuple(latents.shape[1:3]) == (STEREO, self.features) and latents.shape[3] > 0):
            got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise ValueError(f"{WHAT} decode: latents must be [B, {STEREO}, {self.features}, A], got {got}")
        batch, device = latents.shape[0], latents.device
        if next(self.module.parameters()).device != device:  # decode where the latents are (the run's GPU)
            self.module.to(device)
        z = latents.float().reshape(batch * STEREO, self.features, -1)  # one mono batch item per stereo channel
        z = z * self.std.to(device) + self.mean.to(device)
        with torch.no_grad():
            audio = self.module.decode(z, return_dict=False)[0]  # [B 2, 1, samples]
        return audio.float().reshape(batch, STEREO, -1)


def _vae_folder(path: str) -> pathlib.Path:
    """The audio VAE folder of ``path`` (itself, or ``audio_vae/`` of a pipeline root); a ValueError otherwise."""
    root = pathlib.Path(path)
    if not root.is_dir():
        raise ValueError(f"{WHAT} path {path!r}: no such folder; give the audio_vae/ folder of MiniMax-H3 (or the "
                         "pipeline root holding it)")
    folder = dfolder.component_folder(root, "audio_vae", f"{WHAT} path {path!r}", AutoencoderKLMiniMaxH3Audio.__name__)
    config_path = folder / dfolder.CONFIG_NAME
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{WHAT}: {str(config_path)!r} is not valid JSON: {error}") from None
    found = config.get("_class_name") if isinstance(config, dict) else type(config).__name__
    if found != AutoencoderKLMiniMaxH3Audio.__name__:
        raise ValueError(f"{WHAT}: {str(config_path)!r} describes a {found}, not an AutoencoderKLMiniMaxH3Audio")
    channels = config.get("latent_channels", 32)
    for name in ("latents_mean", "latents_std"):
        values = config.get(name)
        if not (isinstance(values, list) and len(values) == channels):
            raise ValueError(f"{WHAT}: {str(config_path)!r} has {name} {values!r}; the pipeline needs {channels} "
                             "values (one per latent feature) to denormalise")
    if any(not s > 0 for s in config["latents_std"]):
        raise ValueError(f"{WHAT}: {str(config_path)!r} has a latents_std value that is not positive")
    return folder


class MiniMaxH3AudioDecoder(Config, tag="minimax_h3_audio"):
    """MiniMax-H3's audio VAE decoder (an experiment's validation ``audio_vae``): ``path`` a local folder of diffusers'
    ``AutoencoderKLMiniMaxH3Audio`` (``audio_vae/`` or the pipeline root holding it); never a hub id. The folder is
    read when the run builds its validation, before anything is written (a recipe's paths dry-run anywhere)."""

    path: str

    def build(self, key: torch.Tensor | None = None) -> AudioDecoder:
        """The decoder, weights read from ``path`` in fp32 (``key`` is unused: nothing is drawn)."""
        folder = _vae_folder(self.path)
        try:
            module = AutoencoderKLMiniMaxH3Audio.from_pretrained(str(folder), torch_dtype=torch.float32)
        except (OSError, ValueError, RuntimeError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"{WHAT}: cannot load the audio VAE in {str(folder)!r}: {first}") from None
        return AudioDecoder(module.eval().requires_grad_(False))
