"""Wan 2.2 VACE-Fun A14B (alibaba-pai/Wan2.2-VACE-Fun-A14B): Wan 2.2 A14B's two experts, each a Wan VACE DiT
(diffusers ``WanVACETransformer3DModel`` twice), the family's spec.

Each expert is Wan 2.1 VACE 14B's architecture (diffusers' ``convert_wan_to_diffusers.py``, model type
``Wan2.2-VACE-Fun-14B``: the 14B with context blocks at layers 0, 5, ..., 35 and a 96-channel context), and
``WanVACEPipeline(transformer, transformer_2, boundary_ratio=0.875)`` routes each call by its timestep as Wan 2.2
A14B T2V's pipeline does (``fvx_models.wan_moe``: the router, one expert's timestep range per fine-tuning step). Both
experts read the same control context (``data.kind=vace``: ``fvx_models.wan_vace``), the router splitting it by
sample with the latents. ``trainable`` names the experts that train and ``parts`` their parts (the base DiT, the
context branch: DiffSynth-Studio's full recipe for this model trains the context branch alone); ``context_scale`` is
the pipeline's ``conditioning_scale``.
"""
from __future__ import annotations

import pathlib
from typing import Any, Literal, Mapping

import msgspec
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanVACETransformer3DModel
from typing_extensions import Annotated

from fvx_models import diffusers_folder as dfolder, wan, wan_moe, wan_vace
from fvx_models.build import ModelConfig
from fvx_models.family import Preset, check_trainable, skeleton_of

EXPERTS = wan_moe.EXPERTS
# the converter's scheduler for every Wan 2.2 model but TI2V, Animate and FLF2V (UniPC at flow shift 3) and its
# boundary_ratio for the VACE-Fun pipeline
OPTIONS = {"flow_shift": 3.0, "boundary_ratio": 0.875}
PRESETS: dict[str, Preset] = {
    "tiny": Preset(wan_vace.PRESETS["tiny"].kwargs, wan.TINY_VAE, 8, OPTIONS),
    "world": Preset(wan_vace.PRESETS["world"].kwargs, wan.WORLD_CODEC, 4, OPTIONS),
    "wan2.2-vace-fun-a14b": Preset(wan_vace.PRESETS["wan2.1-vace-14b"].kwargs, wan.WAN21_VAE, 512, OPTIONS),
}
"""Each expert's ``WanVACETransformer3DModel`` arguments per preset (Wan VACE's), the latent space, the text length,
and the pipeline's flow shift and boundary."""


def skeleton(config: WanVACEMoEConfig) -> wan_moe.TwoExperts:
    high, low = (skeleton_of(WanVACETransformer3DModel, config.spec.kwargs, wan.rebuild_rope) for _ in EXPERTS)
    return wan_moe.TwoExperts(high, low, wan_moe.boundary_timestep(config))


def inputs(config: WanVACEMoEConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """The router's arguments: Wan's, each sample's context and the context scale (``wan_vace.context_inputs``)."""
    per_sample = wan_vace.context_inputs(config, x_t, cond)
    shared = {name: per_sample.pop(name) for name in ("control_hidden_states_scale",) if name in per_sample}
    return {**wan_moe.inputs(config, x_t, t, cond, sharded), "per_sample": per_sample, "shared": shared}


def pipeline_files(config: WanVACEMoEConfig, folder: pathlib.Path) -> None:
    """diffusers' ``WanVACEPipeline`` files of two experts beside ``transformer/`` and ``transformer_2/``
    (``boundary_ratio``, the scheduler at the preset's flow shift); copy the VAE, text encoder and tokenizer."""
    FlowMatchEulerDiscreteScheduler(shift=config.spec.options["flow_shift"]).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "WanVACEPipeline",
        {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
         **{expert: ("diffusers", "WanVACETransformer3DModel") for expert in EXPERTS},
         "vae": ("diffusers", "AutoencoderKLWan"), "text_encoder": ("transformers", "UMT5EncoderModel"),
         "tokenizer": ("transformers", "AutoTokenizer")},
        boundary_ratio=config.boundary)


WAN_VACE_MOE = wan_vace.WAN_VACE.variant(
    name="wan_vace_moe",
    presets=PRESETS,
    architecture={
        "skeleton": skeleton,
        "unit_groups": {"blocks": wan_moe.per_expert(("blocks",)), "vace_blocks": wan_moe.per_expert(("vace_blocks",))},
        "self_attention": wan_moe.per_expert(("blocks.*.attn1", "vace_blocks.*.attn1")),
        "linear_qat": wan_moe.per_expert(wan.NVFP4_LINEARS),
        "whole_graph_refusal": wan_moe.ROUTER_REFUSAL,
    },
    forward={"inputs": inputs},
    checkpoints=wan_moe.expert_checkpoints(pipeline_files),
    training={"step_ranges": wan_moe.step_ranges},
)
"""Wan VACE's spec with two experts (Wan 2.2 A14B's router and training ranges): both experts' blocks one unit group,
their context blocks another."""


class WanVACEMoEConfig(ModelConfig, tag="wan_vace_moe"):
    """Wan 2.2 VACE-Fun A14B's two VACE experts (presets: tiny, world, wan2.2-vace-fun-a14b): ``boundary_ratio``
    routes a call to ``transformer`` when ``t >= 1000 boundary_ratio`` (None: the pipeline's 0.875);
    ``train_boundary_ratio`` is where fine-tuning splits the experts' timesteps (None: at the router's; DiffSynth-Studio
    trains this model's high-noise expert from t = 900); ``trainable`` names the experts that train, ``parts`` what of
    them (``base``, ``context``), ``context_scale`` the hints' scale (``fvx_models.wan_vace``). Fine-tuning trains one
    of the trainable experts per step. Data: ``data.kind=vace``."""

    family = WAN_VACE_MOE

    boundary_ratio: Annotated[float, msgspec.Meta(gt=0, lt=1)] | None = None
    train_boundary_ratio: Annotated[float, msgspec.Meta(gt=0, lt=1)] | None = None
    trainable: tuple[Literal["transformer", "transformer_2"], ...] = EXPERTS
    parts: tuple[Literal["base", "context"], ...] = wan_vace.PARTS
    context_scale: float | tuple[float, ...] = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_trainable(self.trainable, EXPERTS, "expert")
        check_trainable(self.parts, wan_vace.PARTS, "part", field="parts")
        wan_vace.context_scales(self)

    @property
    def boundary(self) -> float:
        return self.spec.options["boundary_ratio"] if self.boundary_ratio is None else self.boundary_ratio

    @property
    def train_boundary(self) -> float:
        return self.boundary if self.train_boundary_ratio is None else self.train_boundary_ratio

    def frozen(self, name: str) -> bool:
        expert, _, local = name.partition(".")
        return expert not in self.trainable or wan_vace.frozen_part(local, self.parts)
