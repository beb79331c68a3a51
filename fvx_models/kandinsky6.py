"""Kandinsky 6 (diffusers ``Kandinsky6Transformer3DModel``): text to video, or to video and audio together.

Kandinsky 6 denoises video and audio together: two text branches (video's, audio's: Qwen2.5-VL tokens through a few
self-attention blocks each, CLIP's pooled vector in the time embedding) and fused blocks over the video tokens and
the audio tokens that cross-attend each other, one timestep for both (its pipeline steps two copies of one
scheduler in lockstep). Given no audio latents the DiT runs the video path alone (each fused block skips its audio
half), as ``Kandinsky6TI2VAPipeline(sample_audio=False)`` does. fvx trains either way, by the config's
``train_audio``:

- ``False`` (the default): video only, data of kind t2v; the audio branch gets no gradient, so it is held frozen (the
  ``"audio"`` modality's params, :func:`owns_audio`: every ``audio_*`` module and the fused blocks' audio decoder,
  audio-video cross-attention and their modulations) and exported as loaded.
- ``True``: a joint model over ``{"video", "audio"}``, data of kind t2va: every param trains, both modalities are
  noised at one drawn level per sample (the DiT has one clock) and the loss is the sum of theirs.

The DiT takes channels-last video latents ``[B, T, H, W, C]`` (layout ``"BTHWC"``) beside a zero condition and mask
for text-to-video (``visual_cond``), and audio latents ``[B, A, 20]``, and predicts the flow velocity its
``FlowMatchEulerDiscreteScheduler`` steps. Its text is masked (``encoder_attention_mask``), so the data stores each
prompt's real Qwen tokens after its pooled CLIP row, FastVideo's packed form as Kandinsky 5's; video latents are the
HunyuanVideo VAE's scaled by its ``scaling_factor``, as the pipeline scales them. Audio latents are MMAudio's VAE's
(``MMAudioVAE``: mono log-mel; its ``latent_channels`` must be the DiT's ``in_audio_dim``, 20 in diffusers' defaults)
stored as ``[1, 20, A]`` and scaled by its ``scaling_factor`` 0.417 (the pipeline divides by it before decoding);
``A`` is the clip's ``ceil(samples / latent_hop_length)``, the length the pipeline makes for the clip
(``prepare_audio_latents``). The toy world's stereo framing ``[2, 32, A]`` enters the ``world`` preset as ``A`` tokens
of 64 features: audio latents ``[B, C, F, A]`` are ``[B, A, C F]`` tokens.

Image-to-video (``first_frame``, ``data.kind=i2v``), as the pipeline's ``image=`` call: the given first frame's latents
(encoded alone, scaled; :func:`fvx_models.encoders.scaled_first_frame`) are appended after the video's frames as a
clean tail frame, with condition mask one, token type 1 (the video's 0) and frame 0's RoPE position; the video's own
frames stay noised and the loss covers them all, the tail's prediction dropped as the pipeline drops the tail. With a
text-to-video config the token-type table is unused and held frozen. With ``train_audio`` too it is the ``image=`` call
with ``sample_audio``, on data of kind i2va (the first frame and the sound).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
import pathlib
from typing import Any, Mapping

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky6Transformer3DModel
from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6RoPE1D, Kandinsky6RoPE3D
from torch import nn

from fvx.distributed import memory
from fvx_models import cond as fcond, diffusers_folder as dfolder, encoders as fencoders, hunyuan_video, wan, wan_i2v
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Family, Forward, Joint, Modality, Preset, Training,
                               first_frame_from_batch, first_frame_spec, pack_pooled, packed_pooled_conditioning,
                               skeleton_of)
from fvx_models.model import LatentSpace

# the released text+image-to-video+audio layout: diffusers' Kandinsky6Transformer3DModel defaults (60 fused blocks of
# width 4096, 4 text blocks a branch) with what its docstring says every released checkpoint sets (text_token_padding,
# ca_rope, cross_gates, fix_modulation) and the two token types its pipeline's image conditioning requires (video 0,
# the reference frame 1); a folder's config.json is checked against it
KANDINSKY6 = dict(
    in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=1024, patch_size=(1, 2, 2),
    model_dim=4096, ff_dim=16384, num_text_blocks=4, num_visual_blocks=60, axes_dims=(32, 48, 48), visual_cond=True,
    in_audio_dim=20, out_audio_dim=20, model_dim_a=None, time_dim_a=None, ff_dim_a=None, axes_dims_a=None,
    audio_freqs_scaling=1.0, scale_factor=(1.0, 2.0, 2.0), text_token_padding=True, ca_rope=True,
    cross_gates=True, fix_modulation=True, visual_token_type_num_embeddings=2,
)
TOKEN_TYPES = "visual_token_type_embeddings.weight"  # the table of token types (video 0, reference frame 1)
AUDIO_SCALE = 0.417  # MMAudioVAE's scaling_factor (diffusers' default; the pipeline divides the DiT's latents by it)
AUDIO_LATENTS = LatentSpace(1, scale=AUDIO_SCALE, vae_stride=(1, 1, 1), vae="MMAudio VAE (mono [1, 20, A])")
"""The audio latent space: the MMAudio VAE's posterior mean ``[B, 1, 20, A]``, scaled as the pipeline scales it."""
TOY_AUDIO = LatentSpace(2, vae_stride=(1, 1, 1), vae="the toy world's stereo framing [2, 32, A]")
"""The toy world's audio latents ``[B, 2, 32, A]`` (``fvx.data.toy_audio``), read as ``A`` tokens of 64 features."""

TINY = {**KANDINSKY6, "in_text_dim": 32, "in_text_dim2": 16, "time_dim": 32, "model_dim": 64, "ff_dim": 128,
        "num_text_blocks": 1, "num_visual_blocks": 2, "axes_dims": (8, 12, 12)}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, hunyuan_video.LATENTS, 9, {"audio_latents": AUDIO_LATENTS}),
    # the toy world's (192-channel space-to-depth latents, patch 1; its 4 text rows read as a pooled row and 3 tokens;
    # its stereo audio framing as 64-feature tokens)
    "world": Preset({**TINY, "in_visual_dim": 192, "out_visual_dim": 192, "patch_size": (1, 1, 1),
                     "model_dim": 256, "ff_dim": 512, "num_visual_blocks": 3, "axes_dims": (16, 24, 24),
                     "in_audio_dim": 64, "out_audio_dim": 64},
                    wan.WORLD_CODEC, 4, {"audio_latents": TOY_AUDIO}),
    "kandinsky6": Preset(KANDINSKY6, hunyuan_video.LATENTS, 1025, {"audio_latents": AUDIO_LATENTS}),
}
"""``Kandinsky6Transformer3DModel`` constructor arguments per preset, the latent space (HunyuanVideo's VAE, as its
pipeline's), the packed text length (the pipeline's 1024 Qwen tokens plus the pooled row) and the audio latent space
(``"audio_latents"``: :data:`AUDIO_LATENTS`, the toy world's :data:`TOY_AUDIO`)."""

VISUAL_ROPE_POSITIONS = 128  # Kandinsky6RoPE3D's table, per axis (patched frames, rows, columns)
AUDIO_ROPE_POSITIONS = 2048  # Kandinsky6RoPE1D's table: audio latents
FLOW_SHIFT = 5.0  # Kandinsky 5's (FastVideo's and its pipeline's); Kandinsky 6's released scheduler was not read here

AUDIO_BRANCH = ("audio_*", "visual_transformer_blocks.*.audio_dec_block.*", "visual_transformer_blocks.*.va_*",
                "visual_transformer_blocks.*.av_*")
"""Name patterns of the audio branch's params (``fnmatch``): frozen in video-only training."""


def owns_audio(name: str) -> bool:
    """Whether param ``name`` belongs to the audio branch: what a video-only forward sends no gradient."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in AUDIO_BRANCH)


def trained(config: "Kandinsky6Config") -> tuple[str, ...]:
    return ("video", "audio") if config.train_audio else ("video",)


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


def inputs(config: ModelConfig, x: Any, t: Any, cond: Mapping[str, torch.Tensor], sharded: bool) -> dict[str, Any]:
    """The text-to-video call for channels-last ``x [B, T, H, W, C]``: ``x | zero condition | zero mask``, the text
    and its mask, the pooled vector, ``t = 1000 sigma``; the visual RoPE at the grid's own positions. Image-to-video
    appends the reference tail frame (:func:`with_reference_frame`), its mask one. A joint model's ``x`` and ``t`` are
    dicts: audio latents ``[B, C, F, A]`` go in as tokens ``[B, A, C F]`` under the video's ``t`` (one clock: both
    modalities are at one level)."""
    video, audio = (x["video"], x["audio"]) if isinstance(x, Mapping) else (x, None)
    call = {"encoder_hidden_states": cond["text"], "pooled_projections": cond["pooled"],
            "timestep": t["video"] if isinstance(t, Mapping) else t,
            "encoder_attention_mask": cond["text_mask"].bool(), "return_dict": False}
    mask = torch.zeros_like(video[..., :1])
    if config.first_frame:
        video, reference = with_reference_frame(config, video, cond)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        call.update(reference)
    visual_cond = config.spec.kwargs["visual_cond"]
    call["hidden_states"] = torch.cat([video, torch.zeros_like(video), mask], dim=-1) if visual_cond else video
    if audio is not None:
        call["audio_hidden_states"] = audio.permute(0, 3, 1, 2).flatten(2)
    return call


def with_reference_frame(config: ModelConfig, video: torch.Tensor, cond: Mapping[str, torch.Tensor]
                         ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Image-to-video's input as the pipeline makes it: ``video [B, T, H, W, C]`` then the given first frame's latents
    as a clean tail frame ``[B, T + 1, H, W, C]``, the frames' token types (0, the tail 1) and RoPE positions (the
    tail at frame 0's)."""
    channels_first = video.permute(0, 4, 1, 2, 3)
    given = wan_i2v.given_frames(channels_first, cond, config.family.name)[:, :, :1]
    batch, frames, height, width, _ = video.shape
    types = torch.zeros(batch, frames + 1, dtype=torch.long, device=video.device)
    types[:, -1] = 1
    p_t, p_h, p_w = config.spec.kwargs["patch_size"]
    positions = (torch.cat([torch.arange(frames // p_t), torch.zeros(1, dtype=torch.long)]).to(video.device),
                 torch.arange(height // p_h, device=video.device), torch.arange(width // p_w, device=video.device))
    tail = given.permute(0, 2, 3, 4, 1).to(video.dtype)
    return torch.cat([video, tail], dim=1), {"visual_token_type_ids": types, "visual_rope_pos": positions}


def output(config: ModelConfig, out: Any, x: Any, t: Any, cond: Mapping[str, torch.Tensor]) -> Any:
    """The video's velocity, channels-last (image-to-video's tail frame dropped); a joint model's dict adds the
    audio's, ``[B, A, C F] -> [B, C, F, A]``."""
    video = out[0][:, :-1] if config.first_frame else out[0]
    if not isinstance(x, Mapping):
        return video
    batch, channels, features, count = x["audio"].shape
    return {"video": video, "audio": out[1].reshape(batch, count, channels, features).permute(0, 2, 3, 1)}


def held_frozen(config: "Kandinsky6Config") -> frozenset[str]:
    """The token-type table when the model runs text-to-video (it reads it only for a reference frame)."""
    return frozenset() if config.first_frame else frozenset({TOKEN_TYPES})


def latent_rule(config: ModelConfig, shape: Any) -> str | None:
    """Latents beyond the visual RoPE tables (128 patches an axis); a joint model's audio ``[B, C, F, A]`` whose ``C
    F`` is not the DiT's audio width or whose ``A`` is beyond the audio RoPE table (2048)."""
    video = shape["video"] if isinstance(shape, Mapping) else shape
    p_t, p_h, p_w = config.spec.kwargs["patch_size"]
    grid = (video[2] // p_t, video[3] // p_h, video[4] // p_w)
    if max(grid) > VISUAL_ROPE_POSITIONS:
        return (f"the DiT's visual RoPE holds {VISUAL_ROPE_POSITIONS} positions per axis; these latents "
                f"make a grid of {grid[0]} x {grid[1]} x {grid[2]} patches")
    if not isinstance(shape, Mapping):
        return None
    audio, width = tuple(shape["audio"]), config.spec.kwargs["in_audio_dim"]
    channels = config.spec.options["audio_latents"].channels
    if len(audio) != 4 or audio[1] != channels or audio[1] * audio[2] != width:
        return f"audio latents must be [B, {channels}, {width // channels}, A], got {list(audio)}"
    if audio[3] > AUDIO_ROPE_POSITIONS:
        return f"the DiT's audio RoPE holds {AUDIO_ROPE_POSITIONS} positions; these audio latents have {audio[3]}"
    return None


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim, ffn = k["model_dim"], k["ff_dim"]
    return dim, {"visual_transformer_blocks": (dim, ffn), "video_text_transformer_blocks": (dim, ffn),
                 "audio_text_transformer_blocks": (dim, ffn)}


TEXT = packed_pooled_conditioning("in_text_dim", "in_text_dim2", "the packed [pooled CLIP | Qwen] text embedding",
                                  zero=fcond.zeros_keeping_masks)


def cond_spec(config: "Kandinsky6Config") -> fcond.Spec:
    """The packed text; image-to-video adds the first frame's latents ``[C, T, H, W]`` (frame 0 read)."""
    return {**TEXT.spec(config), **(first_frame_spec(config) if config.first_frame else {})}


def cond_from_batch(config: "Kandinsky6Config", batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {**TEXT.from_batch(config, batch), **(first_frame_from_batch(config, batch) if config.first_frame else {})}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``Kandinsky6TI2VAPipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/``
    (``FLOW_SHIFT``); copy the HunyuanVideo VAE, both text encoders, their tokenizers and the audio VAE and vocoder
    (``audio_vae/``, ``vocoder/``) from the base model."""
    FlowMatchEulerDiscreteScheduler(shift=FLOW_SHIFT).save_config(folder / "scheduler")
    dfolder.write_model_index(folder, "Kandinsky6TI2VAPipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "transformer": ("diffusers", "Kandinsky6Transformer3DModel"),
        "vae": ("diffusers", "AutoencoderKLHunyuanVideo"),
        "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
        "tokenizer": ("transformers", "Qwen2_5_VLProcessor"), "text_encoder_2": ("transformers", "CLIPTextModel"),
        "tokenizer_2": ("transformers", "CLIPTokenizer"), "audio_vae": ("diffusers", "MMAudioVAE"),
        "vocoder": ("diffusers", "MMAudioVocoder")})


# ----------------------------------------------------------------------------------------------------- encoding


TEXT_LEN = 1024  # Kandinsky6TI2VAPipeline's max_sequence_length: the Qwen tokens after its template


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """``Kandinsky6TI2VAPipeline.encode_prompt`` (Qwen2.5-VL's last hidden state after its template, 1024 tokens;
    CLIP's pooled output): each prompt's real tokens after its pooled row, ``[1 + L_i, 3584]``."""
    embeds, pooled, mask, *_ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                                  max_sequence_length=TEXT_LEN, device=pipe.text_encoder.device)
    mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask
    return pack_pooled(pooled, fencoders.real_tokens(embeds, mask))


def encode_audio(pipe: Any, waveform: torch.Tensor, rate: int) -> torch.Tensor:
    """Stereo waveforms ``[B, 2, S]`` at the audio VAE's rate -> its posterior mean ``[B, 1, 20, A]``, unscaled (the
    latent space scales): the mono mix (the VAE and the pipeline's output are mono), zero-padded to whole latents so
    ``A = ceil(S / latent_hop_length)``, the length the pipeline makes for the clip."""
    vae = pipe.audio_vae
    if rate != vae.config.sample_rate:
        raise ValueError(f"kandinsky6: the audio VAE takes {vae.config.sample_rate} Hz audio, got {rate} Hz: set "
                         f"data.preprocess.audio_rate={vae.config.sample_rate}")
    mono = waveform.float().mean(dim=1)
    hop = vae.latent_hop_length
    mono = torch.nn.functional.pad(mono, (0, math.ceil(mono.shape[-1] / hop) * hop - mono.shape[-1]))
    return vae.encode(mono.to(vae.dtype)).latent_dist.mean[:, None]


ENCODERS = fencoders.Encoders(
    pipeline="Kandinsky6TI2VAPipeline", text=("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"),
    encode_text=encode_text, encode_video=lambda pipe, video: fencoders.latent_mean(pipe.vae, video),
    first_frame=fencoders.scaled_first_frame, frame_step=4, pixel_multiple=16, audio=("audio_vae",),
    encode_audio=encode_audio,
    own_loaders=(("tokenizer", fencoders.processor_tokenizer),))
"""Kandinsky 6's encoders: the packed text rows above, the HunyuanVideo VAE's posterior mean and the MMAudio VAE's
(t2va), both unscaled (the latent spaces apply the scaling factors in training), and image-to-video's first frame
encoded alone and scaled, as the pipeline's ``encode_image``."""


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
    conditioning=dataclasses.replace(TEXT, spec=cond_spec, from_batch=cond_from_batch,
                                     data_keys=(*TEXT.data_keys, "first_frame_latents"),
                                     image=frozenset({"first_frame_latents"})),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(held_frozen=held_frozen, latent_rule=latent_rule),
    joint=Joint(modalities={"audio": Modality(latents=lambda config: config.spec.options["audio_latents"],
                                              owns=owns_audio)},
                trained=trained),
)


class Kandinsky6Config(ModelConfig, tag="kandinsky6"):
    """A Kandinsky 6 DiT, text-to-video (presets: tiny, world, kandinsky6). ``train_audio``: train video and audio
    together (a joint model; data of kind t2va) instead of video alone with the audio branch frozen; ``first_frame``:
    image-to-video, the given first frame as the reference tail frame (``data.kind=i2v``, or i2va with
    ``train_audio``; module docstring). The shared
    knobs are :class:`fvx_models.build.ModelConfig`'s."""

    family = KANDINSKY6_FAMILY

    train_audio: bool = False
    first_frame: bool = False
