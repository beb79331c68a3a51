"""AnyFlow (diffusers ``AnyFlowTransformer3DModel``, NVIDIA's released flow-map checkpoints such as
``nvidia/AnyFlow-Wan2.1-T2V-1.3B-Diffusers``): the family's spec.

The architecture is Wan 2.1's with the time embedding of a flow map: ``(1 - g) temb(t) + g demb(r)`` (``gate_value``
g, ``deltatime_type`` r or t - r), its output the average velocity ``u(x_t, t, r)`` from ``t`` to ``r`` (``x_r = x_t -
((t - r) / 1000) u``): a two-time model (``Model.rules.two_time``), ``r`` left out being ``t``. Its params are named as a
Wan's plus ``condition_embedder.delta_embedder``, so a two-time Wan (``fvx_models.wan_two_time``, gated) computes the
same function from the same params (tests/fvx_models/test_wan_two_time.py). The transformer takes frames first,
``[B, F, C, H, W]``, and one timestep per latent frame; fvx passes the sample's to every frame.
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

import torch
from diffusers import AnyFlowTransformer3DModel, FlowMatchEulerDiscreteScheduler
from diffusers.models.transformers.transformer_anyflow import AnyFlowRotaryPosEmbed
from torch import nn

from fvx_models import diffusers_folder as dfolder, wan
from fvx_models.build import ModelConfig
from fvx_models.family import (Architecture, Checkpoints, Conditioning, Family, Forward, Preset, TEXT_MASK_DEFAULT,
                               skeleton_of)

_ANYFLOW = {key: value for key, value in wan.WAN21_1_3B.items()
            if key not in ("qk_norm", "added_kv_proj_dim", "pos_embed_seq_len")}
FLOW_MAP = {"gate_value": 0.25, "deltatime_type": "r"}
TINY = {**{key: value for key, value in wan.TINY.items() if key in _ANYFLOW}, **FLOW_MAP}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(TINY, wan.TINY_VAE, 8, {"flow_shift": 3.0}),
    "anyflow-wan2.1-t2v-1.3b": Preset({**_ANYFLOW, **FLOW_MAP}, wan.WAN21_VAE, 512, {"flow_shift": 5.0}),
    "anyflow-wan2.1-t2v-14b": Preset({**{key: value for key, value in wan.WAN21_14B.items() if key in _ANYFLOW},
                                      **FLOW_MAP}, wan.WAN21_VAE, 512, {"flow_shift": 5.0}),
}
"""``AnyFlowTransformer3DModel`` constructor arguments per preset (Wan 2.1's sizes with gate 0.25 and delta r), the
latent space and the text length."""


def rebuild_buffers(module: nn.Module) -> None:
    """Recompute the RoPE tables and the gate (pure functions of the config) on the CPU in a module built on meta."""
    config = module.config
    module.rope = AnyFlowRotaryPosEmbed(config.attention_head_dim, config.patch_size, config.rope_max_seq_len)
    module.condition_embedder.register_buffer("delta_emb_gate", torch.tensor([config.gate_value]), persistent=False)


def per_frame(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t [B]`` as one timestep per latent frame ``[B, F]`` of ``x [B, F, C, H, W]``."""
    return t[:, None].expand(x.shape[0], x.shape[1])


def inputs(config: ModelConfig, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    return {"hidden_states": x, "timestep": per_frame(x, t),
            "encoder_hidden_states": wan.masked_text(cond), "return_dict": False}


def with_r(config: ModelConfig, kwargs: dict[str, Any], x: torch.Tensor, r: torch.Tensor) -> dict[str, Any]:
    return {**kwargs, "r_timestep": per_frame(x, r)}


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``AnyFlowPipeline`` files beside the exported ``transformer/``: ``model_index.json`` and
    ``scheduler/``. The VAE, text encoder and tokenizer are the base Wan's: copy them from it."""
    FlowMatchEulerDiscreteScheduler(shift=config.spec.options["flow_shift"]).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "AnyFlowPipeline",
        {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
         "transformer": ("diffusers", "AnyFlowTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLWan"),
         "text_encoder": ("transformers", "UMT5EncoderModel"), "tokenizer": ("transformers", "AutoTokenizer")})


ANYFLOW = Family(
    name="anyflow",
    presets=PRESETS,
    encoders=wan.ENCODERS,
    architecture=Architecture(
        skeleton=lambda config: skeleton_of(AnyFlowTransformer3DModel, config.spec.kwargs, rebuild_buffers),
        unit_groups={"blocks": ("blocks",)},
        activations={"blocks": wan.PER_TOKEN_T_ACTIVATIONS["blocks"]},
        widths=wan.widths,
        init_rules={"scale_shift_table": wan.scale_shift_init},
        self_attention=("blocks.*.attn1",),
    ),
    forward=Forward(
        inputs=inputs,
        layout="BTCHW",
        with_r=with_r,
    ),
    conditioning=Conditioning(
        spec=wan.text_cond_spec,
        from_batch=wan.text_cond_from_batch,
        defaults=TEXT_MASK_DEFAULT,
    ),
    checkpoints=Checkpoints(pipeline_files=pipeline_files),
)


class AnyFlowConfig(ModelConfig, tag="anyflow"):
    """An AnyFlow flow-map DiT (presets: tiny, anyflow-wan2.1-t2v-1.3b, anyflow-wan2.1-t2v-14b): a two-time model;
    the shared knobs are :class:`fvx_models.build.ModelConfig`'s. Its data is Wan 2.1's (``AnyFlowPipeline``'s
    ``encode_prompt`` is ``WanPipeline``'s, copied; the Wan 2.1 VAE): the encoders are Wan's record."""

    family = ANYFLOW

    @property
    def two_time(self) -> bool:
        return True
