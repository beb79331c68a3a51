"""Kandinsky 6's audio decoder (diffusers ``MMAudioVAE`` and ``MMAudioVocoder``), frozen, for validation and sampling:
audio latents ``[B, 1, F, A]`` in the VAE's own scale (``F`` its ``latent_channels``, the DiT's ``in_audio_dim``) ->
mono waveforms ``[B, 1, A * latent_hop_length]`` in [-1, 1] at ``sample_rate`` (the VAE config's; diffusers' defaults
are 44.1 kHz and 1024 samples a latent).

It does what ``Kandinsky6TI2VAPipeline`` does after denoising: the VAE decodes the latents (the DiT's divided by the
VAE's ``scaling_factor``, which the model's ``denormalize`` already did) into a log-mel spectrogram and the vocoder
turns that into a waveform. Weights come from a local pipeline root holding ``audio_vae/`` and ``vocoder/`` and never
change: plain modules in eval mode under no_grad.
"""
from __future__ import annotations

import json
import pathlib

import torch
from diffusers import MMAudioVAE, MMAudioVocoder

from fvx.config import Config
from fvx_models import diffusers_folder as dfolder

WHAT = "kandinsky6_audio"


class AudioDecoder:
    """Loaded audio VAE and vocoder: ``decode(latents [B, 1, F, A]) -> waveform [B, 1, A * hop]`` fp32 in [-1, 1] on
    the latents' device (the modules move there on first use), at ``sample_rate`` Hz."""

    def __init__(self, vae: MMAudioVAE, vocoder: MMAudioVocoder):
        self.vae, self.vocoder = vae, vocoder
        self.sample_rate = int(vae.config.sample_rate)
        self.features = int(vae.config.latent_channels)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, 1, F, A]`` in the VAE's scale -> waveforms ``[B, 1, S]`` fp32 on the latents' device."""
        if not (isinstance(latents, torch.Tensor) and latents.dim() == 4 and latents.shape[0] > 0
                and tuple(latents.shape[1:3]) == (1, self.features) and latents.shape[3] > 0):
            got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise ValueError(f"{WHAT} decode: latents must be [B, 1, {self.features}, A], got {got}")
        device = latents.device
        if next(self.vae.parameters()).device != device:  # decode where the latents are (the run's GPU)
            self.vae.to(device)
            self.vocoder.to(device)
        with torch.no_grad():
            mel = self.vae.decode(latents[:, 0].to(self.vae.dtype), return_dict=False)[0]
            return self.vocoder(mel.to(self.vocoder.dtype), return_dict=False)[0].float()


class Kandinsky6AudioDecoder(Config, tag="kandinsky6_audio"):
    """Kandinsky 6's audio decoder (an experiment's validation ``audio_vae``): ``path`` a local diffusers pipeline root
    holding ``audio_vae/`` (``MMAudioVAE``) and ``vocoder/`` (``MMAudioVocoder``); never a hub id. The folder is read
    when the run builds its validation, before anything is written (a recipe's paths dry-run anywhere)."""

    path: str

    def build(self, key: torch.Tensor | None = None) -> AudioDecoder:
        """The decoder, weights read from ``path`` in fp32 (``key`` is unused: nothing is drawn)."""
        root = pathlib.Path(self.path)
        if not root.is_dir():
            raise ValueError(f"{WHAT} path {self.path!r}: no such folder; give the Kandinsky 6 pipeline root holding "
                             "audio_vae/ and vocoder/")
        modules = [_load(cls, root, component) for cls, component in ((MMAudioVAE, "audio_vae"),
                                                                        (MMAudioVocoder, "vocoder"))]
        return AudioDecoder(*modules)


def _load(cls: type, root: pathlib.Path, component: str) -> torch.nn.Module:
    """``root/component`` loaded as ``cls`` in fp32, eval mode, frozen; a one-line ValueError when it cannot be."""
    folder, config_path = root / component, root / component / dfolder.CONFIG_NAME
    if not config_path.is_file():
        raise ValueError(f"{WHAT}: no {dfolder.CONFIG_NAME} in {str(folder)!r}; copy {component}/ from the Kandinsky "
                         "6 base model")
    try:
        found = json.loads(config_path.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{WHAT}: {str(config_path)!r} is not a diffusers config (a JSON object)") from None
    if found != cls.__name__:
        raise ValueError(f"{WHAT}: {str(config_path)!r} describes a {found}, not an {cls.__name__}")
    try:
        module = cls.from_pretrained(str(folder), torch_dtype=torch.float32)
    except (OSError, ValueError, RuntimeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{WHAT}: cannot load the {cls.__name__} in {str(folder)!r}: {first}") from None
    return module.eval().requires_grad_(False)
