"""Motif-Video (diffusers ``MotifVideoTransformer3DModel``): a dual- then single-stream flow DiT on the Wan 2.1 VAE's
latents, text-to-video.

Motif-Video predicts the flow velocity ``noise - x0`` at ``t = 1000 sigma`` (its pipeline steps it with
``FlowMatchEulerDiscreteScheduler``), so the output is taken as it is. Its input is the latents beside a first-frame
condition and its mask on channels, ``[x | condition | mask]`` (``in_channels = 2 C + 1``); text-to-video, as
``MotifVideoPipeline`` calls it, gives zeros for both. Its blocks attend over the text and video tokens together
(3-D RoPE on the video's; padded text keys masked). The text is the T5Gemma-2 encoder's last hidden state at 512
tokens and its mask; the data stores the real tokens, the reader pads and masks as the pipeline's padding is masked.
Latents are the Wan 2.1 VAE's, normalised by its statistics as the pipeline does.

Image-to-video (``first_frame``, ``data.kind=i2v``), as ``MotifVideoImage2VideoPipeline`` calls it: the condition is
the given first frame's latents (normalised) at frame 0 and zeros after, the mask one on frame 0; a model with an image
embedder (``image_embed_dim``) also reads SigLIP's features of the frame (the text encoder's vision tower) ahead of
the text. The loss covers every frame, as Wan's image-to-video fine-tuning does (Motif-Video's trainer is not public).
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, MotifVideoTransformer3DModel
from torch import nn

from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, encoders as fencoders, wan, wan_i2v
from fvx_models.build import ModelConfig
from fvx_models.family import (TEXT_MASK_DEFAULT, Architecture, Checkpoints, Conditioning, Family, Forward, Preset,
                               first_frame_from_batch, first_frame_spec, require, skeleton_of)

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
IMAGE = frozenset({"first_frame_latents", "image_embeds"})

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, wan.TINY_VAE, 8),
    # with an image embedder (SigLIP features 16 wide): image-to-video's second input
    "tiny-i2v": Preset({**TINY, "image_embed_dim": 16}, wan.TINY_VAE, 8),
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


def inputs(config: MotifVideoConfig, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """``MotifVideoPipeline``'s text-to-video call: ``x | zero condition | zero mask``, ``t = 1000 sigma``, the text
    and its mask; image-to-video, ``MotifVideoImage2VideoPipeline``'s: the first frame's condition and mask, and the
    image features when the model reads them."""
    batch, channels, frames, height, width = x.shape
    if not config.first_frame:
        hidden = torch.cat([x, x.new_zeros(batch, channels + 1, frames, height, width)], dim=1)
        extra = {}
    else:
        mask = x.new_zeros(batch, 1, frames, height, width)
        mask[:, :, 0] = 1
        hidden = torch.cat([x, wan_i2v.given_frames(x, cond, config.family.name).to(x.dtype), mask], dim=1)
        extra = {"image_embeds": cond["image_embeds"]} if "image_embeds" in cond else {}
    return {"hidden_states": hidden, "timestep": t, "encoder_hidden_states": cond["text"],
            "encoder_attention_mask": cond["text_mask"], "return_dict": False, **extra}


def cond_spec(config: MotifVideoConfig) -> dict[str, tuple]:
    """The text and its mask; image-to-video adds the first frame's latents and, for a model with an image embedder,
    its image features."""
    k = config.spec.kwargs
    spec = {"text": ("L", k["text_embed_dim"]), "text_mask": ("L",)}
    if config.first_frame:
        spec.update(first_frame_spec(config))
        if k["image_embed_dim"]:
            spec["image_embeds"] = ("N", k["image_embed_dim"])
    return spec


def cond_from_batch(config: MotifVideoConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    spec = cond_spec(config)
    require(batch, ("text", "text_mask"), config.family.name, "the T5Gemma-2 text embedding and its mask")
    if config.first_frame:
        first_frame_from_batch(config, batch)
    if "image_embeds" in spec:
        require(batch, ("image_embeds",), config.family.name, "the first frame's SigLIP features: parquet column "
                "clip_feature of data.kind='i2v' data")
    return {name: batch[name] for name in spec}


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


def encode_image(pipe: Any, frames: torch.Tensor) -> torch.Tensor:
    """SigLIP's last hidden state of the first frames ``[B, 3, H, W]`` in [0, 1], the text encoder's vision tower
    through the feature extractor, as ``MotifVideoImage2VideoPipeline`` makes it."""
    return pipe._get_image_embeds(pipe.text_encoder.vision_tower, pipe.feature_extractor, frames, frames.device)


ENCODERS = fencoders.Encoders(
    pipeline="MotifVideoPipeline", text=("tokenizer", "text_encoder"), encode_text=encode_text,
    encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video), frame_step=4, pixel_multiple=16,
    image=("text_encoder", "feature_extractor"), encode_image=encode_image, first_frame=wan.encode_first_frame,
    image_wanted=lambda config: bool(config.spec.kwargs["image_embed_dim"]), audio_refusal="Motif-Video makes no sound")
"""Motif-Video's encoders: T5Gemma-2 through the pipeline's prompt encoding, the Wan 2.1 VAE's posterior mean, the
image-to-video pipeline's normalised first frame and SigLIP features."""


MOTIF = Family(
    name="motif_video",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"blocks": ("transformer_blocks",), "single": ("single_transformer_blocks",)},
        # measured (saved-tensor hooks, bf16) per video token (the growth from 16 x 16 to 32 x 32 latents; the joint
        # sequence's text tokens left out, as the dry run counts video tokens): 4.19 dim in fp32 in both; the
        # dual-stream block 12.16 dim + 2 ffn in bf16, the single-stream one 10.09 dim + 2 ffn
        activations={"blocks": memory.BlockActivations(fp32_dim=4.19, compute_dim=12.16, compute_ffn=2),
                     "single": memory.BlockActivations(fp32_dim=4.19, compute_dim=10.09, compute_ffn=2)},
        widths=widths,
        self_attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
        vsa_refusal="its self-attention runs over the text tokens and the video's together",
    ),
    forward=Forward(inputs=inputs),
    conditioning=Conditioning(spec=cond_spec, from_batch=cond_from_batch, image=IMAGE,
                              data_keys=("text", "text_mask", *sorted(IMAGE)), defaults=TEXT_MASK_DEFAULT),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
)


class MotifVideoConfig(ModelConfig, tag="motif_video"):
    """A Motif-Video DiT (presets: tiny, tiny-i2v, world, motif-video); ``first_frame``: image-to-video, the given
    first frame in its condition channels (``data.kind=i2v``; module docstring); the shared knobs are
    :class:`fvx_models.build.ModelConfig`'s."""

    family = MOTIF

    first_frame: bool = False
