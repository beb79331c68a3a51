"""Mochi 1 (diffusers ``MochiTransformer3DModel``): an asymmetric joint-attention flow DiT, with its joint attention as
one masked call.

Mochi's clock runs the other way: its pipeline's ``FlowMatchEulerDiscreteScheduler`` has ``invert_sigmas``, so the DiT
is called at ``1000 (1 - sigma)`` and its output is ``x0 - noise`` (``x_next = x + ((1 - sigma') - (1 - sigma)) out``):
:func:`inputs` passes ``1000 - t`` and :func:`output` negates it into fvx's velocity ``noise - x0``.

Its joint attention (diffusers' ``MochiAttnProcessor2_0``) attends over the video tokens and each sample's valid text
tokens, gathered per sample with ``nonzero``: shapes that depend on the data, which no graph compiles.
:class:`MaskedJointAttention` computes the same as one attention call over all tokens with the padded text keys masked
out, and zeroes the padded text queries' outputs as that processor's padding does (its outputs put the valid tokens
first: T5 pads on the right), through diffusers' dispatcher, so fvx's attention kernels route it.

Conditioning: T5-XXL at 256 tokens and its mask (the DiT reads the mask: the stored rows are the real tokens). Latents:
the Mochi VAE's 12 channels (6 x 8 x 8), normalised by its statistics as the pipeline does.
"""
from __future__ import annotations

import inspect
import pathlib
from typing import Any, Mapping

import torch
from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiTransformer3DModel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from torch import nn

from fvx.core import random
from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, encoders as fencoders, wan
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Family, Forward, Preset, skeleton_of,
                               text_conditioning)
from fvx_models.model import LatentSpace

_VAE = {name: p.default for name, p in inspect.signature(AutoencoderKLMochi.__init__).parameters.items()}
MOCHI_VAE = LatentSpace(12, tuple(_VAE["latents_mean"]), tuple(_VAE["latents_std"]), vae_stride=(6, 8, 8),
                        vae="Mochi")  # AutoencoderKLMochi's statistics (scaling factor 1), as the pipeline normalises
TINY_VAE = LatentSpace(12, (0.0,) * 12, (1.0,) * 12, vae_stride=(6, 8, 8), vae="tiny Mochi")

_MOCHI = dict(patch_size=2, num_attention_heads=24, attention_head_dim=128, num_layers=48, pooled_projection_dim=1536,
              in_channels=12, out_channels=None, qk_norm="rms_norm", text_embed_dim=4096, time_embed_dim=256,
              activation_fn="swiglu", max_sequence_length=256)
MOCHI_1 = _MOCHI
TINY = {**_MOCHI, "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2, "pooled_projection_dim": 16,
        "text_embed_dim": 32, "time_embed_dim": 16, "max_sequence_length": 8}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, TINY_VAE, 8),
    # the toy world's (192-channel space-to-depth latents, patch 1, 4 text tokens)
    "world": Preset({**TINY, "patch_size": 1, "in_channels": 192, "num_attention_heads": 4, "attention_head_dim": 64,
                     "pooled_projection_dim": 64, "num_layers": 3, "max_sequence_length": 4}, wan.WORLD_CODEC, 4),
    # genmo/mochi-1-preview (diffusers' convert_mochi_to_diffusers.py; MochiTransformer3DModel's defaults)
    "mochi-1": Preset(MOCHI_1, MOCHI_VAE, 256),
}
"""``MochiTransformer3DModel`` constructor arguments per preset, the latent space and the text length (T5 at 256)."""


# ---------------------------------------------------------------------------------------------- the joint attention


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Mochi's RoPE on interleaved pairs of ``x [B, N, H, D]`` (``cos``, ``sin`` ``[N, H, D / 2]``), in fp32."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(x.dtype)


class MaskedJointAttention:
    """``MochiAttnProcessor2_0`` as one masked attention call (module docstring): projections, norms and RoPE as
    there, then attention over ``[video | text]`` with the padded text keys masked, the padded text queries' outputs
    zero."""

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 attention_mask: torch.Tensor, image_rotary_emb: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        def heads(x: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
            x = x.unflatten(2, (attn.heads, -1))
            return x if norm is None else norm(x)

        query, key = heads(attn.to_q(hidden_states), attn.norm_q), heads(attn.to_k(hidden_states), attn.norm_k)
        value = heads(attn.to_v(hidden_states), None)
        text_query = heads(attn.add_q_proj(encoder_hidden_states), attn.norm_added_q)
        text_key = heads(attn.add_k_proj(encoder_hidden_states), attn.norm_added_k)
        text_value = heads(attn.add_v_proj(encoder_hidden_states), None)
        if image_rotary_emb is not None:
            query, key = rotated(query, *image_rotary_emb), rotated(key, *image_rotary_emb)

        video_tokens, text_tokens = query.shape[1], text_query.shape[1]
        valid = attention_mask.bool()
        keep = torch.cat([valid.new_ones(valid.shape[0], video_tokens), valid], dim=1)[:, None, None, :]
        out = dispatch_attention_fn(torch.cat([query, text_query], dim=1), torch.cat([key, text_key], dim=1),
                                    torch.cat([value, text_value], dim=1), attn_mask=keep)
        video, text = out.flatten(2, 3).split_with_sizes((video_tokens, text_tokens), dim=1)
        text = text * valid[..., None].to(text.dtype)
        video = attn.to_out[1](attn.to_out[0](video))
        if hasattr(attn, "to_add_out"):
            text = attn.to_add_out(text)
        return video, text


def mixed_rope_init(key: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Mochi's learned RoPE frequencies ``[3, heads, D / 2]`` (time, height, width) for a model drawn from keys:
    RoPE-Mixed's init (Heo et al., 2024), each pair's standard magnitude ``10000^(-2 j / D)`` in a random direction of
    the three axes. diffusers initialises zeros (no position signal at all), which a loaded checkpoint replaces; a
    model trained from scratch needs positions."""
    axes, heads, pairs = shape
    direction = random.normal(key, (axes, heads, pairs))
    magnitude = 10000.0 ** (-torch.arange(pairs, dtype=torch.float32) / pairs)
    return direction / direction.norm(dim=0, keepdim=True) * magnitude


def skeleton(config: ModelConfig) -> nn.Module:
    """diffusers' Mochi on meta, each block's attention through :class:`MaskedJointAttention`."""
    module = skeleton_of(MochiTransformer3DModel, config.spec.kwargs)
    for block in module.transformer_blocks:
        block.attn1.processor = MaskedJointAttention()
    return module


# ------------------------------------------------------------------------------------------------------ the forward


def inputs(config: ModelConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """As ``MochiPipeline`` calls the DiT: latents, the text and its mask, the inverted timestep ``1000 - t``."""
    return {"hidden_states": x_t, "encoder_hidden_states": cond["text"], "encoder_attention_mask": cond["text_mask"],
            "timestep": 1000 - t, "return_dict": False}


def output(config: ModelConfig, out: Any, x: torch.Tensor, t: torch.Tensor,
           cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mochi's ``x0 - noise`` as fvx's velocity ``noise - x0``."""
    return -out[0]


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    return dim, {"blocks": (dim, 4 * dim)}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``MochiPipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/`` (its
    inverted-sigma flow scheduler); copy the VAE, T5 text encoder and tokenizer from the base model."""
    FlowMatchEulerDiscreteScheduler(invert_sigmas=True).save_config(folder / "scheduler")
    dfolder.write_model_index(folder, "MochiPipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "transformer": ("diffusers", "MochiTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLMochi"),
        "text_encoder": ("transformers", "T5EncoderModel"), "tokenizer": ("transformers", "T5Tokenizer")},
        force_zeros_for_empty_prompt=False)


# ----------------------------------------------------------------------------------------------------- encoding


TEXT_LEN = 256


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """T5's last hidden state at 256 tokens under its mask (``MochiPipeline._get_t5_prompt_embeds``), the real
    tokens."""
    embeds, mask = pipe._get_t5_prompt_embeds(prompts, max_sequence_length=TEXT_LEN, device=pipe.text_encoder.device)
    return fencoders.real_tokens(embeds, mask)


ENCODERS = fencoders.Encoders(
    pipeline="MochiPipeline", text=("tokenizer", "text_encoder"), encode_text=encode_text,
    encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video), frame_step=6, pixel_multiple=16,
    audio_refusal="Mochi makes no sound")
"""Mochi's encoders: T5 at 256 tokens (the real ones), the Mochi VAE's posterior mean (6 frames a latent frame)."""


MOCHI = Family(
    name="mochi",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"blocks": ("transformer_blocks",)},
        # measured (saved-tensor hooks, bf16): 12.5 dim in fp32, 12 dim and 2 ffn in bf16 per token
        activations={"blocks": memory.BlockActivations(fp32_dim=12.5, compute_dim=12, compute_ffn=2)},
        widths=widths,
        init_rules={"pos_frequencies": mixed_rope_init},
        vsa_refusal="its attention runs over the text tokens and the video's together",
    ),
    forward=Forward(inputs=inputs, output=output),
    conditioning=text_conditioning("text_embed_dim", "the T5 text embedding and its mask"),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
)


class MochiConfig(ModelConfig, tag="mochi"):
    """A Mochi 1 DiT (presets: tiny, world, mochi-1); the shared knobs are :class:`fvx_models.build.ModelConfig`'s."""

    family = MOCHI
