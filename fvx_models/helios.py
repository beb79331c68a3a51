"""Helios (diffusers ``HeliosTransformer3DModel``): a Wan 2.1-based model that makes a long video chunk by chunk,
the family's spec.

Each chunk of latent frames is denoised beside its multi-term memory, unnoised: the clip's first frame and the newest
frame (``patch_short``), the two before (``patch_mid``, 2x coarser) and the sixteen before those (``patch_long``, 4x
coarser), each at its RoPE time position and at timestep 0 (``zero_history_timestep``). The data is Helios's sections
(``data.kind=framepack``, ``data.sections.order=chunks``: the clip tiled by chunks from its first frame, the first
chunk given no first frame), so the velocity loss (``noise - x0``: its scheduler's ``flow_prediction``) covers the
chunk alone, as Helios's ``train_helios.py`` trains it. Its training corrupts the memory (``corrupt_cond``, the
stage-1 recipe of its ``stage_1_init.yaml``, read in ``helios/utils/utils_helios_base.py``): with probability 0.4 all of
it and the first frame are zeroed (text-to-video), else with probability 0.4 its oldest ``19 % W + n W`` frames (``n``
uniform in ``0 .. 19 // W``, ``W`` the chunk), then, but in one sample of ten, every frame of a group that is not all
zeros (the first frame; then the oldest ``19 % W``; then each ``W``) gets its own noise, ``x = s e + (1 - s) x``,
``s ~ U(0, 1/3)``. Helios draws the drops and the clean case once per batch; fvx draws them per sample, from the
sample's key. The text is UMT5's, zero-padded (Wan's), the latents the Wan 2.1 VAE's, normalised. Unlike FramePack's,
its RoPE takes one set of positions per sample, so a forward takes a batch.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Mapping

import torch
from diffusers import HeliosScheduler, HeliosTransformer3DModel
from diffusers.models.transformers.transformer_helios import HeliosRotaryPosEmbed
from torch import nn

from fvx.core import random
from fvx.distributed import memory
from fvx.data.sections import HISTORY
from fvx_models import diffusers_folder as dfolder, encoders as fencoders, history, wan
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Conditioning, Family, Forward, Preset, TEXT_MASK_DEFAULT,
                               Training, skeleton_of)

_HELIOS = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, added_kv_proj_dim=None, rope_dim=(44, 42, 42),
               rope_theta=10000.0, guidance_cross_attn=True, zero_history_timestep=True,
               has_multi_term_memory_patch=True, is_amplify_history=False, history_scale_mode="per_head")
_TINY = {**_HELIOS, "num_attention_heads": 2, "attention_head_dim": 48, "text_dim": 32, "freq_dim": 32,
         "ffn_dim": 192, "num_layers": 2, "rope_dim": (16, 16, 16)}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(_TINY, wan.TINY_VAE, 8),
    # the toy world's (48-channel space-to-depth 4 latents, 4 text tokens)
    "world": Preset({**_TINY, "in_channels": 48, "out_channels": 48, "num_attention_heads": 4,
                     "attention_head_dim": 64, "ffn_dim": 512, "num_layers": 3, "rope_dim": (24, 20, 20)},
                    wan.WORLD_CODEC_4, 4),
    # BestWishYsh/Helios-Base (-Mid, -Distilled): diffusers' constructor defaults, Wan 2.1 14B's
    "helios": Preset(_HELIOS, wan.WAN21_VAE, 512),
}
"""``HeliosTransformer3DModel`` constructor arguments per preset (every argument), the latent space and the text
length (UMT5 at 512 tokens, its pipeline's)."""

CHUNK_FRAMES = 33  # video frames of a chunk (9 latent frames): Helios encodes and decodes each chunk on its own
DROP_ALL, DROP_OLDEST, CLEAN, CORRUPT = 0.4, 0.4, 0.1, 1 / 3  # stage_1_init.yaml's corruption


def rebuild_rope(module: nn.Module) -> None:
    """Recompute the RoPE frequencies (buffers, a function of the config) on the CPU in a module built on meta."""
    module.rope = HeliosRotaryPosEmbed(rope_dim=module.config.rope_dim, theta=module.config.rope_theta)


def cond_spec(config: ModelConfig) -> dict[str, tuple]:
    return {**wan.text_cond_spec(config), **history.cond_spec(config)}


def cond_from_batch(config: ModelConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {**wan.text_cond_from_batch(config, batch), **history.cond_from_batch(config, batch)}


def inputs(config: ModelConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """The DiT's arguments as ``HeliosPipeline`` passes them: the chunk, ``t = 1000 sigma``, the zero-padded text, the
    memory as short (first frame and newest), mid and long latents with their positions ``[B, T]``."""
    parts = history.split(cond, x_t.shape[2], x_t.dtype)
    (short, mid, long), (at_chunk, at_short, at_mid, at_long) = parts["latents"], parts["positions"]
    return {"hidden_states": x_t, "timestep": t, "encoder_hidden_states": wan.masked_text(cond),
            "indices_hidden_states": at_chunk, "indices_latents_history_short": at_short,
            "indices_latents_history_mid": at_mid, "indices_latents_history_long": at_long,
            "latents_history_short": short, "latents_history_mid": mid, "latents_history_long": long,
            "return_dict": False}


def corrupt_cond(config: ModelConfig, keys: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Helios's training corruption of the memory (module docstring), one draw per sample from ``keys [B, 2]``."""
    window = cond["frame_indices"].shape[1] - HISTORY
    return {**cond, "framepack_history": corrupt_history(keys, cond["framepack_history"], window)}


# Each memory slot's age among the 19 frames before the chunk, oldest first (-1: the first frame): the slots are
# [first | newest | 2 mid | 16 long] (fvx.data.sections), the long frames the oldest
AGES = torch.tensor([-1, 18, 16, 17, *range(16)])
RESOLUTION = 1 << 24  # uniform draws as integers over this many steps


def corrupt_history(keys: torch.Tensor, latents: torch.Tensor, window: int) -> torch.Tensor:
    """The memories ``[B, C, 20, H, W]`` corrupted as Helios's training corrupts them, sample ``b`` from ``keys[b]``:
    dropped (all of it with the first frame, or its oldest frames), then noised frame by frame, a group of frames
    left as it is when all zeros (module docstring)."""
    batch, frames = latents.shape[0], latents.shape[2]
    streams = torch.vmap(lambda key: random.split(key, 4))(keys)
    coins = random.randint_each(streams[:, 0], (3,), 0, RESOLUTION).float() / RESOLUTION
    tail = (HISTORY - 1) % window
    dropped = tail + window * random.randint_each(streams[:, 1], (), 0, (HISTORY - 1) // window + 1)
    sigmas = random.randint_each(streams[:, 2], (frames,), 0, RESOLUTION).float() / RESOLUTION * CORRUPT
    noise = random.normal_each(streams[:, 3], tuple(latents.shape[1:]), device=latents.device)
    ages = AGES.to(latents.device)
    drop_all = coins[:, 0] < DROP_ALL
    drop_oldest = ~drop_all & (coins[:, 1] < DROP_OLDEST)
    zeroed = drop_all[:, None] | (drop_oldest[:, None] & (ages >= 0) & (ages < dropped[:, None]))
    latents = latents * ~zeroed.view(batch, 1, frames, 1, 1)
    groups = torch.nn.functional.one_hot(torch.where(ages < 0, 0, torch.where(
        ages < tail, 1, 2 + (ages - tail) // window))).float()  # [20, groups]: the first frame, the tail, windows
    present = (latents.abs().sum(dim=(1, 3, 4)) > 0).float() @ groups > 0  # [B, groups]: not all zeros
    noised = ((present.float() @ groups.T) > 0) & (coins[:, 2] >= CLEAN)[:, None]
    sigma = sigmas.view(batch, 1, frames, 1, 1).to(latents.dtype)
    return torch.where(noised.view(batch, 1, frames, 1, 1), sigma * noise + (1 - sigma) * latents, latents)


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``HeliosPipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/`` (one stage,
    as ``HeliosPipeline`` steps it); copy the VAE, text encoder and tokenizer from the base model."""
    HeliosScheduler(stages=1).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "HeliosPipeline",
        {"scheduler": ("diffusers", "HeliosScheduler"), "transformer": ("diffusers", "HeliosTransformer3DModel"),
         "vae": ("diffusers", "AutoencoderKLWan"), "text_encoder": ("transformers", "UMT5EncoderModel"),
         "tokenizer": ("transformers", "AutoTokenizer")})


def encode_video(pipe: Any, video: torch.Tensor) -> torch.Tensor:
    """The VAE's posterior mean of each 33-frame chunk encoded on its own, as Helios's data (its
    ``get_short-latents.py``) and pipeline encode and decode a video."""
    return torch.cat([fencoders.latent_mean(pipe.vae, video[:, :, start:start + CHUNK_FRAMES])
                      for start in range(0, video.shape[2], CHUNK_FRAMES)], dim=2)


def decode_video(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    """Each chunk's latent frames decoded on its own."""
    chunk = (CHUNK_FRAMES - 1) // 4 + 1
    return torch.cat([pipe.vae.decode(latents[:, :, start:start + chunk]).sample
                      for start in range(0, latents.shape[2], chunk)], dim=2)


ENCODERS = dataclasses.replace(
    wan.ENCODERS, pipeline="HeliosPipeline", encode_video=encode_video, decode_video=decode_video,
    frame_base=CHUNK_FRAMES, frame_step=CHUNK_FRAMES, image=(), encode_image=None, first_frame=None,
    audio_refusal="Helios makes no sound")
"""Wan's UMT5 text at 512 tokens; the Wan 2.1 VAE's posterior mean, chunk by chunk of 33 frames (clips of 33 k)."""


HELIOS = Family(
    name="helios",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture=Architecture(
        skeleton=lambda config: skeleton_of(HeliosTransformer3DModel, config.spec.kwargs, rebuild_rope),
        unit_groups={"blocks": ("blocks",)},
        # measured (saved-tensor hooks, bf16, the slope per token of the tiny model's chunk and history tokens): Wan's
        # block with a timestep per token (the history's are 0), its modulation in fp32
        activations={"blocks": memory.BlockActivations(fp32_dim=19, compute_dim=11, compute_ffn=2)},
        widths=wan.widths,
        init_rules={"scale_shift_table": wan.scale_shift_init},
        self_attention=("blocks.*.attn1",),
        vsa_refusal="its self-attention runs over the memory's tokens before the chunk's",
    ),
    forward=Forward(inputs=inputs),
    conditioning=Conditioning(spec=cond_spec, from_batch=cond_from_batch, image=frozenset(history.NAMES),
                              data_keys=("text", "text_mask", *history.NAMES), defaults=TEXT_MASK_DEFAULT),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
    training=Training(corrupt_cond=corrupt_cond),
)


class HeliosConfig(ModelConfig, tag="helios"):
    """A Helios DiT (presets: tiny, world, helios)."""

    family = HELIOS
