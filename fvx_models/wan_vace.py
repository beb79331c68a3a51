"""Wan 2.1 VACE (diffusers ``WanVACETransformer3DModel``): Wan 2.1 T2V with a control branch.

VACE adds context blocks to Wan: ``vace_patch_embedding`` embeds the control context and ``vace_blocks`` (one per
entry of ``vace_layers``) run over it; block ``i`` adds its hint to the output of main block ``vace_layers[i]``. The
context ``vace_context [B, 2 C + s^2, T, H, W]`` (96 channels on the Wan 2.1 VAE) is what ``WanVACEPipeline`` builds:

- the normalised VAE latents of the control video outside its mask (``inactive``: kept) and inside it (``reactive``:
  to be made), ``C`` channels each (``prepare_video_latents``);
- the pixel mask packed ``s x s`` pixels to a latent cell (``s`` the VAE's spatial stride: 64 channels) and sampled to
  the latent frames with ``nearest-exact`` (``prepare_masks``; :func:`pack_mask`);
- reference images as extra latent frames in front (their latents, zeros, a zero mask), of the context and of the
  video latents alike: the pipeline denoises them with the video and drops them after.

Training is Wan's flow matching on every latent frame the pipeline denoises, reference frames included; the context
enters as it is (``control_hidden_states``), its hints at the config's ``context_scale`` (the pipeline's
``conditioning_scale``: one, as VACE trains; a sampling knob, e.g. ``sample RUN models.student.context_scale=0.7``,
one value or one per context block). The unconditional of guidance keeps the context (the pipeline passes it to both
calls): it is in ``Conditioning.image``. ``trainable`` picks what trains: the base DiT, the context branch (VACE's own
context-adapter tuning trains only it), or both.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any, Literal, Mapping

import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler, WanVACETransformer3DModel
from torch import nn

from fvx_models import diffusers_folder as dfolder, encoders as fencoders, wan
from fvx_models.build import ModelConfig
from fvx_models.family import Preset, check_trainable, require, skeleton_of

CONTEXT = "vace_context"  # the cond tensor and the data batch key (parquet column of data.kind='vace')
CONTEXT_PARAMS = ("vace_patch_embedding.", "vace_blocks.")  # the context branch's params
PARTS = ("base", "context")


def context_channels(latent_channels: int, spatial_stride: int) -> int:
    """The context's width: inactive and reactive latents, then the mask packed ``stride x stride`` to a cell."""
    return 2 * latent_channels + spatial_stride ** 2


def _vace(kwargs: Mapping[str, Any], latents: Any, layers: list[int]) -> dict[str, Any]:
    return {**kwargs, "vace_layers": layers,
            "vace_in_channels": context_channels(latents.channels, latents.vae_stride[1])}


PRESETS: dict[str, Preset] = {
    "tiny": Preset(_vace(wan.TINY, wan.TINY_VAE, [0, 1]), wan.TINY_VAE, 8, {"flow_shift": 3.0}),
    # the toy world's control model (192-channel space-to-depth latents, the mask at 8 x 8 pixels a cell: 448 wide)
    "world": Preset(_vace(wan.PRESETS["world"].kwargs, wan.WORLD_CODEC, [0, 2]), wan.WORLD_CODEC, 4,
                    {"flow_shift": 3.0}),
    # Wan-AI/Wan2.1-VACE-1.3B-diffusers and -14B-diffusers (480p and 720p models: their pipelines' flow shifts)
    "wan2.1-vace-1.3b": Preset(_vace(wan.WAN21_1_3B, wan.WAN21_VAE, list(range(0, 30, 2))), wan.WAN21_VAE, 512,
                               {"flow_shift": 3.0}),
    "wan2.1-vace-14b": Preset(_vace(wan.WAN21_14B, wan.WAN21_VAE, list(range(0, 40, 5))), wan.WAN21_VAE, 512,
                              {"flow_shift": 5.0}),
}
"""``WanVACETransformer3DModel`` constructor arguments per preset (Wan's, ``vace_layers`` and ``vace_in_channels``;
the released ones from diffusers' ``convert_wan_to_diffusers.py``), the latent space and the text length."""


def skeleton(config: ModelConfig) -> nn.Module:
    return skeleton_of(WanVACETransformer3DModel, config.spec.kwargs, wan.rebuild_rope)


def cond_spec(config: ModelConfig) -> dict[str, tuple]:
    return {**wan.text_cond_spec(config), CONTEXT: (config.spec.kwargs["vace_in_channels"], "T", "H", "W")}


def cond_from_batch(config: ModelConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Wan's text and the VACE context (parquet column ``vace_context`` of ``data.kind='vace'`` data); a ValueError
    names the column and the shape it must have: ``[B, vace_in_channels]`` and the latents' frames and size."""
    who = f"{config.family.name}:{config.preset}"
    require(batch, (CONTEXT,), who, f"the control context: parquet column {CONTEXT} of data.kind='vace' data")
    context, channels = batch[CONTEXT], config.spec.kwargs["vace_in_channels"]
    grid = tuple(batch["latents"].shape[2:]) if "latents" in batch else None
    if context.dim() != 5 or context.shape[1] != channels or grid not in (None, tuple(context.shape[2:])):
        want = ", ".join(map(str, (channels, *(grid or ("T", "H", "W")))))
        raise ValueError(f"{who}: column {CONTEXT} is {list(context.shape)}, but it must be [B, {want}] (inactive "
                         "and reactive latents and the packed mask, at the latents' frames and size)")
    return {**wan.text_cond_from_batch(config, batch), CONTEXT: context}


def inputs(config: ModelConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """Wan's arguments and the context, as ``WanVACEPipeline`` calls the DiT (:func:`context_inputs`)."""
    return {**wan.inputs(config, x_t, t, cond, sharded), **context_inputs(config, x_t, cond)}


def context_inputs(config: ModelConfig, x_t: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The DiT's context arguments: ``control_hidden_states`` and, when the config's ``context_scale`` (the pipeline's
    ``conditioning_scale``) is not one, ``control_hidden_states_scale`` (at one the DiT's default, which passes
    none)."""
    call = {"control_hidden_states": cond[CONTEXT].to(x_t.dtype)}
    scale = context_scales(config)
    if any(s != 1.0 for s in scale):
        call["control_hidden_states_scale"] = torch.tensor(scale, dtype=x_t.dtype, device=x_t.device)
    return call


def context_scales(config: ModelConfig) -> tuple[float, ...]:
    """The hint scale of each context block (``vace_layers``): the config's ``context_scale``, one value repeated or
    one each; a ValueError unless it is finite and one or as many as the blocks."""
    scale, blocks = config.context_scale, len(config.spec.kwargs["vace_layers"])
    scales = (float(scale),) * blocks if isinstance(scale, (int, float)) else tuple(float(s) for s in scale)
    if len(scales) != blocks or not all(math.isfinite(s) for s in scales):
        raise ValueError(f"context_scale must be one finite number or {blocks} (one per context block), got "
                         f"{scale!r}")
    return scales


def frozen_part(name: str, trainable: tuple[str, ...]) -> bool:
    """Whether param ``name`` (without an expert's prefix) is in a part (``base``, ``context``) not in
    ``trainable``."""
    return ("context" if name.startswith(CONTEXT_PARAMS) else "base") not in trainable


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    dim, groups = wan.widths(config)
    return dim, {**groups, "vace_blocks": groups["blocks"]}


ORIGINAL_CONTEXT_BLOCK = {**wan.ORIGINAL_BLOCK, "proj_in": "before_proj", "proj_out": "after_proj"}


def original_name(name: str) -> str | None:
    """A param's name in VACE's original checkpoints: Wan's, ``vace_patch_embedding`` as it is, and a context block's
    as a main block's with ``before_proj`` / ``after_proj`` (the inverse of diffusers' ``convert_wan_to_diffusers``
    VACE renames)."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "vace_blocks" and parts[1].isdigit():
        for module, original in ORIGINAL_CONTEXT_BLOCK.items():
            if parts[2] == module or parts[2].startswith(module + "."):
                return f"vace_blocks.{parts[1]}.{original}{parts[2][len(module):]}"
        return None
    if name.startswith("vace_patch_embedding."):
        return name
    return wan.original_name(name)


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``WanVACEPipeline`` files beside ``transformer/``: ``model_index.json`` (no second expert) and
    ``scheduler/`` with the preset's flow shift; copy the VAE, UMT5 text encoder and tokenizer from the base model."""
    FlowMatchEulerDiscreteScheduler(shift=config.spec.options["flow_shift"]).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "WanVACEPipeline",
        {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
         "transformer": ("diffusers", "WanVACETransformer3DModel"), "transformer_2": (None, None),
         "vae": ("diffusers", "AutoencoderKLWan"), "text_encoder": ("transformers", "UMT5EncoderModel"),
         "tokenizer": ("transformers", "AutoTokenizer")},
        boundary_ratio=None)


# ----------------------------------------------------------------------------------------------------- encoding


def pack_mask(mask: torch.Tensor, time_stride: int, spatial_stride: int, references: int = 0) -> torch.Tensor:
    """A pixel mask ``[B, 1, F, H, W]`` (1: to be made) as the context's last channels ``[B, s^2, t, H / s, W / s]``:
    ``s x s`` pixels to a cell, sampled to ``t = ceil(F / time_stride)`` latent frames (``nearest-exact``), after
    ``references`` zero frames (``WanVACEPipeline.prepare_masks``)."""
    batch, _, frames, height, width = mask.shape
    s = spatial_stride
    cells = mask[:, 0].reshape(batch, frames, height // s, s, width // s, s).permute(0, 3, 5, 1, 2, 4)
    cells = cells.reshape(batch, s * s, frames, height // s, width // s)
    latent_frames = (frames + time_stride - 1) // time_stride
    packed = F.interpolate(cells, size=(latent_frames, height // s, width // s), mode="nearest-exact")
    return F.pad(packed, (0, 0, 0, 0, references, 0))


def encode_context(pipe: Any, video: torch.Tensor, mask: torch.Tensor | None,
                   references: list[torch.Tensor]) -> torch.Tensor:
    """One clip's context ``[1, 2 C + s^2, t, h, w]`` as ``WanVACEPipeline`` builds it: the control ``video [1, 3, F,
    H, W]`` in [-1, 1] and its ``mask [1, 1, F, H, W]`` in [0, 1] (None: ones, everything to be made) through the
    pipeline's ``prepare_video_latents`` (VAE means, normalised), the mask through :func:`pack_mask`, with
    ``references`` (images ``[3, H, W]`` in [-1, 1]) in front."""
    if mask is None:
        mask = torch.ones_like(video[:, :1])
    latents = pipe.prepare_video_latents(video, mask, [list(references)], device=video.device).float()
    packed = pack_mask((mask > 0.5).float(), pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial,
                       len(references))
    return torch.cat([latents, packed.to(latents.device)], dim=1)


def encode_references(pipe: Any, references: list[torch.Tensor]) -> torch.Tensor:
    """The reference images' latent frames ``[C, R, h, w]`` in the VAE's own scale (the posterior means), the frames
    the pipeline puts in front of the video's latents (each in front of the ones before: the last first)."""
    frames = [fencoders.latent_mean(pipe.vae, image[None, :, None]).float()[0] for image in reversed(references)]
    return torch.cat(frames, dim=1)


ENCODERS = dataclasses.replace(wan.ENCODERS, pipeline="WanVACEPipeline", context=encode_context,
                               references=encode_references)
"""Wan's encoders and VACE's context: UMT5 at 512 tokens, the VAE's means, and the context of a control video, its
mask and reference images as the pipeline builds it."""


WAN_VACE = wan.WAN.variant(
    name="wan_vace",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture={"skeleton": skeleton, "unit_groups": {"blocks": ("blocks",), "vace_blocks": ("vace_blocks",)},
                  # a context block saves a main block's and its hint (measured: saved-tensor hooks, bf16)
                  "activations": {"blocks": wan.BLOCK_ACTIVATIONS,
                                  "vace_blocks": wan.BLOCK_ACTIVATIONS._replace(compute_dim=11)},
                  "widths": widths, "sequence_parallel": None,
                  "self_attention": ("blocks.*.attn1", "vace_blocks.*.attn1")},
    forward={"inputs": inputs, "with_r": None},  # no second time: VACE has no flow-map form
    conditioning={"spec": cond_spec, "from_batch": cond_from_batch, "data_keys": ("text", "text_mask", CONTEXT),
                  "image": frozenset({CONTEXT})},
    checkpoints={"pipeline_files": pipeline_files, "original_name": original_name, "stored_names": None},
)
"""Wan's spec with VACE's skeleton, context input and context blocks (a unit group of their own), its pipeline and
original names; no sequence parallelism (the context's padding to the video's tokens is not Wan's split)."""


class WanVACEConfig(ModelConfig, tag="wan_vace"):
    """A Wan 2.1 VACE DiT (presets: tiny, world, wan2.1-vace-1.3b, wan2.1-vace-14b); the shared knobs are
    :class:`fvx_models.build.ModelConfig`'s. ``trainable``: what trains, the ``base`` DiT and/or the ``context`` branch
    (``vace_patch_embedding``, ``vace_blocks``); the rest stays as loaded (with LoRA: gets no adapters).
    ``context_scale``: the hints' scale, one value or one per context block (module docstring). Data:
    ``data.kind=vace``."""

    family = WAN_VACE
    trainable: tuple[Literal["base", "context"], ...] = PARTS
    context_scale: float | tuple[float, ...] = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_trainable(self.trainable, PARTS, "part")
        context_scales(self)

    def frozen(self, name: str) -> bool:
        return frozen_part(name, self.trainable)
