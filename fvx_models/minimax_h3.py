"""MiniMax-H3 joint text-to-video-and-audio (diffusers ``MiniMaxH3Transformer3DModel``): the family's spec, a joint
model that trains video and audio together, as FastVideo's ``MiniMaxH3Model`` (``fastvideo/train/models/minimax_h3``).

One packed sequence per sample: ``[text | audio | video]`` rows under full self-attention (no cross-attention, no
batch offset), built here by diffusers' own ``MiniMaxH3PrepareLayoutStep.build_packed_sequence`` (the t2va layout:
no keyframe rows; text tag 1, audio tag 2, video tag 0; an fp64 ``(t, h, w)`` RoPE grid in which the text rows sit on
the time axis at their index and the media clock starts after them). Video latents ``[1, C, T, H, W]`` become rows by
diffusers' ``patchify_video_latents`` (channel-major patch features); stereo audio latents ``[1, 2, 32, A]`` become
``2 A`` channel-major rows ``[2, 32, A] -> [2, A, 32] -> [2 A, 32]`` (``MiniMaxH3PrepareLatentsStep``; the
after-denoise step unpacks them the other way). Only the valid text tokens enter (``text[:, mask]``, as FastVideo
keeps them): padding changes nothing.

Time. fvx hands ``t = 1000 sigma`` per modality (``{"video": [1], "audio": [1]}``); the DiT takes MiniMax-H3's
clean time ``1 - sigma`` in [0, 1] (1 = clean) as the distinct values of the sequence and every row's index into them,
made by diffusers' ``MiniMaxH3SetTimestepsStep.build_row_timesteps`` (text rows take the video's time). It predicts the
data-ward velocity ``x0 - noise``; fvx's is ``noise - x0``, so both outputs are negated (FastVideo returns ``(-video,
-audio)``). Training draws one base ``b ~ U(0, 1)`` per sample and shifts it per modality (the schedulers' shifts 12
and 3): ``sigma_v = 12 b / (1 + 11 b)``, ``sigma_a = 3 b / (1 + 2 b)`` (:func:`coupled_sigmas`, the family's
``sigma_sampler``), so picture and sound are noised at one stage of one trajectory.

Latents. Video: the MiniMax-H3 video VAE, 24 channels, 16x spatial, ``17 n + 5`` frames -> ``5 n + 2`` latents (3.4x
in time; ``vae_stride`` says 3, the nearest integer, so the dry run counts ``(F - 1) / 3 + 1`` latents: 42 for
FastVideo's 124 frames where the VAE makes 37, an estimate on the safe side). Audio: the mono audio VAE's 32
features at 40 latents a second (800 samples at 32 kHz), stereo as 2 channels: ``[B, 2, 32, A]`` with ``A`` the
audio latents of the clip the video came from (:func:`audio_frames`). FastVideo's t2va data holds both normalised
with the VAEs' statistics (its preprocessing stores ``vae.normalize_latents(...)`` and ``audio_vae.normalize_latents(
posterior.mode())``), so both latent spaces here are the identity; the audio decoder (``fvx_models.minimax_h3_audio``)
denormalises with the audio VAE's ``latents_mean``/``latents_std`` before decoding. ``preprocess`` stores the same
(:data:`ENCODERS`: the video posterior sampled under FastVideo's seed, the audio posterior's mode, both normalised).

Conditioning: Qwen3-VL (layer 50) embeddings ``text [1, L, 5120]`` with ``text_mask [1, L]`` (FastVideo's fixture pads
to 1024). Rules as FastVideo's plugin: batch 1 per rank (one packed document per sample), no CFG dropout (H3 training
defines no zero-text branch), dense attention only (no VSA: the sequence is not the video grid's), no sequence
parallelism here, and no whole-graph compile (the valid-token count and the layout are data-dependent).
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping

import diffusers
import torch
from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed
from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                    MiniMaxH3SetTimestepsStep, patchify_video_latents)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (MINIMAX_H3_AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG,
                                                                     MINIMAX_H3_TEXT_TAG, MINIMAX_H3_VIDEO_TAG,
                                                                     audio_latent_num_frames, video_latent_num_frames)
from torch import nn

from fvx.core import flow
from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder
from fvx_models import encoders as fencoders
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Conditioning, Family, Forward, Joint, Modality, Preset,
                               TEXT_MASK_DEFAULT, Training, require, skeleton_of)
from fvx_models.model import LatentSpace

NAME = "minimax_h3"
FRAMES_PER_CHUNK, LATENTS_PER_CHUNK = 17, 5  # the video VAE's clip_length and tokens_chunk_size: 17 n + 5 -> 5 n + 2
AUDIO_FEATURES = 32  # the audio VAE's latent_channels
VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0  # the two schedulers' shifts (diffusers' pipeline and FastVideo's plugin)
TEXT_LEN = 1024  # FastVideo's Qwen3-VL text_len (its t2va fixture)

VIDEO_LATENTS = LatentSpace(24, (0.0,) * 24, (1.0,) * 24, vae_stride=(3, 16, 16), vae="MiniMax-H3 video VAE")
"""The released video latents, already normalised in FastVideo's t2va data (module docstring: the temporal stride is
3.4, written 3)."""
AUDIO_LATENTS = LatentSpace(MINIMAX_H3_AUDIO_CHANNELS, (0.0,) * MINIMAX_H3_AUDIO_CHANNELS,
                            (1.0,) * MINIMAX_H3_AUDIO_CHANNELS, vae_stride=(1, 1, 1),
                            vae="MiniMax-H3 audio VAE (stereo [2, 32, A], 40 latents a second)")
"""Stereo audio latents ``[B, 2, 32, A]`` (channels = the 2 stereo channels), already normalised in the data."""
WORLD_LATENTS = LatentSpace(48, vae_stride=(1, 4, 4), vae="space-to-depth 4 (fvx.data.toy_world)")

# diffusers' MiniMaxH3Transformer3DModel defaults are the released config (FastVideo's MiniMaxH3ArchConfig agrees; its
# extra adaln_rank, a FastVideo-only low-rank AdaLN, is None in the release)
_H3 = dict(num_attention_heads=56, attention_head_dim=128, hidden_size=5376, num_layers=50, num_refiner_layers=2,
           ffn_dim=14336, in_channels=24, audio_in_channels=AUDIO_FEATURES, patch_size=(1, 2, 2), text_dim=5120,
           freq_dim=256, time_embed_hidden_dim=5376, time_embed_dim=2688, rope_freq_dim=16, rope_theta=10000.0,
           norm_eps=1e-5, qk_norm_eps=1e-5, final_norm_eps=1e-5)
# hidden 48 beside 2 heads of 16 (attention width 32): the released model's attention is wider than its stream too
# (7168 vs 5376); 6 rope_freq_dim = 12 of 16 head channels rotate (96 of 128 in the release)
TINY = {**_H3, "num_attention_heads": 2, "attention_head_dim": 16, "hidden_size": 48, "num_layers": 2,
        "num_refiner_layers": 1, "ffn_dim": 64, "in_channels": 48, "text_dim": 32, "freq_dim": 32,
        "time_embed_hidden_dim": 48, "time_embed_dim": 24, "rope_freq_dim": 2}

# The toy world's CPU default (fvx.data.toy_world, space-to-depth factor 4; its tone's 32-sample frames): 3 layers of
# width 256, as Wan's world preset
WORLD = {**TINY, "num_attention_heads": 4, "attention_head_dim": 64, "hidden_size": 256, "num_layers": 3,
         "ffn_dim": 512, "freq_dim": 256, "time_embed_hidden_dim": 256, "time_embed_dim": 128, "rope_freq_dim": 8}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, WORLD_LATENTS, 8),
    "world": Preset(WORLD, WORLD_LATENTS, 4),
    "minimax-h3": Preset(_H3, VIDEO_LATENTS, TEXT_LEN, {"clip_geometry": True}),
}
"""``MiniMaxH3Transformer3DModel`` constructor arguments per preset (every argument), the video latent space and the
text length. The audio latent space is :data:`AUDIO_LATENTS` for both. ``clip_geometry``: latents are the released
VAEs' (5 n + 2 video latent frames, the clip's 40 audio latents a second), which :func:`latent_rule` checks; the tiny
preset takes the toy world's (``fvx.data.toy_world``: 8 audio latents a frame)."""

# What one unit saves per token, measured (saved-tensor hooks, bf16, eager: bench/activations.py's saved_per_group fed
# a joint model's inputs; dim 96 with attention width 128, 4/3 of dim as released, ffn 256 and 512 to separate the FFN
# term): per row of the packed sequence for the blocks (text, audio and video rows), per text row for the refiner. The
# dry run counts video tokens only; the audio rows (2 A: 414 at 124 frames) and the valid text rows (up to 1024) add
# about 4% to the 37296 video tokens of 124 frames at 768 x 1344.
ACTIVATIONS = {
    "transformer_blocks": memory.BlockActivations(fp32_dim=9.5, compute_dim=16.3, compute_ffn=4.0),
    "token_refiner": memory.BlockActivations(fp32_dim=9.5, compute_dim=7.3, compute_ffn=4.0),
}

CFG_DROPOUT_REFUSAL = ("MiniMax-H3 training defines no zero-text branch (FastVideo's plugin requires "
                       "training_cfg_rate=0; the released model is guidance-distilled)")
AUDIO_PARAMS = ("audio_proj_in.", "audio_proj_out.")
ONE_SAMPLE = ("it packs one text-audio-video document per forward and its row layout has no batch offset; FastVideo "
              "trains it at batch 1 per rank")


# ------------------------------------------------------------------------------------------------------------ time


def coupled_sigmas(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One shared stage ``base`` in [0, 1] ``[B]`` as (video sigma, audio sigma) ``[B]``: the rational shift
    ``s b / (1 + (s - 1) b)`` with the video scheduler's 12 and the audio one's 3 (0 -> 0 and 1 -> 1 for both)."""
    return (VIDEO_SHIFT * base / (1 + (VIDEO_SHIFT - 1) * base),
            AUDIO_SHIFT * base / (1 + (AUDIO_SHIFT - 1) * base))


def sigma_sampler(config: ModelConfig, keys: torch.Tensor, x0: Any) -> tuple[dict, dict]:
    """FastVideo's training noise levels: one base ``b ~ U(0, 1)`` per sample from its key (``keys [B, 2]``), shifted
    per modality (:func:`coupled_sigmas`); returns ``({"video": sigma_v, "audio": sigma_a}, {.. 1000 sigma ..})``."""
    device = x0["video"].device if isinstance(x0, Mapping) else x0.device
    video, audio = coupled_sigmas(flow.sample_u(keys, "uniform", device=device))
    return {"video": video, "audio": audio}, {"video": 1000 * video, "audio": 1000 * audio}


def clean_time(t: torch.Tensor) -> torch.Tensor:
    """fvx's ``t = 1000 sigma`` as MiniMax-H3's clean time ``1 - sigma`` (fp32; 1 = clean)."""
    return 1 - t.float() / 1000


# --------------------------------------------------------------------------------------------------------- lengths


def audio_frames(latent_frames: int) -> int:
    """The audio latents ``A`` of the clip whose video VAE latents have ``latent_frames = 5 n + 2`` frames: that clip
    has ``17 n + 5`` frames at 24 fps, and the audio VAE makes 40 latents a second (diffusers'
    ``audio_latent_num_frames``; 37 latents -> 124 frames -> 207). A ValueError unless ``latent_frames`` is 5 n + 2."""
    if isinstance(latent_frames, bool) or not isinstance(latent_frames, int) or latent_frames < 2 or (
            latent_frames % LATENTS_PER_CHUNK != 2):
        raise ValueError(f"minimax_h3: latent_frames must be 5 n + 2 (the video VAE's latents of a 17 n + 5 frame "
                         f"clip), got {latent_frames!r}")
    frames = (latent_frames - 2) // LATENTS_PER_CHUNK * FRAMES_PER_CHUNK + LATENTS_PER_CHUNK
    assert video_latent_num_frames(frames, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK) == latent_frames
    return audio_latent_num_frames(frames)


def latent_rule(config: ModelConfig, shape: Any) -> str | None:
    """Why latents do not fit (``shape``: ``{"video": [B, C, T, H, W], "audio": [B, 2, 32, A]}``, or the video's
    alone): audio latents not ``[B, 2, 32, A]``; for the released VAEs' latents (``clip_geometry``) also a video length
    that no clip makes, or an ``A`` other than the clip's (:func:`audio_frames`). One sample per forward
    (FastVideo's batch 1 per rank) is ``Family.training.one_sample``: a batch runs sample by sample."""
    video = tuple(shape["video"]) if isinstance(shape, Mapping) else tuple(shape)
    geometry = config.spec.options.get("clip_geometry", False)
    try:
        expected = audio_frames(int(video[2])) if geometry else None
    except ValueError as error:
        return str(error).removeprefix(f"{NAME}: ")
    if not isinstance(shape, Mapping) or "audio" not in shape:
        return None
    audio, features = tuple(shape["audio"]), config.spec.kwargs["audio_in_channels"]
    if len(audio) != 4 or audio[1:3] != (MINIMAX_H3_AUDIO_CHANNELS, features):
        return f"audio latents must be [B, {MINIMAX_H3_AUDIO_CHANNELS}, {features}, A], got {list(audio)}"
    if geometry and audio[3] != expected:
        return (f"audio latents have {audio[3]} frames but video latents of {video[2]} frames come from a clip with "
                f"{expected} audio latents (17 n + 5 frames at 24 fps, 40 audio latents a second)")
    return None


# ---------------------------------------------------------------------------------------------------------- the DiT


def cond_spec(config: ModelConfig) -> dict[str, tuple]:
    return {"text": ("L", config.spec.kwargs["text_dim"]), "text_mask": ("L",)}


def cond_from_batch(config: ModelConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The Qwen3-VL embedding and its mask (FastVideo's t2va ``text_embedding`` and ``text_attention_mask``)."""
    require(batch, ("text", "text_mask"), NAME, "the Qwen3-VL text embedding and its mask")
    return {"text": batch["text"], "text_mask": batch["text_mask"]}


def inputs(config: ModelConfig, x: Mapping[str, torch.Tensor], t: Mapping[str, torch.Tensor],
           cond: Mapping[str, torch.Tensor], sharded: bool) -> dict[str, Any]:
    """The DiT's call for one sample (module docstring): video ``[1, C, T, H, W]`` and audio ``[1, 2, 32, A]``
    latents as rows, the valid text tokens, diffusers' t2va layout and the clean-time ``(timestep,
    timestep_indices)``."""
    video, audio = x["video"], x["audio"]
    device, patch = video.device, tuple(config.spec.kwargs["patch_size"])
    valid = cond["text_mask"][0].bool()
    if not bool(valid.any()):
        raise ValueError(f"{NAME}: cond['text_mask'] marks no valid text token; MiniMax-H3 needs at least one")
    text = cond["text"][:, valid]
    _, _, frames, height, width = video.shape
    count = audio.shape[-1]
    tags = torch.full((text.shape[1],), MINIMAX_H3_TEXT_TAG, dtype=torch.long)
    position_ids, token_tags, video_rows_at, audio_rows_at, text_rows_at, _, _ = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(tags, frames, height, width, count, patch,
                                                         MINIMAX_H3_AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG,
                                                         MINIMAX_H3_VIDEO_TAG))
    clean = torch.stack([clean_time(t["video"][0]), clean_time(t["audio"][0])])
    video_time, audio_time = clean.detach().tolist()
    unique, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_rows_at, audio_rows_at, 0, 0, text.shape[1], video_time, audio_time, video_time, audio_time)
    # the same distinct values, taken from ``clean`` so that gradients (and tangents) reach t
    timestep = clean[(unique.to(device)[:, None] == clean.detach()[None]).int().argmax(1)]
    audio_rows = audio[0].permute(0, 2, 1).reshape(-1, audio.shape[2])
    return {"hidden_states": patchify_video_latents(video, patch)[None], "audio_hidden_states": audio_rows[None],
            "encoder_hidden_states": text, "timestep": timestep, "timestep_indices": indices.to(device),
            "token_tags": token_tags.to(device), "position_ids": position_ids.to(device),
            "video_indices": video_rows_at.to(device), "audio_indices": audio_rows_at.to(device),
            "text_indices": text_rows_at.to(device), "return_dict": False}


def unpatchify(rows: torch.Tensor, shape: tuple[int, ...], patch: tuple[int, int, int]) -> torch.Tensor:
    """Video rows ``[N, C pt ph pw]`` (frame-major, channel-major features) back as latents ``shape [1, C, T, H, W]``:
    the inverse of ``patchify_video_latents``."""
    _, channels, frames, height, width = shape
    pt, ph, pw = patch
    rows = rows.reshape(-1, frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    return rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(shape)


def output(config: ModelConfig, out: Any, x: Mapping[str, torch.Tensor], t: Any,
           cond: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DiT's rows as fvx's velocities ``noise - x0``: video ``[1, C, T, H, W]``, audio ``[1, 2, 32, A]`` (both
    negated: the DiT predicts ``x0 - noise``)."""
    video_rows, audio_rows = out
    _, channels, features, count = x["audio"].shape
    video = unpatchify(video_rows[0], tuple(x["video"].shape), tuple(config.spec.kwargs["patch_size"]))
    audio = audio_rows[0].reshape(channels, count, features).permute(0, 2, 1)[None]
    return {"video": -video, "audio": -audio}


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    k = config.spec.kwargs
    dim, ffn = k["hidden_size"], k["ffn_dim"]
    return dim, {"transformer_blocks": (dim, ffn), "token_refiner": (dim, ffn)}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``MiniMaxH3ModularPipeline`` files beside ``transformer/``: ``modular_model_index.json`` (what
    ``ModularPipeline.from_pretrained`` reads: the blocks and each component's subfolder), ``model_index.json`` naming
    the same components, and the two schedulers (video shift 12, audio shift 3). Copy ``vae/``, ``audio_vae/``,
    ``text_encoder/``, ``tokenizer/`` and ``processor/`` from the base model."""
    MiniMaxH3Scheduler(shift=VIDEO_SHIFT).save_config(folder / "scheduler")
    MiniMaxH3Scheduler(shift=AUDIO_SHIFT).save_config(folder / "audio_scheduler")
    components = {"scheduler": ("diffusers", "MiniMaxH3Scheduler"),
                  "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
                  "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
                  "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
                  "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
                  "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
                  "tokenizer": ("transformers", "Qwen2TokenizerFast"),
                  "processor": ("transformers", "Qwen3VLProcessor")}
    dfolder.write_model_index(folder, "MiniMaxH3ModularPipeline", components)
    modular = {"_class_name": "MiniMaxH3ModularPipeline", "_blocks_class_name": "MiniMaxH3Blocks",
               "_diffusers_version": diffusers.__version__,
               **{name: [library, cls, {"pretrained_model_name_or_path": None, "subfolder": name, "variant": None,
                                        "revision": None, "type_hint": [library, cls]}]
                  for name, (library, cls) in components.items()}}
    (folder / "modular_model_index.json").write_text(json.dumps(modular, indent=2) + "\n")


def rebuild(module: nn.Module) -> None:
    """The RoPE module again on the CPU: its ``inv_freq`` buffer is computed, not loaded."""
    module.rope = MiniMaxH3RotaryPosEmbed(module.config.rope_freq_dim, module.config.rope_theta)


# ---------------------------------------------------------------------------------------------------------- encoders

LATENT_SEED = 42  # FastVideo's t2va preprocessing draws the video posterior under this seed (diffusers' keyframes too)
VISION_PADS = ("<|image_pad|>", "<|video_pad|>")  # Qwen3-VL's vision placeholders: a t2va prompt holds none


class TextPresentation:
    """What diffusers' ``get_qwen3vl_prompt_embeds`` asks of Qwen3-VL's processor for a t2va prompt: Qwen-internal
    token types, all text (``Qwen3VLProcessor.create_mm_token_type_ids`` of ids without a vision pad token), so the
    processor (and the torchvision its video half needs) is not loaded; FastVideo's t2va text uses the tokenizer
    alone."""

    @staticmethod
    def create_mm_token_type_ids(batch: list[list[int]]) -> list[list[int]]:
        return [[0] * len(ids) for ids in batch]


def encode_text(pipe: Any, prompts: list[str]) -> list[torch.Tensor]:
    """Each prompt's Qwen3-VL hidden state after decoder layer 50 ``[L, 5120]``, as diffusers'
    ``MiniMaxH3TextEncoderStep`` encodes a t2va prompt: the prompt verbatim (no template, no special tokens), one
    conditioner call each; every row is a real token. A ValueError for a prompt holding a vision pad token."""
    from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

    encoder, tokenizer = pipe.text_encoder, pipe.tokenizer
    pads = {tokenizer.convert_tokens_to_ids(token) for token in VISION_PADS} - {None, tokenizer.unk_token_id}
    rows = []
    for index, prompt in enumerate(prompts):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if pads.intersection(ids):
            raise ValueError(f"{NAME}: prompt {index} holds a Qwen3-VL vision token ({' or '.join(VISION_PADS)}); a "
                             "t2va caption is text only")
        rows.append(get_qwen3vl_prompt_embeds(encoder, TextPresentation(), ids, {},
                                              text_encoder_layer=pipe.text_encoder_layer, device=encoder.device,
                                              dtype=encoder.dtype)[0])
    return rows


def encode_video(pipe: Any, video: torch.Tensor) -> torch.Tensor:
    """Video ``[B, 3, T, H, W]`` in [-1, 1] -> normalised latents ``[B, 24, t, h, w]`` as FastVideo's t2va
    preprocessing stores them: ImageNet-normalised ``[0, 1]`` pixels, the posterior *sampled* under a fresh CPU
    generator seeded :data:`LATENT_SEED` per clip, then ``(z - latents_mean) / latents_std``. A ValueError unless
    ``T = 17 n + 5`` (the only lengths the pipeline makes; others would be padded with the last frame)."""
    vae, frames = pipe.vae, video.shape[2]
    chunk, kept = pipe.vae_frames_per_chunk, pipe.vae_latents_per_chunk
    if frames % chunk != kept:
        raise ValueError(f"{NAME}: clips must have {chunk} n + {kept} frames (the video VAE's chunks; FastVideo's 124 "
                         f"at 24 fps), got {frames}: set data.preprocess.num_frames")
    shape = (1, -1, 1, 1, 1)
    pixel_mean = torch.tensor(pipe.pixel_mean, device=video.device).view(shape)
    pixel_std = torch.tensor(pipe.pixel_std, device=video.device).view(shape)
    pixels = (((video.float() + 1) / 2 - pixel_mean) / pixel_std).to(vae.dtype)
    latents = torch.cat([vae.encode(clip).latent_dist.sample(generator=torch.Generator().manual_seed(LATENT_SEED))
                         for clip in pixels.split(1)]).float()
    mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(shape)
    std = torch.tensor(vae.config.latents_std, device=latents.device).view(shape)
    return (latents - mean) / std


def encode_audio(pipe: Any, waveform: torch.Tensor, rate: int) -> torch.Tensor:
    """Stereo waveforms ``[B, 2, S]`` at the audio VAE's rate -> normalised latents ``[B, 2, 32, A]``: each channel
    through the mono VAE as a batch item, the posterior's mode, ``(z - latents_mean) / latents_std`` per feature
    (diffusers' ``MiniMaxH3Ref2VAReferenceEncoderStep``, FastVideo's t2va preprocessing). A ValueError at another
    rate."""
    vae = pipe.audio_vae
    if rate != vae.config.sampling_rate:
        raise ValueError(f"{NAME}: the audio VAE takes {vae.config.sampling_rate} Hz audio, got {rate} Hz: set "
                         f"data.preprocess.audio_rate={vae.config.sampling_rate}")
    batch, channels, samples = waveform.shape
    latents = vae.encode(waveform.reshape(batch * channels, 1, samples).to(vae.dtype)).latent_dist.mode().float()
    mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(1, -1, 1)
    std = torch.tensor(vae.config.latents_std, device=latents.device).view(1, -1, 1)
    return ((latents - mean) / std).reshape(batch, channels, *latents.shape[1:])


VAES = ("vae", "audio_vae")


def load_encoders(folder: pathlib.Path, components: tuple[str, ...], dtype: torch.dtype) -> Any:
    """diffusers' ``MiniMaxH3ModularPipeline`` of ``folder`` with ``components`` loaded (a modular pipeline's
    ``from_pretrained`` loads none): the text encoder in ``dtype``, the VAEs in fp32 (their released precision,
    FastVideo's ``vae_precision``). A ValueError naming what diffusers could not load (it only logs why)."""
    pipe = diffusers.MiniMaxH3ModularPipeline.from_pretrained(str(folder))
    pipe.load_components(names=list(components), dtype={name: torch.float32 if name in VAES else dtype
                                                        for name in components if name != "tokenizer"})
    missing = [name for name in components if getattr(pipe, name, None) is None]
    if missing:
        raise ValueError(f"{NAME}: diffusers' MiniMaxH3ModularPipeline could not load {', '.join(missing)} from "
                         f"{str(folder)!r} (its log says why)")
    return pipe


ENCODERS = fencoders.Encoders(
    pipeline="MiniMaxH3ModularPipeline", text=("tokenizer", "text_encoder"), encode_text=encode_text,
    encode_video=encode_video, frame_step=17, frame_base=5, pixel_multiple=32, audio=("audio_vae",),
    encode_audio=encode_audio, load=load_encoders)
"""MiniMax-H3's encoders: normalised video and audio latents (its latent spaces are the identity), text at layer 50.
Clip lengths are ``17 n + 5`` (``frame_base`` 5, ``frame_step`` 17; preprocess cuts clips to the longest such
length); :func:`encode_video` refuses others. ``pixel_multiple`` 32: the VAE's 16 times the patch's 2 (the
pipeline's ``canvas_multiple``)."""


MINIMAX_H3 = Family(
    name=NAME,
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=lambda config: skeleton_of(MiniMaxH3Transformer3DModel, config.spec.kwargs, rebuild),
        unit_groups={"transformer_blocks": ("transformer_blocks",),
                     "token_refiner": ("token_refiner.refiner_blocks",)},
        activations=ACTIVATIONS,
        text_groups=frozenset({"token_refiner"}),
        widths=widths,
        whole_graph_refusal="its forward keeps only the valid text tokens (boolean indexing: shapes that depend on the "
                            "mask) and builds the packed row layout on the host from them",
        self_attention=("transformer_blocks.*.attn",),
        vsa_refusal="its self-attention runs over one packed text-audio-video sequence, not the video grid's tokens",
    ),
    forward=Forward(
        inputs=inputs,
        output=output,
    ),
    conditioning=Conditioning(
        spec=cond_spec,
        from_batch=cond_from_batch,
        cfg_dropout_refusal=CFG_DROPOUT_REFUSAL,
        defaults=TEXT_MASK_DEFAULT,
    ),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(
        latent_rule=latent_rule,
        sigma_sampler=sigma_sampler,
        one_sample=ONE_SAMPLE,
    ),
    joint=Joint(
        modalities={"audio": Modality(latents=lambda config: AUDIO_LATENTS,
                                      owns=lambda name: name.startswith(AUDIO_PARAMS))},
        sigmas=lambda config, levels: dict(zip(("video", "audio"), coupled_sigmas(levels))),
    ),
)


class MiniMaxH3Config(ModelConfig, tag="minimax_h3"):
    """A MiniMax-H3 joint video-and-audio DiT (presets: tiny, minimax-h3), trained on both modalities as FastVideo's
    t2va fine-tuning (module docstring)."""

    family = MINIMAX_H3
