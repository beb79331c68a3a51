"""Motif-Video (diffusers ``MotifVideoTransformer3DModel``): a dual- then single-stream flow DiT on the Wan 2.1 VAE's
latents, text-to-video.

Motif-Video predicts the flow velocity ``noise - x0`` at ``t = 1000 sigma`` (its pipeline steps it with
``FlowMatchEulerDiscreteScheduler``), so the output is taken as it is. Its input is the latents beside a first-frame
condition and its mask on channels, ``[x | condition | mask]`` (``in_channels = 2 C + 1``); text-to-video, as
``MotifVideoPipeline`` calls it, gives zeros for both. Its blocks attend over the text and video tokens together
(3-D RoPE on the video's; padded text keys masked). The text is the T5Gemma-2 encoder's last hidden state at 512
tokens and its mask; the data stores the real tokens, the reader pads and masks as the pipeline's padding is masked.
Latents are the Wan 2.1 VAE's, normalised by its statistics as the pipeline does.
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, MotifVideoTransformer3DModel
from torch import nn

from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, encoders as fencoders, wan
from fvx_models.build import ModelConfig
from fvx_models.family import Architecture, Checkpoints, Family, Forward, Preset, skeleton_of, text_conditioning

# diffusers' MotifVideoTransformer3DModel defaults: the released text-to-video layout (20 dual- and 40 single-stream
# blocks of 24 heads of 128 over T5Gemma-2's 4096-wide text); a folder's config.json is checked against it
MOTIF_VIDEO = dict(
    in_channels=33, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
    num_single_layers=40, num_decoder_layers=0, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
    norm_type="layer_norm", text_embed_dim=4096, image_embed_dim=None, rope_theta=256.0, rope_axes_dim=(16, 56, 56),
    enable_text_cross_attention_dual=False, enable_text_cross_attention_single=False,
)
TINY = {**MOTIF_VIDEO, "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 1, "num_single_layers": 1,
        "text_embed_dim": 32, "rope_axes_dim": (4, 6, 6)}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, wan.TINY_VAE, 8),
    # the toy world's (192-channel space-to-depth latents, patch 1, 4 text tokens)
    "world": Preset({**TINY, "in_channels": 2 * 192 + 1, "out_channels": 192, "patch_size": 1,
                     "num_attention_heads": 4, "attention_head_dim": 64, "num_layers": 2, "num_single_layers": 2,
                     "rope_axes_dim": (16, 24, 24)}, wan.WORLD_CODEC, 4),
    "motif-video": Preset(MOTIF_VIDEO, wan.WAN21_VAE, 512),
}
"""``MotifVideoTransformer3DModel`` constructor arguments per preset, the latent space (the Wan 2.1 VAE's) and the
text length (T5Gemma-2 at 512)."""


def skeleton(config: ModelConfig) -> nn.Module:
    return skeleton_of(MotifVideoTransformer3DModel, config.spec.kwargs)


def inputs(config: ModelConfig, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """``MotifVideoPipeline``'s text-to-video call: ``x | zero condition | zero mask``, ``t = 1000 sigma``, the text
    and its mask."""
    batch, channels, frames, height, width = x.shape
    hidden = torch.cat([x, x.new_zeros(batch, channels + 1, frames, height, width)], dim=1)
    return {"hidden_states": hidden, "timestep": t, "encoder_hidden_states": cond["text"],
            "encoder_attention_mask": cond["text_mask"], "return_dict": False}


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    ffn = int(dim * k["mlp_ratio"])
    return dim, {"blocks": (dim, ffn), "single": (dim, ffn)}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``MotifVideoPipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/``
    (flow matching Euler with its resolution-dependent shift); copy the Wan VAE, T5Gemma-2, its tokenizer and the
    guider from the base model."""
    FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True).save_config(folder / "scheduler")
    dfolder.write_model_index(folder, "MotifVideoPipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "transformer": ("diffusers", "MotifVideoTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLWan"),
        "text_encoder": ("transformers", "T5Gemma2Encoder"), "tokenizer": ("transformers", "GemmaTokenizerFast")})


# ----------------------------------------------------------------------------------------------------- encoding


TEXT_LEN = 512


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """``MotifVideoPipeline.encode_prompt`` (T5Gemma-2 at 512 tokens) cut to each prompt's mask."""
    embeds, _, mask, _ = pipe.encode_prompt(prompts, max_sequence_length=TEXT_LEN, device=pipe.text_encoder.device)
    return fencoders.real_tokens(embeds, mask)


ENCODERS = fencoders.Encoders(
    pipeline="MotifVideoPipeline", text=("tokenizer", "text_encoder"), encode_text=encode_text,
    encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video), frame_step=4, pixel_multiple=16,
    audio_refusal="Motif-Video makes no sound")
"""Motif-Video's encoders: T5Gemma-2 through the pipeline's prompt encoding, the Wan 2.1 VAE's posterior mean."""


MOTIF = Family(
    name="motif_video",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"blocks": ("transformer_blocks",), "single": ("single_transformer_blocks",)},
        # measured (saved-tensor hooks, bf16) per token, text included: 4.45 dim in fp32 in both; the dual-stream block
        # 13.56 dim + 2 ffn in bf16, the single-stream one 11.26 dim + 2 ffn
        activations={"blocks": memory.BlockActivations(fp32_dim=4.45, compute_dim=13.56, compute_ffn=2),
                     "single": memory.BlockActivations(fp32_dim=4.45, compute_dim=11.26, compute_ffn=2)},
        widths=widths,
        self_attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
        vsa_refusal="its self-attention runs over the text tokens and the video's together",
    ),
    forward=Forward(inputs=inputs),
    conditioning=text_conditioning("text_embed_dim", "the T5Gemma-2 text embedding and its mask"),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
)


class MotifVideoConfig(ModelConfig, tag="motif_video"):
    """A Motif-Video DiT, text-to-video (presets: tiny, world, motif-video); the shared knobs are
    :class:`fvx_models.build.ModelConfig`'s."""

    family = MOTIF
