"""Wan 2.2 A14B text- and image-to-video: two Wan-14B experts (diffusers ``WanTransformer3DModel`` twice), the
family's spec.

The pipeline routes each denoising call by its timestep: ``transformer`` (the high-noise expert) takes
``t >= boundary_ratio * 1000``, ``transformer_2`` (low noise) the rest; 0.875 for T2V, 0.9 for I2V, whose experts
take the given first frame in the ``concat`` form (``fvx_models.wan_i2v``; no image embedding). The router sends each
sample by its own timestep, so a batch whose samples straddle the boundary runs each expert on its own samples (what
the distillation methods' draws give). Fine-tuning trains one expert per step, as FastVideo's trainer does
(:func:`step_ranges`): the low-noise expert with probability ``boundary_ratio``, else the high-noise one, every
sample of the step drawn in the chosen expert's range, so the router sends the whole batch to it. Params are one
flat dict with each expert's under its pipeline component's name (``transformer.blocks.0. ...``,
``transformer_2.blocks.0. ...``), and both experts' blocks form one unit group (one compiled graph). Either expert
can be left frozen (``Wan22MoEConfig.trainable``). Conditioning, latents (the Wan 2.1 VAE's) and output are Wan
2.1's.

Sharded, every rank runs both experts in every call, so that all ranks issue the same gathers and reduce-scatters: an
expert with no sample of this rank's slice runs on one sample and adds zero times its output (its gradients are
exactly zero).
"""
from __future__ import annotations

import math
import pathlib
from typing import Any, Literal, Mapping

import msgspec
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from torch import nn
from typing_extensions import Annotated

from fvx_models import diffusers_folder as dfolder, wan, wan_i2v
from fvx_models.build import ModelConfig
from fvx_models.family import Preset, check_trainable, skeleton_of
from fvx_models.model import StepRange

EXPERTS = ("transformer", "transformer_2")  # high noise, low noise: the pipeline's component names

T2V = {"flow_shift": 12.0, "boundary_ratio": 0.875}
I2V = {"flow_shift": 5.0, "boundary_ratio": 0.9, "i2v": wan_i2v.CONCAT}
PRESETS: dict[str, Preset] = {
    "tiny": Preset(wan.TINY, wan.TINY_VAE, 8, T2V),
    "tiny-i2v": Preset({**wan.TINY, "in_channels": 36}, wan.TINY_VAE, 8, I2V),
    "wan2.2-t2v-a14b": Preset(wan.WAN21_14B, wan.WAN21_VAE, 512, T2V),
    "wan2.2-i2v-a14b": Preset({**wan.WAN21_14B, "in_channels": 36}, wan.WAN21_VAE, 512, I2V),
}
"""The ``WanTransformer3DModel`` arguments of each expert per preset, the latent space, the text length, and the
pipeline's flow shift and boundary."""


class TwoExperts(nn.Module):
    """The two experts and the router between them: ``forward`` takes Wan's arguments for the whole batch and runs
    ``transformer`` on the samples with ``t >= boundary`` and ``transformer_2`` on the others; a variant's further
    arguments are ``per_sample`` (batch-first tensors, split alike: VACE's context) or ``shared`` (given whole)."""

    def __init__(self, high: nn.Module, low: nn.Module, boundary: float):
        super().__init__()
        self.transformer, self.transformer_2 = high, low
        self.boundary = boundary

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                run_idle_experts: bool = False, return_dict: bool = False,
                per_sample: Mapping[str, torch.Tensor] | None = None,
                shared: Mapping[str, Any] | None = None) -> tuple[torch.Tensor]:
        high = timestep >= self.boundary
        channels = self.transformer_2.config.out_channels  # the input may carry an image condition besides x_t
        out = hidden_states.new_zeros(hidden_states.shape[0], channels, *hidden_states.shape[2:])
        rows = {"hidden_states": hidden_states, "timestep": timestep, "encoder_hidden_states": encoder_hidden_states,
                **(per_sample or {})}

        def call(expert: nn.Module, index: Any) -> torch.Tensor:
            return expert(**{name: x[index] for name, x in rows.items()}, **(shared or {}), return_dict=False)[0]

        for expert, chosen in ((self.transformer, high), (self.transformer_2, ~high)):
            index = chosen.nonzero().flatten()
            if index.numel():
                out = out.index_copy(0, index, call(expert, index))
            elif run_idle_experts:
                out = out + 0.0 * call(expert, slice(0, 1)).sum()
        return (out,)


def skeleton(config: Wan22MoEConfig) -> TwoExperts:
    kwargs = config.spec.kwargs
    high, low = (skeleton_of(WanTransformer3DModel, kwargs, wan.rebuild_rope) for _ in EXPERTS)
    return TwoExperts(high, low, boundary_timestep(config))


def boundary_timestep(config: Wan22MoEConfig) -> float:
    """The timestep (0..1000) from which the router takes the high-noise expert: ``1000 boundary_ratio``."""
    return config.boundary * 1000.0


def step_ranges(config: Wan22MoEConfig) -> tuple[StepRange, ...]:
    """The expert a fine-tuning step trains, as FastVideo's trainer picks it (``fastvideo/training/
    training_pipeline.py:311-343``): the low-noise ``transformer_2`` with probability ``boundary_ratio`` (its
    ``rand <= boundary_ratio``), at the timesteps below the boundary, else the high-noise ``transformer``, at those
    from the boundary up, where the router sends them. FastVideo draws the high-noise expert's timesteps over the whole
    range (its restriction to the expert's own range is commented out there); fvx keeps each expert to the timesteps
    it denoises when sampled, or to those of ``config.train_boundary`` where a recipe splits them elsewhere. Only the
    experts in ``trainable``, their probabilities renormalised (one trained expert trains every step)."""
    ratio = config.train_boundary
    ranges = {"transformer_2": StepRange(ratio, 0.0, 1000.0 * ratio),
              "transformer": StepRange(1.0 - ratio, 1000.0 * ratio, math.inf)}
    trained = [ranges[expert] for expert in ("transformer_2", "transformer") if expert in config.trainable]
    total = sum(part.probability for part in trained)
    return tuple(part._replace(probability=part.probability / total) for part in trained)


def inputs(config: Wan22MoEConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    return {"hidden_states": wan.image_input(config, x_t, cond), "timestep": t,
            "encoder_hidden_states": wan.masked_text(cond), "run_idle_experts": sharded, "return_dict": False}


def pipeline_files(config: Wan22MoEConfig, folder: pathlib.Path) -> None:
    """diffusers' ``WanPipeline`` files of a two-expert pipeline beside ``transformer/`` and ``transformer_2/``
    (``boundary_ratio``, the scheduler with the preset's flow shift); copy the VAE, text encoder and tokenizer."""
    FlowMatchEulerDiscreteScheduler(shift=config.spec.options["flow_shift"]).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "WanImageToVideoPipeline" if "i2v" in config.spec.options else "WanPipeline",
        {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
         "transformer": ("diffusers", "WanTransformer3DModel"), "transformer_2": ("diffusers", "WanTransformer3DModel"),
         "vae": ("diffusers", "AutoencoderKLWan"), "text_encoder": ("transformers", "UMT5EncoderModel"),
         "tokenizer": ("transformers", "AutoTokenizer")},
        boundary_ratio=config.boundary, expand_timesteps=False)


ROUTER_REFUSAL = "its router splits the batch between the experts by timestep (data-dependent shapes)"


def per_expert(patterns: tuple[str, ...]) -> tuple[str, ...]:
    """Module name ``patterns`` of one expert, for both (``transformer.<pattern>``, ``transformer_2.<pattern>``)."""
    return tuple(f"{expert}.{pattern}" for expert in EXPERTS for pattern in patterns)


def expert_checkpoints(files: Any) -> dict[str, Any]:
    """A two-expert family's checkpoint fields: each expert a pipeline component (tagged with Comfy-Org's and
    musubi-tuner's names), and its pipeline's ``files``."""
    return {"components": {expert: f"{expert}." for expert in EXPERTS}, "pipeline_files": files,
            "component_notes": {"transformer": "the high-noise expert", "transformer_2": "the low-noise expert"},
            "component_tags": {"transformer": "high_noise", "transformer_2": "low_noise"}}


WAN_MOE = wan.WAN.variant(
    name="wan_moe",
    presets=PRESETS,
    architecture={
        "skeleton": skeleton,
        "unit_groups": {"blocks": per_expert(("blocks",))},
        "sequence_parallel": None,
        "self_attention": per_expert(("blocks.*.attn1",)),
        "linear_qat": per_expert(wan.NVFP4_LINEARS),
        "whole_graph_refusal": ROUTER_REFUSAL,
    },
    forward={"inputs": inputs},
    checkpoints=expert_checkpoints(pipeline_files),
    training={"step_ranges": step_ranges},
)
"""Wan's spec with two experts: their components, one unit group of both experts' blocks, the router's inputs, one
expert's timestep range per training step and the two-expert pipeline; no sequence parallelism."""

class Wan22MoEConfig(ModelConfig, tag="wan_moe"):
    """Wan 2.2 A14B's two experts (presets: tiny, tiny-i2v, wan2.2-t2v-a14b, wan2.2-i2v-a14b): ``boundary_ratio``
    routes a call to ``transformer`` when ``t >= 1000 boundary_ratio`` (None: the preset's pipeline's, 0.875 for T2V
    and 0.9 for I2V), and ``trainable`` names the experts that train (the others stay as loaded). Fine-tuning trains
    one of the trainable experts per step (:func:`step_ranges`)."""

    family = WAN_MOE

    boundary_ratio: Annotated[float, msgspec.Meta(gt=0, lt=1)] | None = None
    trainable: tuple[Literal["transformer", "transformer_2"], ...] = EXPERTS

    def __post_init__(self) -> None:
        super().__post_init__()
        check_trainable(self.trainable, EXPERTS, "expert")

    @property
    def boundary(self) -> float:
        return self.spec.options["boundary_ratio"] if self.boundary_ratio is None else self.boundary_ratio

    @property
    def train_boundary(self) -> float:
        """Where fine-tuning splits the experts' timesteps: at the router's boundary."""
        return self.boundary

    def frozen(self, name: str) -> bool:
        return not name.startswith(tuple(f"{expert}." for expert in self.trainable))
