"""LTX-Video text-to-video (diffusers ``LTXVideoTransformer3DModel``, Lightricks' 2B and 13B DiTs): the family's spec.

A token-sequence DiT: patch size 1, so every latent voxel is a token. The family declares the channels-last layout
``"BTHWC"``, flattens ``[B, T, H, W, C]`` to ``[B, T H W, C]`` as ``LTXPipeline._pack_latents`` does, and reshapes the
``[B, T H W, C]`` output back. As ``LTXPipeline`` calls it, the DiT is told the latent grid (``num_frames``, ``height``,
``width``) and the RoPE interpolation scale ``(vae_t / fps, vae_s, vae_s)`` (the VAE's compression over the frame rate
of the videos: ``LTXVideoConfig.fps``, default the pipeline's 25), the timestep ``t`` on 0..1000 as it is (the
scheduler's ``1000 sigma``, one per sample), and the T5 mask as ``encoder_attention_mask`` (padded tokens get a -10000
bias). It predicts the flow velocity ``noise - x0``: ``LTXPipeline`` hands it to
``FlowMatchEulerDiscreteScheduler.step``.

Conditioning: T5-XXL embeddings ``text [B, L, 4096]`` and ``text_mask [B, L]`` (valid tokens first); the pipeline pads
to 128 tokens (``max_sequence_length``), the DiT takes any length.

Latents. The LTX VAE keeps per-channel statistics in its weights (``AutoencoderKLLTXVideo.latents_mean`` /
``latents_std`` buffers, 128 channels, and ``scaling_factor`` in its config.json), and diffusers' pipelines normalise
with them (``_normalize_latents``: ``(z - mean) * scaling_factor / std``; ``_denormalize_latents`` before decoding).
Which statistics apply depends on the data, so it is a config knob, ``latents_stats``:
  * None (default): identity (mean 0, std 1, scale 1), for data whose latents are already normalised, as
    Lightricks' LTX-Video-Trainer preprocessing stores them (``_normalize_latents(vae.encode(video).latent_dist
    .sample(), vae.latents_mean, vae.latents_std)``, as diffusers' image-to-video pipelines normalise a given frame)
    and as fvx's preprocessing stores them (:data:`ENCODERS`: the posterior mean, normalised the same way);
  * a local folder of the VAE (``vae/`` or the pipeline root holding it): the data holds raw VAE latents (what
    ``AutoencoderKLLTXVideo.encode`` gives); fvx reads ``latents_mean`` / ``latents_std`` from its safetensors and
    ``scaling_factor`` and the compression from its config.json, and normalises exactly as ``_normalize_latents``.
The statistics are not in the transformer's checkpoint and fvx ships none: a VAE folder it cannot read is a
one-line error.

Training noise levels are LTX-Video-Trainer's (Lightricks' ``src/ltxv_trainer/timestep_samplers.py``), the family's own
sampler (:func:`sigma_sampler`), which fine-tuning uses in place of its timestep density: by default its shifted
logit-normal ``sigma = sigmoid(N(mu, timestep_std))``, ``mu = shift_mu(tokens)`` of the batch's token count (every
latent voxel a token), not shifted again and not clamped; the DiT is given ``round(1000 sigma)``, as the trainer
rounds it (``training_strategies.py``), while the noise is mixed at ``sigma`` itself. ``timestep_sampling="uniform"``
is the trainer's other mode, ``sigma ~ U(0, 1)``.

Positions are ``LTXPipeline``'s (and LTX-Video-Trainer's, which trains every 2B and 13B release with them):
``LTXConditionPipeline``, which diffusers documents for 0.9.5 and later, computes its own ``video_coords`` (latent
frame ``f`` at ``max(8 f - 7, 0) / fps`` instead of ``8 f / fps``).

Exports are ``LTXPipeline`` folders (``scheduler/`` as diffusers' conversion script writes it for the preset; copy the
VAE, text encoder and tokenizer from the base model). LTX-Video has no FastVideo training recipe; its experiment's
recipe is Lightricks' LTX-Video-Trainer LoRA defaults (``experiments/finetune_ltx_video.py``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Any, Literal, Mapping

import msgspec
import torch
from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel
from typing_extensions import Annotated

from fvx.core import random
from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, encoders as fencoders, wan
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Conditioning, Family, Forward, Preset, TEXT_MASK_DEFAULT,
                               Training, require, skeleton_of)
from fvx_models.model import LatentSpace

CHANNELS = 128  # AutoencoderKLLTXVideo's latent_channels, every release
VAE_STRIDE = (8, 32, 32)  # its (temporal, spatial, spatial) compression, every release
TEXT_LEN = 128  # LTXPipeline's max_sequence_length
FPS = 25.0  # LTXPipeline's frame_rate
VAE = "LTX-Video"

IDENTITY = LatentSpace(CHANNELS, (0.0,) * CHANNELS, (1.0,) * CHANNELS, vae_stride=VAE_STRIDE, vae=VAE)
"""Latents already normalised with the VAE's statistics (``latents_stats`` None)."""

_LTX = dict(
    in_channels=CHANNELS, out_channels=CHANNELS, patch_size=1, patch_size_t=1, num_attention_heads=32,
    attention_head_dim=64, cross_attention_dim=2048, num_layers=28, activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096,
    attention_bias=True, attention_out_bias=True,
)
LTX_2B = _LTX  # diffusers' convert_ltx_to_diffusers: 0.9.0, 0.9.1, 0.9.5 (and Lightricks' 2B 0.9.6)
LTX_13B = {**_LTX, "attention_head_dim": 128, "cross_attention_dim": 4096, "num_layers": 48}  # 0.9.7 (and 0.9.8)
# dim 32 (2 heads of 16): 32 % 6 = 2 RoPE channels padded, as the real 2048 and 4096 are
TINY = {**_LTX, "in_channels": 8, "out_channels": 8, "num_attention_heads": 2, "attention_head_dim": 16,
        "cross_attention_dim": 32, "num_layers": 2, "caption_channels": 16}
TINY_LATENTS = LatentSpace(8, (0.0,) * 8, (1.0,) * 8, vae_stride=VAE_STRIDE, vae="tiny LTX-Video")

# diffusers' convert_ltx_to_diffusers.py writes this scheduler for 0.9.0/0.9.1 (the Lightricks/LTX-Video pipeline):
# a resolution-dependent shift, mu from the token count between 1024 and 4096 tokens, stretched to end at 0.1
DYNAMIC_SHIFT = dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                     max_image_seq_len=4096, shift_terminal=0.1)
# and this one for 0.9.5 and 0.9.7 (static, shift 1)
STATIC_SHIFT = dict(use_dynamic_shifting=False)


def shift_mu(tokens: int) -> float:
    """The resolution-dependent shift ``mu`` of ``tokens`` latent tokens: linear through (1024, 0.95) and (4096, 2.05),
    as ``LTXPipeline`` computes it for the scheduler (``calculate_shift`` with ``DYNAMIC_SHIFT``'s bounds; sigmas
    shifted by ``e^mu``) and LTX-Video-Trainer's shifted logit-normal timestep sampler centres on it."""
    slope = (DYNAMIC_SHIFT["max_shift"] - DYNAMIC_SHIFT["base_shift"]) / (
        DYNAMIC_SHIFT["max_image_seq_len"] - DYNAMIC_SHIFT["base_image_seq_len"])
    return DYNAMIC_SHIFT["base_shift"] + slope * (tokens - DYNAMIC_SHIFT["base_image_seq_len"])


def shifted_logit_normal_sigma(normal: torch.Tensor, tokens: int, std: float) -> torch.Tensor:
    """LTX-Video-Trainer's shifted logit-normal noise level from standard normals ``normal [B]`` at ``tokens`` tokens:
    ``sigmoid(std normal + shift_mu(tokens))`` (its ``ShiftedLogitNormalTimestepSampler``), fp32 ``[B]`` in (0, 1)."""
    return torch.sigmoid(normal.float() * std + shift_mu(tokens))


def sigma_sampler(config: LTXVideoConfig, keys: torch.Tensor, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Training noise levels of latents ``x0 [B, C, T, H, W]`` from per-sample keys ``keys [B, 2]``, as
    LTX-Video-Trainer draws them (module docstring): the shifted logit-normal at the latents' token count (``T H W``
    over the patch sizes), or U(0, 1) (``timestep_sampling="uniform"``). Returns ``(sigma [B], t [B])`` fp32 with
    ``t = round(1000 sigma)``, the trainer's integer timestep; a sample's draw depends on its own key only."""
    keys = keys.to(x0.device)
    if config.timestep_sampling == "uniform":
        sigma = torch.vmap(lambda key: random.uniform(key, ()))(keys)
    else:
        k = config.spec.kwargs
        tokens = math.prod(x0.shape[2:]) // (k["patch_size_t"] * k["patch_size"] ** 2)
        sigma = shifted_logit_normal_sigma(random.normal_each(keys), tokens, config.timestep_std)
    return sigma, torch.round(sigma * 1000.0)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, TINY_LATENTS, 8, {"scheduler": DYNAMIC_SHIFT}),
    "ltx-video-2b": Preset(LTX_2B, IDENTITY, TEXT_LEN, {"scheduler": DYNAMIC_SHIFT}),
    "ltx-video-13b": Preset(LTX_13B, IDENTITY, TEXT_LEN, {"scheduler": STATIC_SHIFT}),
}
"""``LTXVideoTransformer3DModel`` constructor arguments per preset (every argument, as diffusers' conversion script
writes them), the latent space (identity statistics: ``LTXVideoConfig.latents_stats`` replaces them), the text
length, and the scheduler its pipeline folder gets."""

# What one block saves per token (saved-tensor hooks, bf16, eager; tests/fvx_models/test_ltx_video.py measures it
# again on the tiny model). bench/activations.py cannot fit LTX (its blocks take keyword arguments, and the FFN is
# always 4x the width, so widening it cannot separate the FFN term): compute_ffn is the tanh-GELU's input and output
# counted from the graph, compute_dim the measured rest (21 - 4 x 2, at dims 32, 64 and 128), fp32_dim the measured
# fp32 vectors (the RMS norms' and the rotary q/k's: 9.75 at dim 32, 9.35 at 128).
BLOCK_ACTIVATIONS = memory.BlockActivations(fp32_dim=9.4, compute_dim=13.0, compute_ffn=2.0)
FFN_MULT = 4  # diffusers' FeedForward default, which LTXVideoTransformerBlock keeps


# ---------------------------------------------------------------------------------------------- latent statistics


@functools.lru_cache(maxsize=16)
def read_latents_stats(folder: str) -> LatentSpace:
    """The latent space of the LTX VAE in ``folder`` (a VAE folder, or a pipeline root holding ``vae/``): its
    ``latents_mean`` / ``latents_std`` buffers, ``scaling_factor`` and compression. A ValueError names what is
    missing."""
    what = f"ltx_video latents_stats {folder!r}"
    root = pathlib.Path(folder)
    if not root.is_dir():
        raise ValueError(f"{what}: no such folder; give the LTX-Video VAE folder (vae/ of the base model, or the "
                         "pipeline root) to normalise raw VAE latents, or leave latents_stats unset for latents "
                         "already normalised")
    vae = dfolder.component_folder(root, "vae", what, "AutoencoderKLLTXVideo")
    try:
        config = json.loads((vae / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{what}: {str(vae / 'config.json')!r} is not valid JSON: {error}") from None
    if not isinstance(config, dict) or config.get("_class_name") != AutoencoderKLLTXVideo.__name__:
        found = config.get("_class_name") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"{what}: {str(vae / 'config.json')!r} describes a {found}, not an AutoencoderKLLTXVideo")
    stats = {}
    for path in dfolder.weight_files(vae, what):
        with dfolder.open_safetensors(path, what) as f:
            for name in ("latents_mean", "latents_std"):
                if name in f.keys():
                    stats[name] = dfolder.read_tensor(f, name, path, what).float()
    missing = [name for name in ("latents_mean", "latents_std") if name not in stats]
    if missing:
        raise ValueError(f"{what}: the VAE's weights in {str(vae)!r} hold no {' nor '.join(missing)}")
    defaults = dfolder.constructor_defaults(AutoencoderKLLTXVideo)
    field = lambda name: config.get(name, defaults[name])  # noqa: E731
    channels, scale = field("latent_channels"), field("scaling_factor")
    mean, std = stats["latents_mean"], stats["latents_std"]
    if mean.shape != (channels,) or std.shape != (channels,):
        raise ValueError(f"{what}: latents_mean {list(mean.shape)} and latents_std {list(std.shape)} must both be "
                         f"[{channels}] (the VAE's latent_channels)")
    if not (torch.isfinite(mean).all() and torch.isfinite(std).all() and (std > 0).all()):
        raise ValueError(f"{what}: latents_mean must be finite and latents_std finite and positive")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{what}: scaling_factor must be a positive number, got {scale!r}")
    scaling = sum(field("spatio_temporal_scaling"))
    stride = (field("temporal_compression_ratio") or field("patch_size_t") * 2 ** scaling,
              field("spatial_compression_ratio") or field("patch_size") * 2 ** scaling)
    return LatentSpace(channels, tuple(mean.tolist()), tuple(std.tolist()), float(scale),
                       vae_stride=(int(stride[0]), int(stride[1]), int(stride[1])), vae=VAE)


@functools.lru_cache(maxsize=16)
def with_stats(preset: str, folder: str) -> Preset:
    """Preset ``preset`` on the latent space of the VAE in ``folder``; a ValueError when the channels differ."""
    base = PRESETS[preset]
    latents = read_latents_stats(folder)
    if latents.channels != base.latents.channels:
        raise ValueError(f"ltx_video latents_stats {folder!r}: the VAE has {latents.channels} latent channels; "
                         f"preset {preset!r} denoises {base.latents.channels}")
    return dataclasses.replace(base, latents=latents)


# ---------------------------------------------------------------------------------------------------------- the DiT


def cond_spec(config: ModelConfig) -> dict[str, tuple]:
    return {"text": ("L", config.spec.kwargs["caption_channels"]), "text_mask": ("L",)}


def cond_from_batch(config: ModelConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The T5 embedding and its padding mask (the data's ``text_embedding``, padded to ``data.text_len``)."""
    require(batch, ("text", "text_mask"), "ltx_video", "the T5 text embedding and its mask")
    return {"text": batch["text"], "text_mask": batch["text_mask"]}


def rope_scale(config: LTXVideoConfig) -> tuple[float, int, int]:
    """``LTXPipeline``'s ``rope_interpolation_scale``: the VAE's temporal compression over the frame rate, and its
    spatial compression."""
    t, h, w = config.spec.latents.vae_stride
    return (t / config.fps, h, w)


def inputs(config: LTXVideoConfig, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """``x [B, T, H, W, C]`` as the token sequence ``[B, T H W, C]``, with what ``LTXPipeline`` passes beside it."""
    batch, frames, height, width, channels = x.shape
    return {"hidden_states": x.reshape(batch, frames * height * width, channels),
            "encoder_hidden_states": cond["text"], "timestep": t, "encoder_attention_mask": cond["text_mask"],
            "num_frames": frames, "height": height, "width": width, "rope_interpolation_scale": rope_scale(config),
            "return_dict": False}


def output(config: ModelConfig, out: Any, x: torch.Tensor, t: torch.Tensor,
           cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The token sequence ``[B, T H W, C]`` back as ``x``'s ``[B, T, H, W, C]``."""
    return out[0].reshape(x.shape)


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    return dim, {"transformer_blocks": (dim, FFN_MULT * dim)}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``LTXPipeline`` files beside the exported ``transformer/``: ``model_index.json`` and ``scheduler/``
    (the preset's, as diffusers' conversion script writes it). The VAE, text encoder and tokenizer are the base
    model's: copy them from it."""
    FlowMatchEulerDiscreteScheduler(**config.spec.options["scheduler"]).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "LTXPipeline",
        {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
         "transformer": ("diffusers", "LTXVideoTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLLTXVideo"),
         "text_encoder": ("transformers", "T5EncoderModel"), "tokenizer": ("transformers", "T5Tokenizer")})


# ------------------------------------------------------------------------------------------------------- encoders


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """T5's last hidden state at 128 tokens (``LTXPipeline.encode_prompt``, no CFG), each prompt's real tokens
    ``[L_i, 4096]`` (the pipeline's own mask: T5 runs unmasked, so the padded rows are cut, not zero)."""
    embeds, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=TEXT_LEN,
                                            device=pipe.text_encoder.device)
    return fencoders.real_tokens(embeds, mask)


ENCODERS = fencoders.Encoders(
    pipeline="LTXPipeline", text=("tokenizer", "text_encoder"), encode_text=encode_text,
    encode_video=fencoders.pipeline_normalized_latents, frame_step=VAE_STRIDE[0], pixel_multiple=VAE_STRIDE[1],
    audio_refusal="LTX-Video makes no sound")
"""LTX-Video's encoders. Stored latents are normalised (``latents_stats`` None, the default): the posterior mean, not
a draw, through ``_normalize_latents``, as LTX-Video-Trainer's preprocessing stores them (it draws a sample)."""


LTX_VIDEO = Family(
    name="ltx_video",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=lambda config: skeleton_of(LTXVideoTransformer3DModel, config.spec.kwargs),  # RoPE holds no buffer
        unit_groups={"transformer_blocks": ("transformer_blocks",)},
        activations={"transformer_blocks": BLOCK_ACTIVATIONS},
        widths=widths,
        # N(0, 1) / sqrt(dim): the root's [2, dim], the blocks' [6, dim]
        init_rules={"scale_shift_table": wan.scale_shift_init},
        self_attention=("transformer_blocks.*.attn1",),
    ),
    forward=Forward(
        inputs=inputs,
        layout="BTHWC",
        output=output,
    ),
    conditioning=Conditioning(
        spec=cond_spec,
        from_batch=cond_from_batch,
        defaults=TEXT_MASK_DEFAULT,
    ),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(sigma_sampler=sigma_sampler),
)


class LTXVideoConfig(ModelConfig, tag="ltx_video"):
    """An LTX-Video DiT (presets: tiny, ltx-video-2b, ltx-video-13b). ``fps``: the frame rate of the training videos,
    which sets the temporal RoPE scale (``LTXPipeline``'s ``frame_rate``, default 25). ``latents_stats``: None when
    the data's latents are already normalised (LTX-Video-Trainer's preprocessing), else a local folder of the LTX VAE
    whose per-channel statistics normalise raw VAE latents as diffusers' ``_normalize_latents`` does (module
    docstring). ``timestep_sampling`` and ``timestep_std``: the training noise levels, LTX-Video-Trainer's
    ``flow_matching.timestep_sampling_mode`` (``shifted_logit_normal``, its default, or ``uniform``) and its
    ``timestep_sampling_params.std`` (default 1): fine-tuning draws them in place of the method's timestep density
    (:func:`sigma_sampler`)."""

    family = LTX_VIDEO

    fps: Annotated[float, msgspec.Meta(gt=0)] = FPS
    latents_stats: str | None = None
    timestep_sampling: Literal["shifted_logit_normal", "uniform"] = "shifted_logit_normal"
    timestep_std: Annotated[float, msgspec.Meta(gt=0)] = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not math.isfinite(self.fps):
            raise ValueError(f"ltx_video fps must be a positive finite frame rate (frames per second), got {self.fps}")
        if not (math.isfinite(self.timestep_std) and self.timestep_std > 0):
            raise ValueError(f"ltx_video timestep_std must be a positive finite standard deviation, got "
                             f"{self.timestep_std}")
        if self.latents_stats is not None:
            with_stats(self.preset, self.latents_stats)  # read now: a bad folder is an error before anything runs

    @property
    def spec(self) -> Preset:
        return self.family.preset(self.preset) if self.latents_stats is None else with_stats(self.preset,
                                                                                             self.latents_stats)
