"""SkyReels-V2 text-to-video (diffusers ``SkyReelsV2Transformer3DModel``): the family's spec.

SkyReels-V2 is Wan's architecture trained further: its parameter names equal Wan's, it denoises the Wan 2.1 VAE's
latents from UMT5 text embeddings, and it predicts the flow velocity (its pipeline steps ``UniPCMultistepScheduler``
in ``flow_prediction`` mode), so the conditioning, the output and the init rules are Wan's. The 1.3B
diffusion-forcing model also embeds the frame rate (``inject_sample_info``): index 0 for 16 fps, 1 for 24 fps, as its
pipeline passes it; ``SkyReelsV2Config.fps`` chooses it.
"""
from __future__ import annotations

import pathlib
from typing import Any, Literal, Mapping

import torch
from diffusers import SkyReelsV2Transformer3DModel, UniPCMultistepScheduler
from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2RotaryPosEmbed
from torch import nn

from fvx_models import diffusers_folder as dfolder, wan
from fvx_models.build import ModelConfig
from fvx_models.family import Preset, skeleton_of

_SKYREELS = {**wan._WAN, "inject_sample_info": False, "num_frame_per_block": 1}

PRESETS: dict[str, Preset] = {
    "tiny": Preset({**wan.TINY, "inject_sample_info": False, "num_frame_per_block": 1}, wan.TINY_VAE, 8,
                   {"flow_shift": 8.0}),
    "tiny-fps": Preset({**wan.TINY, "inject_sample_info": True, "num_frame_per_block": 1}, wan.TINY_VAE, 8,
                       {"flow_shift": 8.0}),
    "skyreels-v2-t2v-14b": Preset({**_SKYREELS, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40},
                                  wan.WAN21_VAE, 512, {"flow_shift": 8.0}),
    "skyreels-v2-df-1.3b": Preset({**_SKYREELS, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30,
                                   "inject_sample_info": True}, wan.WAN21_VAE, 512, {"flow_shift": 8.0}),
}
"""``SkyReelsV2Transformer3DModel`` constructor arguments per preset (every argument), latent space, text length."""

FPS_INDEX = {16: 0, 24: 1}  # the pipeline's frame-rate embedding index


def rebuild_rope(module: nn.Module) -> None:
    config = module.config
    module.rope = SkyReelsV2RotaryPosEmbed(config.attention_head_dim, config.patch_size, config.rope_max_seq_len)


def inputs(config: SkyReelsV2Config, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    kwargs = {"hidden_states": x_t, "timestep": t, "encoder_hidden_states": wan.masked_text(cond),
              "return_dict": False}
    if config.spec.kwargs["inject_sample_info"]:
        kwargs["fps"] = [FPS_INDEX[config.fps]] * x_t.shape[0]  # the forward makes the tensor
    return kwargs


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``SkyReelsV2Pipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/``
    (``UniPCMultistepScheduler`` on flow sigmas with the preset's shift); copy the VAE, text encoder and tokenizer
    from the base model."""
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                            flow_shift=config.spec.options["flow_shift"]).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "SkyReelsV2Pipeline",
        {"scheduler": ("diffusers", "UniPCMultistepScheduler"),
         "transformer": ("diffusers", "SkyReelsV2Transformer3DModel"), "vae": ("diffusers", "AutoencoderKLWan"),
         "text_encoder": ("transformers", "UMT5EncoderModel"), "tokenizer": ("transformers", "AutoTokenizer")})


SKYREELS_V2 = wan.WAN.variant(
    name="skyreels_v2",
    presets=PRESETS,
    architecture={
        "skeleton": lambda config: skeleton_of(SkyReelsV2Transformer3DModel, config.spec.kwargs, rebuild_rope),
        "sequence_parallel": None,
    },
    forward={"inputs": inputs},
    checkpoints={"pipeline_files": pipeline_files},
)
"""Wan's spec with SkyReels-V2's presets, skeleton, frame-rate input and pipeline; no sequence parallelism."""


class SkyReelsV2Config(ModelConfig, tag="skyreels_v2"):
    """A SkyReels-V2 DiT (presets: tiny, tiny-fps, skyreels-v2-t2v-14b, skyreels-v2-df-1.3b); ``fps`` is the frame
    rate the models with a frame-rate embedding are told (16 or 24). Its data is Wan's: ``SkyReelsV2Pipeline``'s
    ``encode_prompt`` is ``WanPipeline``'s (copied, 512 tokens) and its VAE the Wan 2.1 one, so the encoders are
    Wan's record (a folder opens with the pipeline its ``model_index.json`` names)."""

    family = SKYREELS_V2

    fps: Literal[16, 24] = 24
