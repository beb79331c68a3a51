"""Allegro (diffusers ``AllegroTransformer3DModel``): an epsilon-prediction DDPM family, trained and sampled as a flow.

Allegro is a PixArt-style DiT over the whole video's tokens (3-D RoPE, T5 cross-attention through its padding mask)
on its own VAE's latents (4 channels, 4 x 8 x 8). It predicts the noise on diffusers' default linear DDPM schedule
(betas 0.0001 to 0.02 over 1000 steps): rhymes-ai/Allegro's ``train.py`` noises with ``DDPMScheduler()`` at
``torch.randint(0, 1000)`` timesteps and takes the plain epsilon loss; its ``single_inference.py`` samples with
``EulerAncestralDiscreteScheduler()`` on the same betas. fvx runs it as a flow (``fvx_models.vp_flow``): the DiT gets
``s x_t`` at the timestep of ``sigma`` and its noise is read back as the velocity ``s (eps - x_t) / a``.

Its own rules: those uniform integer timesteps, the epsilon loss (``(1 - sigma)^2`` on the velocity loss), and the
Euler scheduler's levels for ``validation.schedule=model`` (its Karras sigma ``b / a`` is the flow's ``sigma / (1 -
sigma)``; a flow Euler step between two is its deterministic Euler step, without the ancestral sampler's fresh
noise).

Inputs as ``AllegroPipeline`` passes them: latents ``[B, C, T, H, W]``, the timestep, the T5 text (512 tokens) and
its mask, and the RoPE tables and positions its ``_prepare_rotary_positional_embeddings`` makes for the latent grid.
"""
from __future__ import annotations

import functools
import pathlib
from typing import Any, Mapping

import torch
from diffusers import AllegroTransformer3DModel, DDPMScheduler, EulerAncestralDiscreteScheduler
from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro
from torch import nn

from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, encoders as fencoders, vp_flow, wan
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Family, Forward, Preset, Training, skeleton_of,
                               text_conditioning)
from fvx_models.model import LatentSpace

# rhymes-ai/Allegro's transformer config (diffusers' AllegroTransformer3DModel defaults are that config)
ALLEGRO = dict(
    patch_size=2, patch_size_t=1, num_attention_heads=24, attention_head_dim=96, in_channels=4, out_channels=4,
    num_layers=32, dropout=0.0, cross_attention_dim=2304, attention_bias=True, sample_height=90, sample_width=160,
    sample_frames=22, activation_fn="gelu-approximate", norm_elementwise_affine=False, norm_eps=1e-6,
    caption_channels=4096, interpolation_scale_h=2.0, interpolation_scale_w=2.0, interpolation_scale_t=2.2,
)
TINY = {**ALLEGRO, "num_attention_heads": 2, "attention_head_dim": 24, "in_channels": 16, "out_channels": 16,
        "num_layers": 2, "cross_attention_dim": 48, "sample_height": 8, "sample_width": 8, "sample_frames": 4,
        "caption_channels": 32}

ALLEGRO_VAE = LatentSpace(4, scale=0.13235, vae_stride=(4, 8, 8), vae="Allegro")
TINY_VAE = LatentSpace(16, vae_stride=(4, 8, 8), vae="tiny Allegro")

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, TINY_VAE, 8),
    # the toy world's at space-to-depth 4 (48 channels a token, 4 x 4 tokens a frame, patch 1; 4 text tokens): an
    # epsilon model reads its noise through 1 / a, too coarse from 192-channel tokens (fvx_models.latte); its RoPE
    # splits a head in thirds of even width (a head dim of 6n)
    "world": Preset({**TINY, "num_attention_heads": 4, "attention_head_dim": 48, "cross_attention_dim": 192,
                     "num_layers": 3, "in_channels": 48, "out_channels": 48, "patch_size": 1, "sample_height": 4,
                     "sample_width": 4}, wan.WORLD_CODEC_4, 4),
    "allegro": Preset(ALLEGRO, ALLEGRO_VAE, 512),
}
"""``AllegroTransformer3DModel`` constructor arguments per preset, the latent space and the text length (T5 at 512)."""


# ------------------------------------------------------------------------------------------------ the flow's clock


def scheduler() -> EulerAncestralDiscreteScheduler:
    """A fresh ``EulerAncestralDiscreteScheduler()``: Allegro's sampler (diffusers' defaults: its training betas)."""
    return EulerAncestralDiscreteScheduler()


@functools.lru_cache(maxsize=None)
def schedule_abar() -> torch.Tensor:
    """``abar [1000]`` float64 of ``DDPMScheduler()``, Allegro's training schedule."""
    return DDPMScheduler().alphas_cumprod.to(torch.float64)


def sigma_sampler(config: ModelConfig, keys: torch.Tensor, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform integer timesteps (``train.py``: ``torch.randint(0, 1000)``) as ``(sigma [B], t [B])``."""
    return vp_flow.integer_levels(schedule_abar(), keys, x0.device)


def loss_weight(config: ModelConfig, sigma: torch.Tensor) -> torch.Tensor:
    """The epsilon loss as a weight on the velocity loss: ``(1 - sigma)^2``."""
    return vp_flow.epsilon_loss_weight(sigma)


def sampling_sigmas(config: ModelConfig, num_steps: int) -> torch.Tensor:
    """The Euler scheduler's ``num_steps`` Karras sigmas ``k`` (linspace timesteps from 999) as flow levels
    ``k / (1 + k)`` ``[K]``."""
    euler = scheduler()
    euler.set_timesteps(num_steps)
    karras = euler.sigmas[:-1].to(torch.float64)
    return (karras / (1 + karras)).float()


# ------------------------------------------------------------------------------------------------------ the forward


def skeleton(config: ModelConfig) -> nn.Module:
    return skeleton_of(AllegroTransformer3DModel, config.spec.kwargs)


def rotary(config: ModelConfig, x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The RoPE tables and each token's (t, h, w) positions ``AllegroPipeline._prepare_rotary_positional_embeddings``
    makes for latents ``x [B, C, T, H, W]``."""
    k = config.spec.kwargs
    grid = (x.shape[3] // k["patch_size"], x.shape[4] // k["patch_size"])
    *tables, grid_t, grid_h, grid_w = get_3d_rotary_pos_embed_allegro(
        embed_dim=k["attention_head_dim"], crops_coords=((0, 0), grid), grid_size=grid, temporal_size=x.shape[2],
        interpolation_scale=(k["interpolation_scale_t"], k["interpolation_scale_h"], k["interpolation_scale_w"]),
        device=x.device)
    positions = torch.cartesian_prod(grid_t.long(), grid_h.long(), grid_w.long())
    return tuple(tables), tuple(positions.transpose(0, 1).reshape(3, 1, -1).contiguous())


def inputs(config: ModelConfig, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """The DiT's arguments: ``s x_t`` at the timestep of ``sigma = t / 1000``, the text and its mask, the RoPE."""
    sigma = t.float() / 1000
    return {"hidden_states": vp_flow.model_input(x, sigma), "encoder_hidden_states": cond["text"],
            "encoder_attention_mask": cond["text_mask"], "timestep": vp_flow.timestep_of(schedule_abar(), sigma),
            "image_rotary_emb": rotary(config, x), "return_dict": False}


def output(config: ModelConfig, out: Any, x: torch.Tensor, t: torch.Tensor,
           cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The DiT's noise prediction as the velocity (``fvx_models.vp_flow``)."""
    return vp_flow.velocity_of_epsilon(out[0], x, t.float() / 1000, schedule_abar())


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    return dim, {"blocks": (dim, 4 * dim)}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``AllegroPipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/`` (its
    Euler ancestral sampler); copy the VAE, T5 text encoder and tokenizer from the base model."""
    scheduler().save_config(folder / "scheduler")
    dfolder.write_model_index(folder, "AllegroPipeline", {
        "scheduler": ("diffusers", "EulerAncestralDiscreteScheduler"),
        "transformer": ("diffusers", "AllegroTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLAllegro"),
        "text_encoder": ("transformers", "T5EncoderModel"), "tokenizer": ("transformers", "T5Tokenizer")})


# ----------------------------------------------------------------------------------------------------- encoding


TEXT_LEN = 512


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """``AllegroPipeline.encode_prompt`` (T5 at 512 tokens, its caption cleaning) cut to each prompt's mask."""
    embeds, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, clean_caption=True,
                                            max_sequence_length=TEXT_LEN, device=pipe.text_encoder.device)
    return fencoders.real_tokens(embeds, mask)


def _tiled(vae: Any) -> Any:
    vae.enable_tiling()  # the Allegro VAE encodes and decodes only in tiles
    return vae


ENCODERS = fencoders.Encoders(
    pipeline="AllegroPipeline", text=("tokenizer", "text_encoder"), encode_text=encode_text,
    encode_video=lambda pipe, video: fencoders.latent_mean(_tiled(pipe.vae), video),
    decode_video=lambda pipe, latents: _tiled(pipe.vae).decode(latents).sample, frame_step=4, pixel_multiple=16,
    audio_refusal="Allegro makes no sound")
"""Allegro's encoders: T5 at 512 tokens (the real ones) and its VAE's posterior mean, in tiles."""


ALLEGRO_FAMILY = Family(
    name="allegro",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"blocks": ("transformer_blocks",)},
        # measured (saved-tensor hooks, bf16): 2.5 dim in fp32, 14.15 dim + 2 ffn in bf16
        activations={"blocks": memory.BlockActivations(fp32_dim=2.5, compute_dim=14.15, compute_ffn=2)},
        widths=widths,
        init_rules={"scale_shift_table": wan.scale_shift_init},
        self_attention=("transformer_blocks.*.attn1",),
    ),
    forward=Forward(inputs=inputs, output=output),
    conditioning=text_conditioning("caption_channels", "the T5 text embedding and its mask"),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(sigma_sampler=sigma_sampler, loss_weight=loss_weight, sampling_sigmas=sampling_sigmas),
)


class AllegroConfig(ModelConfig, tag="allegro"):
    """An Allegro DiT (presets: tiny, world, allegro), trained and sampled as a flow with its own noise levels,
    epsilon loss and Euler levels (module docstring); the shared knobs are :class:`fvx_models.build.ModelConfig`'s."""

    family = ALLEGRO_FAMILY
