"""Latte (diffusers ``LatteTransformer3DModel``): an epsilon-prediction DDPM family, trained and sampled as a flow.

Latte alternates spatial blocks (each frame's tokens, cross-attending to the T5 text) and temporal blocks (each
position's frames) over Stable Diffusion's image-VAE latents, one latent per frame. It predicts the noise on the
linear DDPM schedule its pipeline samples with (``DDIMScheduler``, betas 0.0001 to 0.02 over 1000 steps: Latte's
``configs/t2x/t2v_sample.yaml``), and a learned variance in its second half of channels, which DDIM does not read.
fvx runs it as a flow (``fvx_models.vp_flow``): the DiT gets ``s x_t`` at the timestep of ``sigma`` and its first
half is read back as the velocity ``s (eps - x_t) / a``.

Its own rules: uniform integer training timesteps, the epsilon loss (``(1 - sigma)^2`` on the velocity loss), and
the DDIM scheduler's timesteps as ``validation.schedule=model``'s levels. Latte's own trainer adds a variational
bound for the variance half (IDDPM's ``learn_sigma``); fvx trains the mean only, so that half's rows of ``proj_out``
keep their values but for weight decay.

Inputs as ``LattePipeline`` passes them: latents ``[B, C, T, H, W]``, the integer-spaced timestep, the text. For one
prompt the pipeline cuts the embedding to its real tokens (``mask_feature``); fvx stores those and masks the reader's
padding out of the spatial cross-attention with a -10000 bias per frame, so a batch attends as one prompt does.
Its temporal positions are a fixed table of ``video_length`` frames: a clip has exactly that many (or one).
"""
from __future__ import annotations

import functools
import pathlib
from typing import Any, Mapping

import torch
from diffusers import DDIMScheduler, LatteTransformer3DModel
from diffusers.models.embeddings import get_1d_sincos_pos_embed_from_grid, get_2d_sincos_pos_embed
from torch import nn

from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, encoders as fencoders, vp_flow, wan
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Family, Forward, Preset, Training, skeleton_of,
                               text_conditioning)
from fvx_models.model import LatentSpace

SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                 clip_sample=False, prediction_type="epsilon")
"""Latte's sampling scheduler (``configs/t2x/t2v_sample.yaml``: DDIM on linear betas 0.0001 to 0.02), diffusers'
``DDIMScheduler`` defaults otherwise."""

# Latte-1's transformer (maxin-cn/Latte-1, on PixArt-alpha's 1152-wide layout; a folder's config.json is checked
# against it on load)
LATTE_1 = dict(
    num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28, dropout=0.0,
    cross_attention_dim=1152, attention_bias=True, sample_size=64, patch_size=2, activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
    caption_channels=4096, video_length=16,
)
TINY = {**LATTE_1, "num_attention_heads": 2, "attention_head_dim": 16, "cross_attention_dim": 32, "num_layers": 2,
        "sample_size": 8, "caption_channels": 32, "in_channels": 16, "out_channels": 32, "video_length": 2}

SD_VAE = LatentSpace(4, scale=0.18215, vae_stride=(1, 8, 8), vae="Stable Diffusion's image VAE, frame by frame")
TINY_VAE = LatentSpace(16, vae_stride=(1, 8, 8), vae="tiny image VAE, frame by frame")

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, TINY_VAE, 8),
    # the toy world's at space-to-depth 4 (48 channels a token, 4 x 4 tokens a frame, patch 1; its 4 frames, 4 text
    # tokens): an epsilon model reads its noise prediction through 1 / a, and 192-channel tokens through a 256-wide
    # stream and a LayerNorm head leave it too coarse to sample from scratch
    "world": Preset({**TINY, "num_attention_heads": 4, "attention_head_dim": 64, "cross_attention_dim": 256,
                     "num_layers": 3, "in_channels": 48, "out_channels": 96, "patch_size": 1, "sample_size": 4,
                     "video_length": 4}, wan.WORLD_CODEC_4, 4),
    "latte-1": Preset(LATTE_1, SD_VAE, 120),
}
"""``LatteTransformer3DModel`` constructor arguments per preset, the latent space and the text length (T5 at 120)."""


# ------------------------------------------------------------------------------------------------ the flow's clock


def scheduler() -> DDIMScheduler:
    """A fresh ``DDIMScheduler`` of Latte's sampling."""
    return DDIMScheduler(**SCHEDULER)


@functools.lru_cache(maxsize=None)
def schedule_abar() -> torch.Tensor:
    """``abar [1000]`` float64 of Latte's linear schedule."""
    return scheduler().alphas_cumprod.to(torch.float64)


def sigma_sampler(config: ModelConfig, keys: torch.Tensor, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform integer timesteps (Latte's ``train.py``: ``torch.randint(0, 1000)``) as ``(sigma [B], t [B])``."""
    return vp_flow.integer_levels(schedule_abar(), keys, x0.device)


def loss_weight(config: ModelConfig, sigma: torch.Tensor) -> torch.Tensor:
    """The epsilon loss as a weight on the velocity loss: ``(1 - sigma)^2``."""
    return vp_flow.epsilon_loss_weight(sigma)


def sampling_sigmas(config: ModelConfig, num_steps: int) -> torch.Tensor:
    """The DDIM scheduler's ``num_steps`` timesteps (leading spacing) as levels ``[K]``: Euler on them is its DDIM
    step, from noise at the first (the pipeline's VP noise is ``s`` times the flow's there)."""
    ddim = scheduler()
    ddim.set_timesteps(num_steps)
    return vp_flow.scheduler_levels(schedule_abar(), ddim.timesteps)


def latent_rule(config: ModelConfig, shape: tuple[int, ...]) -> str | None:
    frames = config.spec.kwargs["video_length"]
    if shape[2] not in (1, frames):
        return (f"its temporal positions are a table of video_length={frames} latent frames: a clip has {frames} "
                f"(or 1), got {shape[2]}")
    return None


# ------------------------------------------------------------------------------------------------------ the forward


def rebuild_positions(module: nn.Module) -> None:
    """The sine-cosine position tables (pure functions of the config), on the CPU, as diffusers makes them."""
    k, embed = module.config, module.pos_embed
    grid = k.sample_size // k.patch_size
    spatial = get_2d_sincos_pos_embed(embed.proj.out_channels, grid, base_size=embed.base_size,
                                      interpolation_scale=embed.interpolation_scale, output_type="pt")
    embed.register_buffer("pos_embed", spatial.float().unsqueeze(0), persistent=False)
    temporal = get_1d_sincos_pos_embed_from_grid(embed.proj.out_channels, torch.arange(0, k.video_length)[:, None],
                                                 output_type="pt")
    module.register_buffer("temp_pos_embed", temporal.float().unsqueeze(0), persistent=False)


def skeleton(config: ModelConfig) -> nn.Module:
    return skeleton_of(LatteTransformer3DModel, config.spec.kwargs, rebuild_positions)


def inputs(config: ModelConfig, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """The DiT's arguments: ``s x_t`` at the timestep of ``sigma = t / 1000``, the text, and its padding as a -10000
    cross-attention bias ``[B T, 1, L]`` (the spatial blocks run frame by frame)."""
    sigma = t.float() / 1000
    text, mask = cond["text"], cond["text_mask"]
    bias = ((1 - mask.to(text.dtype)) * -10000.0).repeat_interleave(x.shape[2], dim=0)[:, None]
    return {"hidden_states": vp_flow.model_input(x, sigma), "encoder_hidden_states": text,
            "encoder_attention_mask": bias, "timestep": vp_flow.timestep_of(schedule_abar(), sigma),
            "return_dict": False}


def output(config: ModelConfig, out: Any, x: torch.Tensor, t: torch.Tensor,
           cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The first half of the DiT's channels (epsilon; the second is the learned variance) as the velocity."""
    eps = out[0][:, :x.shape[1]]
    return vp_flow.velocity_of_epsilon(eps, x, t.float() / 1000, schedule_abar())


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    return dim, {"blocks": (dim, 4 * dim), "temporal": (dim, 4 * dim)}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``LattePipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/`` (DDIM on
    Latte's betas); copy the VAE, T5 text encoder and tokenizer from the base model."""
    scheduler().save_config(folder / "scheduler")
    dfolder.write_model_index(folder, "LattePipeline", {
        "scheduler": ("diffusers", "DDIMScheduler"), "transformer": ("diffusers", "LatteTransformer3DModel"),
        "vae": ("diffusers", "AutoencoderKL"), "text_encoder": ("transformers", "T5EncoderModel"),
        "tokenizer": ("transformers", "T5Tokenizer")})


# ----------------------------------------------------------------------------------------------------- encoding


TEXT_LEN = 120


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """``LattePipeline.encode_prompt`` one prompt at a time, as its ``__call__`` encodes one (T5 at 120 tokens, its
    caption cleaning, ``mask_feature``: the embedding cut to the real tokens)."""
    return [pipe.encode_prompt(prompt, do_classifier_free_guidance=False, clean_caption=True,
                               device=pipe.text_encoder.device)[0][0] for prompt in prompts]


def encode_frames(pipe: Any, video: torch.Tensor) -> torch.Tensor:
    """The image VAE's posterior mean of each frame of ``video [B, 3, T, H, W]``: ``[B, C, T, h, w]``."""
    mean = fencoders.latent_mean(pipe.vae, video.permute(0, 2, 1, 3, 4).flatten(0, 1))
    return mean.unflatten(0, (video.shape[0], video.shape[2])).permute(0, 2, 1, 3, 4)


def decode_frames(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    """Each latent frame decoded by the image VAE, as ``LattePipeline.decode_latents``: ``[B, 3, T, H, W]``."""
    frames = pipe.vae.decode(latents.permute(0, 2, 1, 3, 4).flatten(0, 1)).sample
    return frames.unflatten(0, (latents.shape[0], latents.shape[2])).permute(0, 2, 1, 3, 4)


ENCODERS = fencoders.Encoders(
    pipeline="LattePipeline", text=("tokenizer", "text_encoder"), encode_text=encode_text, encode_video=encode_frames,
    decode_video=decode_frames, frame_step=1, pixel_multiple=16, audio_refusal="Latte makes no sound")
"""Latte's encoders: T5 at 120 tokens (the real ones) and the image VAE's posterior mean frame by frame."""


LATTE = Family(
    name="latte",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"blocks": ("transformer_blocks",), "temporal": ("temporal_transformer_blocks",)},
        # measured (saved-tensor hooks, bf16, 128 tokens a frame): the spatial block 1.8 dim in fp32, 13.25 dim + 2 ffn
        # in bf16; the temporal block 15.1 dim + 2 ffn
        activations={"blocks": memory.BlockActivations(fp32_dim=1.8, compute_dim=13.25, compute_ffn=2),
                     "temporal": memory.BlockActivations(fp32_dim=0.06, compute_dim=15.1, compute_ffn=2)},
        widths=widths,
        init_rules={"scale_shift_table": wan.scale_shift_init},
        self_attention=("transformer_blocks.*.attn1", "temporal_transformer_blocks.*.attn1"),
        vsa_refusal="its attention runs within each frame and along each position's frames, not over the video grid",
    ),
    forward=Forward(inputs=inputs, output=output),
    conditioning=text_conditioning("caption_channels", "the T5 text embedding and its mask"),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(sigma_sampler=sigma_sampler, loss_weight=loss_weight, sampling_sigmas=sampling_sigmas,
                      latent_rule=latent_rule),
)


class LatteConfig(ModelConfig, tag="latte"):
    """A Latte DiT (presets: tiny, world, latte-1), trained and sampled as a flow with its own noise levels, epsilon
    loss and DDIM levels (module docstring); the shared knobs are :class:`fvx_models.build.ModelConfig`'s."""

    family = LATTE
