"""The Wan VAE (diffusers ``AutoencoderKLWan``), frozen: a latent-to-video decoder, and optionally its encoder.

By default only the decoder half is kept (``post_quant_conv`` and ``decoder``): validation decodes. A method that
re-encodes decoded frames (streaming long tuning's first-frame anchor) builds it with ``encoder=True``, which keeps
``encoder`` and ``quant_conv`` as well (Wan 2.1's: 54 M params beside the decoder's 73 M).

Why a plain module and not params + ``functional_call``: the VAE is frozen, never differentiated, never sharded and
never checkpointed, so a pytree of its params would buy nothing. ``functional_call`` can only reach ``forward``
(encode then decode), while ``AutoencoderKLWan.decode`` and ``encode`` keep a per-call causal frame cache in module
attributes. So the skeleton is built on the meta device (no RNG read) and its weights are *assigned* once, either
from fvx key draws (``init``) or from a local diffusers folder (``load``); ``decode`` and ``encode`` then call
diffusers' own under ``torch.no_grad`` in eval mode. Because of that frame cache one VAE must not decode or encode
from two threads at once.

Latents at this interface are in the VAE's own scale (``decode`` takes them after a model's ``denormalize``,
``encode`` returns them before its ``normalize``), laid out ``[B, C, T, H, W]``; videos are
``[B, 3, 1 + tc (T - 1), sc H, sc W]``, fp32 in [0, 1]: ``decode`` returns FastVideo's ``decode_latents``
``(x / 2 + 0.5).clamp(0, 1)``; ``encode`` maps a video back to the VAE's [-1, 1] by ``2 v - 1`` and returns the
mean (the mode) of the posterior, as FastVideo's re-encoded anchor does, so no noise is drawn.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import pathlib
import zlib
from typing import Any, Callable, Literal, Mapping

import torch
from diffusers import AutoencoderKLWan
from torch import nn

from fvx.config import Config
from fvx.core import random
from fvx_models import diffusers_folder as dfolder
from fvx_models.wan import WAN21_LATENTS_MEAN, WAN21_LATENTS_STD

Params = dict[str, torch.Tensor]

# -------------------------------------------------------------------------------------------------------- presets

_WAN21 = dict(
    base_dim=96, decoder_base_dim=None, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0, latents_mean=list(WAN21_LATENTS_MEAN),
    latents_std=list(WAN21_LATENTS_STD), is_residual=False, in_channels=3, out_channels=3, patch_size=None,
    scale_factor_temporal=4, scale_factor_spatial=8,
)

PRESETS: dict[str, dict[str, Any]] = {
    # Wan's temporal structure (4x, first frame alone) with two upsampling stages instead of three (4x spatial) and
    # 8 base channels: about 13 ms for a [1, 16, 2, 8, 8] latent on a 2-core CPU (the 3-stage 8x layout took 270 ms).
    # Identity latent statistics, like the tiny Wan DiT's, so denormalize -> decode is consistent between the two.
    "tiny": {**_WAN21, "base_dim": 8, "dim_mult": [1, 2, 2], "num_res_blocks": 1, "temperal_downsample": [True, True],
             "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16, "scale_factor_spatial": 4},
    "wan2.1": _WAN21,  # Wan 2.1's VAE (the vae/ folder of every Wan 2.1 diffusers pipeline)
}
"""``AutoencoderKLWan`` constructor arguments per preset (every argument, so a folder's config.json can be checked)."""

CONFIG_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME = dfolder.CONFIG_NAME, dfolder.WEIGHTS_NAME, dfolder.WEIGHTS_INDEX_NAME
_ENCODER_PREFIXES = ("encoder.", "quant_conv.")
_STATS_FIELDS = ("latents_mean", "latents_std")  # data about the latents, not architecture: read, not checked
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown Wan VAE preset {preset!r}; valid presets: {', '.join(PRESETS)}")


def compression(preset: str) -> tuple[int, int]:
    """(temporal, spatial) compression of ``preset``, from its architecture: one 2x per temporal / spatial
    upsampling stage (diffusers' ``scale_factor_*`` config fields only describe them)."""
    _check_preset(preset)
    return _strides(PRESETS[preset])


def _strides(kwargs: Mapping[str, Any]) -> tuple[int, int]:
    """(temporal, spatial) compression of the ``AutoencoderKLWan`` arguments ``kwargs`` (a preset or a module's
    config)."""
    return 2 ** sum(kwargs["temperal_downsample"]), 2 ** (len(kwargs["dim_mult"]) - 1)


# ------------------------------------------------------------------------------------------------------------ VAE


@dataclasses.dataclass(frozen=True)
class VAE:
    """A frozen video decoder, and encoder when built with one (see the module docstring for layouts).

    decode(latents [B, C, T, H, W], VAE scale) -> video [B, 3, 1 + tc (T - 1), sc H, sc W], fp32 in [0, 1]
    encode(video [B, 3, 1 + tc (T - 1), sc H, sc W] in [0, 1]) -> latents [B, C, T, H, W], VAE scale, fp32 (the
        posterior's mean); a ValueError when the VAE was built without its encoder
    latents_mean / latents_std: the per-channel statistics a DiT's normalize uses (from the preset or the folder)
    """

    name: str
    latent_channels: int
    temporal_compression: int
    spatial_compression: int
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]
    decode: Callable[[torch.Tensor], torch.Tensor]
    encode: Callable[[torch.Tensor], torch.Tensor]

    def num_frames(self, latent_frames: int) -> int:
        """Video frames decoded from ``latent_frames`` latent frames: ``1 + tc (T - 1)``."""
        return 1 + self.temporal_compression * (latent_frames - 1)


# -------------------------------------------------------------------------------------------------------- skeleton


def skeleton(preset: str, *, encoder: bool = False) -> tuple[AutoencoderKLWan, dict[str, tuple[int, ...]]]:
    """The module for ``preset`` with parameters on meta (no RNG read), and the parameter shapes of the *whole* VAE
    (encoder included), which a folder's weights are checked against. The module keeps the decoder only
    (``post_quant_conv``, ``decoder``) unless ``encoder``, which keeps ``encoder`` and ``quant_conv`` too."""
    _check_preset(preset)
    with torch.device("meta"):
        module = AutoencoderKLWan(**copy.deepcopy(PRESETS[preset]))
    all_shapes = dfolder.param_shapes(module)
    if not encoder:
        module.encoder = None
        module.quant_conv = None
    if any(True for _ in module.buffers()):
        raise RuntimeError("Wan VAE skeleton: unexpected buffers (diffusers changed?)")
    return module.eval().requires_grad_(False), all_shapes


def _assign(module: AutoencoderKLWan, params: Params, device: torch.device | str | None,
            dtype: torch.dtype) -> AutoencoderKLWan:
    """``module`` holding ``params`` (cast to ``dtype`` on ``device``) in place of its meta parameters."""
    state = {name: p.to(device=device, dtype=dtype) for name, p in params.items()}
    module.load_state_dict(state, strict=True, assign=True)
    return module.requires_grad_(False)


# ------------------------------------------------------------------------------------------------------------ init


def init(module: AutoencoderKLWan, key: torch.Tensor) -> Params:
    """Random fp32 params of ``module`` (the decoder's, and the encoder's when it has one) from an fvx key, keyed
    like the state_dict; no global RNG.

    PyTorch's default rules: conv weights and biases ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)); RMS-norm gains one,
    biases zero. Each param's key is ``fold_in(key, crc32(name))``, so the decoder's draws do not depend on whether
    the encoder is kept.
    """
    params = {}
    for module_name, owner in module.named_modules():
        for local_name, param in owner.named_parameters(recurse=False):
            name = f"{module_name}.{local_name}" if module_name else local_name
            params[name] = _init_param(random.fold_in(key, zlib.crc32(name.encode())), owner, local_name, name,
                                       tuple(param.shape))
    return params


def _init_param(key: torch.Tensor, owner: nn.Module, local_name: str, name: str, shape: tuple[int, ...]):
    if isinstance(owner, (nn.Conv2d, nn.Conv3d)):
        bound = 1.0 / math.sqrt(math.prod(owner.weight.shape[1:]))
        return random.uniform(key, shape, minval=-bound, maxval=bound)
    if local_name == "gamma":
        return torch.ones(shape)
    if local_name == "bias" and not isinstance(owner, (nn.Conv2d, nn.Conv3d)):
        return torch.zeros(shape)
    raise ValueError(f"Wan VAE init: no rule for parameter {name!r} of a {type(owner).__name__}")


# ------------------------------------------------------------------------------------------------------------ load


def load(module: AutoencoderKLWan, all_shapes: Mapping[str, tuple[int, ...]],
         folder: str | os.PathLike) -> tuple[Params, dict[str, Any]]:
    """(fp32 params of ``module``, the folder's config.json) from a local diffusers folder: a VAE folder
    (config.json + safetensors) or a pipeline root holding one under ``vae/``. Never touches a hub.

    config.json must describe the preset's architecture (latent statistics may differ: they are data, read from it);
    the weights must hold every tensor of ``module`` with its shape (the decoder's; the encoder's and quant_conv's
    too when it keeps them) and nothing the VAE does not have (encoder weights are allowed, and skipped by a
    decoder-only module). Otherwise one ValueError lists every difference; a module that keeps the encoder, over
    weights with none of it, gets a one-line ValueError of its own.
    """
    folder = dfolder.component_folder(pathlib.Path(folder), "vae", "Wan VAE load", "AutoencoderKLWan")
    stored = dfolder.check_config(folder, module, "Wan VAE load", skip=_STATS_FIELDS)
    stored = {**{field: dfolder.constructor_defaults(AutoencoderKLWan)[field] for field in _STATS_FIELDS}, **stored}
    files = dfolder.weight_files(folder, "Wan VAE load")
    required, found = dfolder.param_shapes(module), dfolder.stored_shapes(files)
    _require_stored_encoder(module, found, folder)
    problems = dfolder.shape_problems(required, found, known=all_shapes)
    if problems:
        raise ValueError(f"Wan VAE: weights in {str(folder)!r} do not fit the VAE: " + "; ".join(problems))
    params = {}
    for path in files:
        with dfolder.open_safetensors(path, "Wan VAE load") as f:
            for name in f.keys():
                if name in required:
                    params[name] = dfolder.read_tensor(f, name, path, "Wan VAE load").to(torch.float32)
    return params, stored


def _require_stored_encoder(module: AutoencoderKLWan, found: Mapping[str, tuple[int, ...]],
                            folder: pathlib.Path) -> None:
    """A ValueError when ``module`` keeps the encoder but the weights ``found`` hold none of it (a decoder-only
    export)."""
    if module.encoder is not None and not any(name.startswith(_ENCODER_PREFIXES) for name in found):
        raise ValueError(f"Wan VAE load: weights in {str(folder)!r} hold no encoder (no encoder.* nor quant_conv.* "
                         "tensors); use a folder with the whole VAE, or build the VAE with encoder=False")


# ---------------------------------------------------------------------------------------------------------- decode


def decode(module: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    """Video ``[B, 3, 1 + tc (T - 1), sc H, sc W]`` fp32 in [0, 1] from VAE-scale latents ``[B, C, T, H, W]``.

    Runs diffusers' ``decode`` one sample at a time (the memory of one video) in the module's dtype and on its
    device, under ``torch.no_grad``; the video comes back on the latents' device. ``latents`` is not modified.
    """
    channels = module.config.z_dim
    if not (isinstance(latents, torch.Tensor) and latents.dim() == 5 and latents.shape[1] == channels
            and latents.shape[0] > 0 and latents.is_floating_point()):
        raise ValueError(f"Wan VAE decode: latents must be a float tensor [B, {channels}, T, H, W] with B >= 1, "
                         f"got {_described(latents)}")
    weight = module.post_quant_conv.weight
    with torch.no_grad():
        videos = [module.decode(z[None].to(device=weight.device, dtype=weight.dtype), return_dict=False)[0]
                  for z in latents]
        video = torch.cat(videos).float()
        return (video / 2 + 0.5).clamp(0, 1).to(latents.device)


def _described(x: Any) -> str:
    """``"<dtype> (shape)"`` of a tensor, else its type's name, for an error message."""
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


# ---------------------------------------------------------------------------------------------------------- encode


def encode(module: AutoencoderKLWan, video: torch.Tensor) -> torch.Tensor:
    """VAE-scale latents ``[B, C, T, H / sc, W / sc]`` fp32 from a video ``[B, 3, 1 + tc (T - 1), H, W]`` in
    [0, 1] (``decode``'s output: ``encode(decode(z))`` is a decode-then-encode as diffusers does it).

    The video is mapped back to the VAE's [-1, 1] by ``2 v - 1`` (in fp32) and the latents are the mean of
    diffusers' posterior, ``latent_dist.mode()``, as FastVideo's re-encoded anchor takes them: no sample, no RNG.
    Runs one sample at a time in the module's dtype and on its device, under ``torch.no_grad``; the latents come
    back on the video's device. ``video`` is not modified. A module built without its encoder raises.
    """
    if module.encoder is None:
        raise ValueError("Wan VAE encode: this VAE was built without its encoder (the default keeps the decoder "
                         "only); build it with WanVAEConfig(encoder=True) (override vae.encoder=true)")
    _check_video(module, video)
    weight = module.quant_conv.weight
    with torch.no_grad():
        latents = [module.encode((2 * v[None].float() - 1).to(device=weight.device, dtype=weight.dtype),
                                 return_dict=False)[0].mode() for v in video]
        return torch.cat(latents).float().to(video.device)


def _check_video(module: AutoencoderKLWan, video: torch.Tensor) -> None:
    """A ValueError unless ``video`` is a float ``[B, 3, 1 + tc k, H, W]`` with ``B >= 1`` and ``H``, ``W``
    positive multiples of ``sc``: diffusers' encoder silently drops frames past the last whole chunk of ``tc``."""
    channels, (temporal, spatial) = module.config.in_channels, _strides(module.config)
    if not (isinstance(video, torch.Tensor) and video.dim() == 5 and video.shape[0] > 0
            and video.shape[1] == channels and video.is_floating_point() and (video.shape[2] - 1) % temporal == 0
            and all(size > 0 and size % spatial == 0 for size in video.shape[3:])):
        raise ValueError(f"Wan VAE encode: video must be a float tensor [B, {channels}, 1 + {temporal} k, H, W] with "
                         f"B >= 1 and H, W multiples of {spatial}, got {_described(video)}")


# ---------------------------------------------------------------------------------------------------------- config


class WanVAEConfig(Config, tag="wan_vae"):
    """A Wan VAE decoder (and encoder): architecture preset, an optional local diffusers folder, the dtype, and
    whether the encoder is kept.

    ``path``: a VAE folder (config.json + safetensors) or a pipeline root with ``vae/``; never a hub id. Without
    it the VAE gets random weights from the key given to ``build`` (the tiny preset for tests and CPU runs).
    ``encoder``: also keep the encoder, so ``encode`` works (for methods that re-encode frames); off by default,
    which holds the decoder only (Wan 2.1's encoder would add 54 M params to the decoder's 73 M).
    """

    preset: Literal["tiny", "wan2.1"] = "tiny"
    path: str | None = None
    dtype: Literal["fp32", "bf16"] = "fp32"
    encoder: bool = False

    def __post_init__(self) -> None:
        _check_preset(self.preset)
        if self.dtype not in _DTYPES:
            raise ValueError(f"Wan VAE dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")

    def build(self, key: torch.Tensor | None = None, *, device: torch.device | str | None = None) -> VAE:
        """The :class:`VAE`: weights from ``path`` when set, else ``init(key)`` (then ``key`` is required), cast to
        ``dtype`` and placed on ``device`` (CPU by default); the encoder's too when ``encoder``."""
        module, all_shapes = skeleton(self.preset, encoder=self.encoder)
        if self.path is not None:
            params, stored = load(module, all_shapes, self.path)
            mean, std = stored["latents_mean"], stored["latents_std"]
        elif key is None:
            raise ValueError("WanVAEConfig.build: a key is required to initialise random weights when path is None")
        else:
            params = init(module, key)
            mean, std = PRESETS[self.preset]["latents_mean"], PRESETS[self.preset]["latents_std"]
        module = _assign(module, params, device or "cpu", _DTYPES[self.dtype])
        temporal, spatial = compression(self.preset)
        return VAE(
            name=f"wan_vae:{self.preset}",
            latent_channels=PRESETS[self.preset]["z_dim"],
            temporal_compression=temporal,
            spatial_compression=spatial,
            latents_mean=tuple(float(m) for m in mean),
            latents_std=tuple(float(s) for s in std),
            decode=functools.partial(decode, module),
            encode=functools.partial(encode, module),
        )
