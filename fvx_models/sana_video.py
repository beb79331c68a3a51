"""SANA-Video (diffusers ``SanaVideoTransformer3DModel``): a linear-attention flow DiT on the Wan 2.1 VAE's latents.

SANA-Video predicts the flow velocity ``noise - x0`` at ``t = 1000 sigma``, as its pipeline's scheduler reads it
(``DPMSolverMultistepScheduler`` with ``prediction_type="flow_prediction"`` and flow sigmas: ``x0 = x - sigma v``), so
the output is taken as it is. Its self-attention is linear (ReLU kernels, ``SanaLinearAttnProcessor3_0``), its
feed-forward a gated convolution over the token grid with a temporal convolution, and its cross-attention reads the
Gemma-2 text through a padding mask (``encoder_attention_mask``; masked tokens get a -10000 bias, so their rows do not
matter: the data stores the real ones, the reader pads with zeros).

Text: ``SanaVideoPipeline.encode_prompt`` with the pipeline's complex human instruction (prepended to the prompt) and
300 tokens: Gemma-2's last hidden state of the first token and the last 299, and their mask; the stored rows are the
unmasked ones in order. Latents are the Wan 2.1 VAE's (normalised by its statistics, as the pipeline does).
"""
from __future__ import annotations

import inspect
import pathlib
from typing import Any, Mapping

import torch
from diffusers import DPMSolverMultistepScheduler, SanaVideoPipeline, SanaVideoTransformer3DModel
from torch import nn

from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, encoders as fencoders, wan
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Family, Forward, Preset, skeleton_of,
                               text_conditioning)

_SANA_VIDEO = dict(
    in_channels=16, out_channels=16, num_attention_heads=20, attention_head_dim=112, num_layers=20,
    num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240, caption_channels=2304,
    mlp_ratio=3.0, dropout=0.0, attention_bias=False, sample_size=30, patch_size=(1, 2, 2),
    norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None, guidance_embeds=False,
    guidance_embeds_scale=0.1, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
)
SANA_VIDEO_2B_480P = _SANA_VIDEO
TINY = {**_SANA_VIDEO, "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2,
        "num_cross_attention_heads": 2, "cross_attention_head_dim": 16, "cross_attention_dim": 32,
        "caption_channels": 32, "mlp_ratio": 2.0, "sample_size": 8, "rope_max_seq_len": 32}
FLOW_SHIFT = 8.0  # diffusers' convert_sana_video_to_diffusers.py: the released pipeline's scheduler

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, wan.TINY_VAE, 8, {"flow_shift": 3.0}),
    # the toy world's (192-channel space-to-depth latents, patch 1, 4 text tokens)
    "world": Preset({**TINY, "in_channels": 192, "out_channels": 192, "patch_size": (1, 1, 1),
                     "num_attention_heads": 4, "attention_head_dim": 64, "num_cross_attention_heads": 4,
                     "cross_attention_head_dim": 64, "cross_attention_dim": 256, "num_layers": 3, "sample_size": 4},
                    wan.WORLD_CODEC, 4, {"flow_shift": 3.0}),
    # Efficient-Large-Model/SANA-Video_2B_480p_diffusers (diffusers' convert_sana_video_to_diffusers.py, 480p)
    "sana-video-2b-480p": Preset(SANA_VIDEO_2B_480P, wan.WAN21_VAE, 300, {"flow_shift": FLOW_SHIFT}),
}
"""``SanaVideoTransformer3DModel`` constructor arguments per preset, the latent space (the Wan 2.1 VAE's), the text
length (the 300 tokens the pipeline keeps) and its pipeline's flow shift."""


def skeleton(config: ModelConfig) -> nn.Module:
    return skeleton_of(SanaVideoTransformer3DModel, config.spec.kwargs, wan.rebuild_rope)


def inputs(config: ModelConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """As ``SanaVideoPipeline`` calls the DiT: latents, the text and its mask, ``t = 1000 sigma``."""
    return {"hidden_states": x_t, "encoder_hidden_states": cond["text"], "encoder_attention_mask": cond["text_mask"],
            "timestep": t, "return_dict": False}


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim = k["num_attention_heads"] * k["attention_head_dim"]
    return dim, {"blocks": (dim, int(dim * k["mlp_ratio"]) * 2)}  # the gated conv's inverted width is doubled


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``SanaVideoPipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/`` (the
    released flow-DPM-solver at the preset's shift); copy the Wan VAE, Gemma-2 and its tokenizer from the base model."""
    DPMSolverMultistepScheduler(flow_shift=config.spec.options["flow_shift"], use_flow_sigmas=True,
                                prediction_type="flow_prediction").save_config(folder / "scheduler")
    dfolder.write_model_index(folder, "SanaVideoPipeline", {
        "scheduler": ("diffusers", "DPMSolverMultistepScheduler"),
        "transformer": ("diffusers", "SanaVideoTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLWan"),
        "text_encoder": ("transformers", "Gemma2Model"), "tokenizer": ("transformers", "GemmaTokenizerFast")})


# ----------------------------------------------------------------------------------------------------- encoding


TEXT_LEN = 300
COMPLEX_HUMAN_INSTRUCTION = inspect.signature(SanaVideoPipeline.__call__).parameters[
    "complex_human_instruction"].default  # the pipeline's default, read from it


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """``SanaVideoPipeline.encode_prompt`` (its complex human instruction, 300 tokens) cut to the unmasked rows."""
    embeds, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=TEXT_LEN,
                                            complex_human_instruction=COMPLEX_HUMAN_INSTRUCTION,
                                            device=pipe.text_encoder.device)
    return fencoders.real_tokens(embeds, mask)


ENCODERS = fencoders.Encoders(
    pipeline="SanaVideoPipeline", text=("tokenizer", "text_encoder"), encode_text=encode_text,
    encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video), frame_step=4, pixel_multiple=16,
    audio_refusal="SANA-Video makes no sound")
"""SANA-Video's encoders: Gemma-2 through the pipeline's prompt encoding, the Wan 2.1 VAE's posterior mean."""


SANA_VIDEO = Family(
    name="sana_video",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"blocks": ("transformer_blocks",)},
        # measured (saved-tensor hooks, bf16) at mlp_ratio 2, 3 and 4: 8.75 dim in fp32, 20.35 dim + 4 of the gated
        # conv's inverted width in bf16
        activations={"blocks": memory.BlockActivations(fp32_dim=8.75, compute_dim=20.35, compute_ffn=4)},
        widths=widths,
        init_rules={"scale_shift_table": wan.scale_shift_init},  # N(0, 1) / sqrt(dim), as diffusers' (Wan's rule)
        self_attention=("transformer_blocks.*.attn1",),
        vsa_refusal="its self-attention is linear attention (ReLU kernels): no softmax scores to sparsify",
    ),
    forward=Forward(inputs=inputs),
    conditioning=text_conditioning("caption_channels", "the Gemma-2 text embedding and its mask"),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
)


class SanaVideoConfig(ModelConfig, tag="sana_video"):
    """A SANA-Video DiT (presets: tiny, world, sana-video-2b-480p); the shared knobs are
    :class:`fvx_models.build.ModelConfig`'s."""

    family = SANA_VIDEO
