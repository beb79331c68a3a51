"""EasyAnimate V5.1 (diffusers ``EasyAnimateTransformer3DModel``): an MMDiT flow model on the Magvit VAE's latents.

EasyAnimate V5.1 predicts the flow velocity ``noise - x0`` at ``t = 1000 sigma`` (its pipeline's
``FlowMatchEulerDiscreteScheduler``; aigc-apps/EasyAnimate's ``scripts/train.py`` with ``loss_type="flow"`` noises
``(1 - sigma) x0 + sigma noise`` and regresses ``noise - latents``), so the output is taken as it is. Its blocks run
one attention over the text and video tokens together (3-D RoPE on the video's), the text through an RMSNorm and a
projection (``add_norm_text_encoder``, V5.1's).

Text: ``EasyAnimatePipeline.encode_prompt``: Qwen2-VL's second-to-last hidden state of the chat-templated prompt at
256 tokens, padded on the right. The pipeline passes the DiT all 256 rows without a mask (the padding's too), so the
data stores every row, as CogVideoX's does. Latents are the Magvit VAE's (4 x 8 x 8), scaled by its
``scaling_factor``.
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

import torch
from diffusers import EasyAnimateTransformer3DModel, FlowMatchEulerDiscreteScheduler
from torch import nn

from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, encoders as fencoders, wan
from fvx_models.build import ModelConfig
from fvx_models.family import Architecture, Checkpoints, Family, Forward, Preset, skeleton_of, text_conditioning
from fvx_models.model import LatentSpace

# alibaba-pai/EasyAnimateV5.1-12b-zh-diffusers (text-to-video): diffusers' EasyAnimateTransformer3DModel defaults
# with V5.1's normed text projection and 16 latent channels in and out; a folder's config.json is checked against it
EASYANIMATE_V51_12B = dict(
    num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, patch_size=2, sample_width=90,
    sample_height=60, activation_fn="gelu-approximate", timestep_activation_fn="silu", freq_shift=0, num_layers=48,
    mmdit_layers=48, dropout=0.0, time_embed_dim=512, add_norm_text_encoder=True, text_embed_dim=3584,
    text_embed_dim_t5=None, norm_eps=1e-5, norm_elementwise_affine=True, flip_sin_to_cos=True,
    time_position_encoding_type="3d_rope", after_norm=False, resize_inpaint_mask_directly=True,
    enable_text_attention_mask=True, add_noise_in_inpaint_model=True,
)
TINY = {**EASYANIMATE_V51_12B, "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2, "mmdit_layers": 2,
        "time_embed_dim": 32, "text_embed_dim": 32, "sample_width": 8, "sample_height": 8}

MAGVIT_VAE = LatentSpace(16, scale=0.7125, vae_stride=(4, 8, 8), vae="EasyAnimate Magvit")

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, wan.TINY_VAE, 8),
    # the toy world's (192-channel space-to-depth latents, patch 1, 4 text tokens)
    "world": Preset({**TINY, "num_attention_heads": 4, "attention_head_dim": 64, "in_channels": 192,
                     "out_channels": 192, "patch_size": 1, "num_layers": 3, "mmdit_layers": 3, "sample_width": 4,
                     "sample_height": 4}, wan.WORLD_CODEC, 4),
    "easyanimate-v5.1-12b": Preset(EASYANIMATE_V51_12B, MAGVIT_VAE, 256),
}
"""``EasyAnimateTransformer3DModel`` constructor arguments per preset, the latent space and the text length (the
pipeline's 256 Qwen2-VL rows)."""


def skeleton(config: ModelConfig) -> nn.Module:
    return skeleton_of(EasyAnimateTransformer3DModel, config.spec.kwargs)


def inputs(config: ModelConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """As ``EasyAnimatePipeline`` calls the DiT: latents, ``t = 1000 sigma``, the text rows as stored (no mask)."""
    return {"hidden_states": x_t, "timestep": t, "encoder_hidden_states": cond["text"], "return_dict": False}


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    return dim, {"blocks": (dim, 4 * dim)}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``EasyAnimatePipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/`` (flow
    matching Euler); copy the Magvit VAE, Qwen2-VL and its tokenizer from the base model."""
    FlowMatchEulerDiscreteScheduler().save_config(folder / "scheduler")
    dfolder.write_model_index(folder, "EasyAnimatePipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "transformer": ("diffusers", "EasyAnimateTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLMagvit"),
        "text_encoder": ("transformers", "Qwen2VLForConditionalGeneration"),
        "tokenizer": ("transformers", "Qwen2Tokenizer")})


# ----------------------------------------------------------------------------------------------------- encoding


TEXT_LEN = 256


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """``EasyAnimatePipeline.encode_prompt`` at 256 tokens, every row: the DiT attends to the padding too."""
    embeds, _, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=TEXT_LEN,
                                         device=pipe.text_encoder.device)
    return list(embeds)


ENCODERS = fencoders.Encoders(
    pipeline="EasyAnimatePipeline", text=("tokenizer", "text_encoder"), encode_text=encode_text,
    encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video), frame_step=4, pixel_multiple=16,
    audio_refusal="EasyAnimate makes no sound")
"""EasyAnimate's encoders: Qwen2-VL through the pipeline's prompt encoding (all 256 rows) and the Magvit VAE's
posterior mean in its own scale (the preset's ``scaling_factor`` scales it into the DiT's input)."""


EASYANIMATE = Family(
    name="easyanimate",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"blocks": ("transformer_blocks",)},
        # measured (saved-tensor hooks, bf16), per video token (the growth from 16 x 16 to 32 x 32 latents; the text
        # tokens the joint sequence also carries are left out, as the dry run counts video tokens): 2.19 dim in fp32,
        # 13.25 dim + 2 ffn in bf16
        activations={"blocks": memory.BlockActivations(fp32_dim=2.19, compute_dim=13.25, compute_ffn=2)},
        widths=widths,
        self_attention=("transformer_blocks.*.attn1",),
        vsa_refusal="its self-attention runs over the text tokens and the video's together",
    ),
    forward=Forward(inputs=inputs),
    conditioning=text_conditioning("text_embed_dim", "the Qwen2-VL text embedding of all 256 rows and its mask"),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
)


class EasyAnimateConfig(ModelConfig, tag="easyanimate"):
    """An EasyAnimate V5.1 DiT (presets: tiny, world, easyanimate-v5.1-12b); the shared knobs are
    :class:`fvx_models.build.ModelConfig`'s."""

    family = EASYANIMATE
