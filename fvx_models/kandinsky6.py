"""Kandinsky 6 (diffusers ``Kandinsky6Transformer3DModel``), trained video-only: text to video, its audio branch frozen.

Kandinsky 6 denoises video and audio together: two text branches (video's, audio's: Qwen2.5-VL tokens through a few
self-attention blocks each, CLIP's pooled vector in the time embedding) and fused blocks over the video tokens and
the audio tokens that cross-attend each other. Given no audio latents the DiT runs the video path alone (each fused
block skips its audio half), as ``Kandinsky6TI2VAPipeline`` does without an audio VAE; that is how fvx trains it: the
audio branch's params get no gradient, so they are held frozen (``Training.held_frozen``: every ``audio_*`` module
and the fused blocks' audio decoder, audio-video cross-attention and their modulations) and exported as loaded.

The DiT takes channels-last latents ``[B, T, H, W, C]`` (layout ``"BTHWC"``) beside a zero condition and mask for
text-to-video (``visual_cond``), and predicts the flow velocity its ``FlowMatchEulerDiscreteScheduler`` steps. Its
text is masked (``encoder_attention_mask``), so the data stores each prompt's real Qwen tokens after its pooled CLIP
row, FastVideo's packed form as Kandinsky 5's; latents are the HunyuanVideo VAE's scaled
by its ``scaling_factor``, as the pipeline scales them. Left: image-to-video (the reference frame appended as a masked
tail frame with its own token type) and training the audio branch.
"""
from __future__ import annotations

import fnmatch
import pathlib
from typing import Any, Mapping

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky6Transformer3DModel
from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6RoPE1D, Kandinsky6RoPE3D
from torch import nn

from fvx.distributed import memory
from fvx_models import cond as fcond, diffusers_folder as dfolder, encoders as fencoders, hunyuan_video, wan
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Family, Forward, Preset, Training, pack_pooled,
                               packed_pooled_conditioning, skeleton_of)

# diffusers' Kandinsky6Transformer3DModel defaults (the released text+image-to-video+audio layout as that class ships
# it: 60 fused blocks of width 4096, 4 text blocks a branch); a folder's config.json is checked against it
KANDINSKY6 = dict(
    in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=1024, patch_size=(1, 2, 2),
    model_dim=4096, ff_dim=16384, num_text_blocks=4, num_visual_blocks=60, axes_dims=(32, 48, 48), visual_cond=True,
    in_audio_dim=20, out_audio_dim=20, model_dim_a=None, time_dim_a=None, ff_dim_a=None, axes_dims_a=None,
    audio_freqs_scaling=1.0, scale_factor=(1.0, 2.0, 2.0), text_token_padding=False, ca_rope=False,
    cross_gates=False, fix_modulation=False, visual_token_type_num_embeddings=0,
)
TINY = {**KANDINSKY6, "in_text_dim": 32, "in_text_dim2": 16, "time_dim": 32, "model_dim": 64, "ff_dim": 128,
        "num_text_blocks": 1, "num_visual_blocks": 2, "axes_dims": (8, 12, 12)}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, hunyuan_video.LATENTS, 9),
    # the toy world's (192-channel space-to-depth latents, patch 1; its 4 text rows read as a pooled row and 3 tokens)
    "world": Preset({**TINY, "in_visual_dim": 192, "out_visual_dim": 192, "patch_size": (1, 1, 1),
                     "model_dim": 256, "ff_dim": 512, "num_visual_blocks": 3, "axes_dims": (16, 24, 24)},
                    wan.WORLD_CODEC, 4),
    "kandinsky6": Preset(KANDINSKY6, hunyuan_video.LATENTS, 1025),
}
"""``Kandinsky6Transformer3DModel`` constructor arguments per preset, the latent space (HunyuanVideo's VAE, as its
pipeline's) and the packed text length (the pipeline's 1024 Qwen tokens plus the pooled row)."""

VISUAL_ROPE_POSITIONS = 128  # Kandinsky6RoPE3D's table, per axis (patched frames, rows, columns)
FLOW_SHIFT = 5.0  # Kandinsky 5's (FastVideo's and its pipeline's); Kandinsky 6's released scheduler was not read here

AUDIO_BRANCH = ("audio_*", "visual_transformer_blocks.*.audio_dec_block.*", "visual_transformer_blocks.*.va_*",
                "visual_transformer_blocks.*.av_*")
"""Name patterns of the audio branch's params (``fnmatch``): frozen in video-only training."""


def unused(config: ModelConfig) -> frozenset[str]:
    """The audio branch's params: a video-only forward sends them no gradient (module docstring)."""
    names = [name for name, _ in skeleton(config).named_parameters()]
    return frozenset(n for n in names if any(fnmatch.fnmatchcase(n, pattern) for pattern in AUDIO_BRANCH))


def rebuild(module: nn.Module) -> None:
    """The RoPE tables (buffers, pure functions of the config), on the CPU."""
    k = module.config
    head, head_audio = sum(k.axes_dims), sum(k.axes_dims_a or k.axes_dims)
    module.visual_rope_embeddings = Kandinsky6RoPE3D(tuple(k.axes_dims))
    module.audio_rope_embeddings = Kandinsky6RoPE1D(head_audio, freqs_scaling=k.audio_freqs_scaling)
    module.video_text_rope_embeddings = Kandinsky6RoPE1D(head)
    module.audio_text_rope_embeddings = Kandinsky6RoPE1D(head_audio)


def skeleton(config: ModelConfig) -> nn.Module:
    return skeleton_of(Kandinsky6Transformer3DModel, config.spec.kwargs, rebuild)


def inputs(config: ModelConfig, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """The text-to-video call for channels-last ``x [B, T, H, W, C]``: ``x | zero condition | zero mask``, no audio,
    the text and its mask, the pooled vector, ``t = 1000 sigma``; the visual RoPE at the grid's own positions."""
    hidden = x
    if config.spec.kwargs["visual_cond"]:
        hidden = torch.cat([x, torch.zeros_like(x), torch.zeros_like(x[..., :1])], dim=-1)
    return {"hidden_states": hidden, "encoder_hidden_states": cond["text"], "pooled_projections": cond["pooled"],
            "timestep": t, "encoder_attention_mask": cond["text_mask"].bool(), "return_dict": False}


def output(config: ModelConfig, out: Any, x: torch.Tensor, t: torch.Tensor,
           cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The video's velocity, channels-last (the DiT returns no audio without audio latents)."""
    return out[0]


def latent_rule(config: ModelConfig, shape: tuple[int, ...]) -> str | None:
    """Latents beyond the visual RoPE tables (128 patches an axis)."""
    p_t, p_h, p_w = config.spec.kwargs["patch_size"]
    grid = (shape[2] // p_t, shape[3] // p_h, shape[4] // p_w)
    if max(grid) > VISUAL_ROPE_POSITIONS:
        return (f"the DiT's visual RoPE holds {VISUAL_ROPE_POSITIONS} positions per axis; these latents "
                f"make a grid of {grid[0]} x {grid[1]} x {grid[2]} patches")
    return None


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim, ffn = k["model_dim"], k["ff_dim"]
    return dim, {"visual_transformer_blocks": (dim, ffn), "video_text_transformer_blocks": (dim, ffn),
                 "audio_text_transformer_blocks": (dim, ffn)}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``Kandinsky6TI2VAPipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/``
    (``FLOW_SHIFT``); copy the HunyuanVideo VAE, both text encoders, their tokenizers and the audio VAE and vocoder
    from the base model."""
    FlowMatchEulerDiscreteScheduler(shift=FLOW_SHIFT).save_config(folder / "scheduler")
    dfolder.write_model_index(folder, "Kandinsky6TI2VAPipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "transformer": ("diffusers", "Kandinsky6Transformer3DModel"),
        "vae": ("diffusers", "AutoencoderKLHunyuanVideo"),
        "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
        "tokenizer": ("transformers", "Qwen2_5_VLProcessor"), "text_encoder_2": ("transformers", "CLIPTextModel"),
        "tokenizer_2": ("transformers", "CLIPTokenizer")})


# ----------------------------------------------------------------------------------------------------- encoding


TEXT_LEN = 1024  # Kandinsky6TI2VAPipeline's max_sequence_length: the Qwen tokens after its template


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """``Kandinsky6TI2VAPipeline.encode_prompt`` (Qwen2.5-VL's last hidden state after its template, 1024 tokens;
    CLIP's pooled output): each prompt's real tokens after its pooled row, ``[1 + L_i, 3584]``."""
    embeds, pooled, mask, *_ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                                  max_sequence_length=TEXT_LEN, device=pipe.text_encoder.device)
    mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask
    return pack_pooled(pooled, fencoders.real_tokens(embeds, mask))


ENCODERS = fencoders.Encoders(
    pipeline="Kandinsky6TI2VAPipeline", text=("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"),
    encode_text=encode_text, encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video),
    frame_step=4, pixel_multiple=16, audio_refusal="fvx trains Kandinsky 6 video-only (its audio branch frozen)",
    own_loaders=(("tokenizer", fencoders.processor_tokenizer),))
"""Kandinsky 6's encoders: the packed text rows above and the HunyuanVideo VAE's posterior mean, unscaled (the
latent space applies the scaling factor in training)."""


KANDINSKY6_FAMILY = Family(
    name="kandinsky6",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=skeleton,
        unit_groups={"visual_transformer_blocks": ("visual_transformer_blocks",),
                     "video_text_transformer_blocks": ("video_text_transformer_blocks",),
                     "audio_text_transformer_blocks": ("audio_text_transformer_blocks",)},
        # measured (saved-tensor hooks, bf16, the video path alone), near Kandinsky 5's: its blocks norm, modulate and
        # gate in fp32 and rotate q, k in fp32
        activations={"visual_transformer_blocks": memory.BlockActivations(fp32_dim=17.4, compute_dim=9.13,
                                                                          compute_ffn=2.0),
                     **{name: memory.BlockActivations(fp32_dim=12.66, compute_dim=6.08, compute_ffn=2.0)
                        for name in ("video_text_transformer_blocks", "audio_text_transformer_blocks")}},
        text_groups=frozenset({"video_text_transformer_blocks", "audio_text_transformer_blocks"}),
        widths=widths,
        self_attention=("visual_transformer_blocks.*.video_dec_block.self_attention",),
    ),
    forward=Forward(inputs=inputs, layout="BTHWC", output=output),
    conditioning=packed_pooled_conditioning("in_text_dim", "in_text_dim2",
                                            "the packed [pooled CLIP | Qwen] text embedding",
                                            zero=fcond.zeros_keeping_masks),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(held_frozen=unused, latent_rule=latent_rule),
)


class Kandinsky6Config(ModelConfig, tag="kandinsky6"):
    """A Kandinsky 6 DiT trained video-only, text-to-video (presets: tiny, world, kandinsky6); the shared knobs are
    :class:`fvx_models.build.ModelConfig`'s."""

    family = KANDINSKY6_FAMILY
