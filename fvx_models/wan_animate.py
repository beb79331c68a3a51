"""Wan 2.2 Animate (diffusers ``WanAnimateTransformer3DModel``): a character image animated by a pose video and a
face video, the family's spec.

Wan-Animate is Wan 2.1 I2V 14B with three more inputs, each as ``WanAnimatePipeline`` builds one segment's:

- ``reference_latents [B, C + 4, T + 1, H, W]``: a 4-channel mask, then the normalised latents of the reference
  (character) image as frame 0 and of the previous segment's conditioning video as frames 1..T (its last 1 or 5
  generated frames then zeros, encoded as one clip; a first segment's is a zero video, mask 0). The DiT's input is
  ``[x_t | reference_latents]`` on channels (``2 C + 4``), so ``x_t`` has ``T + 1`` latent frames: frame 0 is the
  reference's slot, which the pipeline drops before decoding (``Forward.lead_frames``: so does fvx).
- ``pose_latents [B, C, T, H, W]``: the pose video's normalised latents, added after the patch embedding to frames
  1..T (``pose_patch_embedding``).
- ``face_pixels [B, 3, 4 (T - 1) + 1, S, S]``: the face crops in [-1, 1] at the motion encoder's size ``S`` (512);
  the motion encoder and face encoder run inside the forward, and the face adapters cross-attend to their features
  after every ``inject_face_latents_blocks``-th block. The unconditional of guidance is the blank face (every pixel
  -1) with the pose, the reference and the image features kept (``WanAnimatePipeline.__call__``).

Wan-AI released no training code. fvx trains it as DiffSynth-Studio's Wan2.2-Animate recipes
(``examples/wanvideo/model_training/lora/Wan2.2-Animate-14B.sh``): Wan's flow matching on every latent frame the
DiT denoises, the reference's slot included, whose clean latent is the reference image's (data kind ``animate``:
``vae_latent`` holds it as frame 0). The motion encoder is a pure function of its params (a QR decomposition of
``motion_synthesis_weight`` in fp32), so the whole forward is one; the face adapters are a unit group of their own.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Mapping

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanAnimateTransformer3DModel
from torch import nn

from fvx.core import random
from fvx.data import preprocess
from fvx.distributed import memory
from fvx_models import diffusers_folder as dfolder, encoders as fencoders, wan
from fvx_models.build import ModelConfig
from fvx_models.family import Preset, require, skeleton_of

REFERENCE, POSE, FACE = "reference_latents", "pose_latents", "face_pixels"
ANIMATE_COND = (REFERENCE, POSE, FACE)  # the cond tensors and data batch keys of data.kind='animate'
MASK_CHANNELS = 4  # the reference's mask (the Wan VAE's time stride): the DiT's in_channels is 2 C + 4
BLUR_KERNEL = (1, 3, 3, 1)  # the motion encoder's down-sampling FIR (MotionEncoderResBlock's default)


def face_frames(pose_frames: int) -> int:
    """The face video's frames for ``pose_frames`` latent frames: the face encoder's two stride-2 convolutions take
    ``4 (T - 1) + 1`` frames (a segment's video frames) to ``T``."""
    return 4 * (pose_frames - 1) + 1


_ANIMATE_14B = {**wan.WAN21_I2V_14B, "latent_channels": 16, "motion_encoder_channel_sizes": None,
                "motion_encoder_size": 512, "motion_style_dim": 512, "motion_dim": 20, "motion_encoder_dim": 512,
                "face_encoder_hidden_dim": 1024, "face_encoder_num_heads": 4, "inject_face_latents_blocks": 5,
                "motion_encoder_batch_size": 8}
_TINY_MOTION = {"motion_encoder_channel_sizes": {"4": 16, "8": 8}, "motion_encoder_size": 8, "motion_style_dim": 16,
                "motion_dim": 4, "motion_encoder_dim": 16, "face_encoder_hidden_dim": 16, "face_encoder_num_heads": 2,
                "inject_face_latents_blocks": 1, "motion_encoder_batch_size": 8}
_TINY = {**wan.TINY, "in_channels": 36, "latent_channels": 16, "image_dim": 16, "added_kv_proj_dim": 96,
         **_TINY_MOTION}
_WORLD = {**wan.PRESETS["world"].kwargs, "in_channels": 388, "latent_channels": 192, "image_dim": 192,
          "added_kv_proj_dim": 256, **_TINY_MOTION, "motion_encoder_channel_sizes": {"4": 32, "8": 32, "16": 16},
          "motion_encoder_size": 16}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(_TINY, wan.TINY_VAE, 8, {"flow_shift": 5.0}),
    # the toy world's (192-channel space-to-depth 8 latents; 16 x 16 face videos; the reference frame's latent tokens
    # as its image features)
    "world": Preset(_WORLD, wan.WORLD_CODEC, 4, {"flow_shift": 5.0}),
    # Wan-AI/Wan2.2-Animate-14B-Diffusers: Wan 2.1 I2V 14B's with the motion and face encoders (diffusers'
    # convert_wan_to_diffusers.py "Wan2.2-Animate-14B"); Wan-Animate's sample_shift 5 (wan/configs/wan_animate_14B.py)
    "wan2.2-animate-14b": Preset(_ANIMATE_14B, wan.WAN21_VAE, 512, {"flow_shift": 5.0}),
}
"""``WanAnimateTransformer3DModel`` constructor arguments per preset (every argument), the latent space and the text
length."""


def rebuild(module: nn.Module) -> None:
    """RoPE tables and the motion encoder's blur kernels (buffers, pure functions of the config) on the CPU."""
    wan.rebuild_rope(module)
    kernel = torch.tensor(BLUR_KERNEL, dtype=torch.float32)
    kernel = kernel[None, :] * kernel[:, None]
    for part in module.motion_encoder.modules():
        if getattr(part, "blur", False):
            if tuple(part.blur_kernel.shape) != tuple(kernel.shape):
                raise RuntimeError(f"WanAnimate's motion encoder blurs with a {tuple(part.blur_kernel.shape)} kernel, "
                                   f"not {BLUR_KERNEL} (diffusers changed?)")
            part.register_buffer("blur_kernel", kernel / kernel.sum(), persistent=False)


def skeleton(config: ModelConfig) -> nn.Module:
    return skeleton_of(WanAnimateTransformer3DModel, config.spec.kwargs, rebuild)


def _normal(key: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return random.normal(key, shape)


def _zeros(key: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(shape)


# The motion encoder's layers scale N(0, 1) weights at run time (StyleGAN's equalised learning rate) and fuse their
# biases into the activation (zeros); the face encoder's padding tokens start at zero (diffusers' init).
_MOTION_WEIGHTS = ("conv_in.weight", "conv_out.weight", *(f"res_blocks.{i}.{conv}.weight" for i in range(10)
                                                          for conv in ("conv1", "conv2", "conv_skip")),
                   *(f"motion_network.{i}.weight" for i in range(8)))
INIT_RULES = {"scale_shift_table": wan.scale_shift_init, "motion_synthesis_weight": _normal, "padding_tokens": _zeros,
              "act_fn.bias": _zeros, **{name: _normal for name in _MOTION_WEIGHTS},
              **{f"motion_network.{i}.bias": _zeros for i in range(8)}}


def cond_spec(config: ModelConfig) -> dict[str, tuple]:
    k = config.spec.kwargs
    channels, size = config.spec.latents.channels, k["motion_encoder_size"]
    return {**wan.text_cond_spec(config), "image_embeds": ("N", k["image_dim"]),
            REFERENCE: (channels + MASK_CHANNELS, "T", "H", "W"), POSE: (channels, "Tp", "H", "W"),
            FACE: (3, "Ff", size, size)}


def cond_from_batch(config: ModelConfig, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Wan's text, the reference image's CLIP features and the animation inputs (data.kind='animate'); a ValueError
    names the column and the shape it must have beside the batch's latents ``[B, C, T + 1, H, W]``."""
    who = f"{config.family.name}:{config.preset}"
    require(batch, ("image_embeds", *ANIMATE_COND), who, "the reference image's CLIP features (column clip_feature) "
            "and the animation inputs of data.kind='animate' data")
    cond = {**wan.text_cond_from_batch(config, batch), "image_embeds": batch["image_embeds"],
            **{name: batch[name] for name in ANIMATE_COND}}
    if "latents" in batch:
        check_shapes(config, tuple(batch["latents"].shape), cond, who)
    return cond


def check_shapes(config: ModelConfig, latents: tuple[int, ...], cond: Mapping[str, torch.Tensor], who: str) -> None:
    """A ValueError naming the column unless the animation inputs fit latents ``[B, C, T + 1, H, W]``."""
    channels, size = config.spec.latents.channels, config.spec.kwargs["motion_encoder_size"]
    batch, _, frames, height, width = latents
    short = latent_rule(config, latents)
    if short is not None:
        raise ValueError(f"{who}: {short}")
    want = {REFERENCE: (batch, channels + MASK_CHANNELS, frames, height, width),
            POSE: (batch, channels, frames - 1, height, width),
            FACE: (batch, 3, face_frames(frames - 1), size, size)}
    meaning = {REFERENCE: "the mask, then the reference frame and the previous segment's latents",
               POSE: "one latent frame per video latent frame, the reference's slot excepted",
               FACE: f"4 (T - 1) + 1 face frames of {size} x {size} pixels"}
    for name, shape in want.items():
        if tuple(cond[name].shape) != shape:
            raise ValueError(f"{who}: column {name} is {list(cond[name].shape)}, but it must be {list(shape)} "
                             f"({meaning[name]}, beside latents {list(latents)})")


def inputs(config: ModelConfig, x_t: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor],
           sharded: bool) -> dict[str, Any]:
    """``WanAnimatePipeline``'s call: ``[x_t | reference_latents]``, the text zero-padded to 512 tokens after the
    image features, the pose latents and the face video."""
    text = wan.padded_text(wan.masked_text(cond), config)
    return {"hidden_states": torch.cat([x_t, cond[REFERENCE].to(x_t.dtype)], dim=1), "timestep": t,
            "encoder_hidden_states": text, "encoder_hidden_states_image": cond["image_embeds"],
            "pose_hidden_states": cond[POSE].to(x_t.dtype), "face_pixel_values": cond[FACE].to(x_t.dtype),
            "return_dict": False}


def blank_face(face: torch.Tensor) -> torch.Tensor:
    """The unconditional face video: every pixel -1 (``face_video_segment * 0 - 1``)."""
    return torch.full_like(face, -1.0)


def latent_rule(config: ModelConfig, shape: tuple[int, ...]) -> str | None:
    if shape[2] < 2:
        return (f"Wan-Animate's latents are the reference's frame then the video's, at least 2 frames; got "
                f"{shape[2]}")
    return None


# What one face adapter saves per video token (saved-tensor hooks, bf16: tests/fvx_models/test_wan_animate.py): its
# norms in fp32, the query, attention and output in bf16; no FFN
FACE_ADAPTER_ACTIVATIONS = memory.BlockActivations(fp32_dim=2.1, compute_dim=3.1, compute_ffn=0)


def widths(config: ModelConfig) -> tuple[int, dict[str, tuple[int, int]]]:
    dim, groups = wan.widths(config)
    return dim, {**groups, "face_adapter": (dim, 0)}


def original_name(name: str) -> str | None:
    """A param's name in Wan-Animate's original checkpoint: a block's and the root's as Wan 2.1 I2V's, the pose patch
    embedding's as it is; the motion encoder, face encoder and face adapters have none fvx writes (diffusers'
    conversion splits the face adapters' fused k/v projection and renames the rest), so a ComfyUI LoRA file holds the
    blocks' adapters (:data:`fvx_models.wan.DIFFSYNTH_LORA_TARGETS`; the face adapter is another of
    DiffSynth's models)."""
    if name.startswith("pose_patch_embedding."):
        return name
    return wan.original_name(name)


def pipeline_files(config: ModelConfig, folder: pathlib.Path) -> None:
    """diffusers' ``WanAnimatePipeline`` files beside ``transformer/``: ``model_index.json`` and ``scheduler/`` (flow
    matching at the preset's shift); copy the VAE, UMT5, CLIP image encoder and processors from the base model."""
    FlowMatchEulerDiscreteScheduler(shift=config.spec.options["flow_shift"]).save_config(folder / "scheduler")
    dfolder.write_model_index(
        folder, "WanAnimatePipeline",
        {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
         "transformer": ("diffusers", "WanAnimateTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLWan"),
         "text_encoder": ("transformers", "UMT5EncoderModel"), "tokenizer": ("transformers", "AutoTokenizer"),
         "image_encoder": ("transformers", "CLIPVisionModel"),
         "image_processor": ("transformers", "CLIPImageProcessor")})


# ----------------------------------------------------------------------------------------------------- encoding


def condition_mask(frames: int, given: int, height: int, width: int, stride: int = MASK_CHANNELS,
                   keep: torch.Tensor | None = None) -> torch.Tensor:
    """The pipeline's ``get_i2v_mask`` ``[s, T, h, w]`` of ``T`` latent frames whose first ``given`` video frames are
    given (``s`` the VAE's time stride, 4): one on them and where ``keep [F, h, w]`` (the replace mode's video frames
    to keep, at the latent grid) is one, the first latent frame's mask repeated over its ``s`` channels."""
    mask = torch.zeros(1, stride * (frames - 1) + 1, height, width) if keep is None else keep[None].clone()
    mask[:, :given] = 1
    mask = torch.cat([mask[:, :1].repeat_interleave(stride, dim=1), mask[:, 1:]], dim=1)
    return mask.view(frames, stride, height, width).transpose(0, 1)


def raw_latents(pipe: Any, video: torch.Tensor) -> torch.Tensor:
    """A clip ``[3, F, H, W]`` in [-1, 1] as the VAE's mean ``[C, t, h, w]`` in its own scale."""
    return fencoders.latent_mean(pipe.vae, video[None].to(pipe.vae.dtype)).float()[0]


def normalized(pipe: Any, video: torch.Tensor) -> torch.Tensor:
    """A clip ``[3, F, H, W]`` in [-1, 1] as the pipeline's latents ``[C, t, h, w]``: the VAE's mean, normalised."""
    return wan.normalized(pipe, raw_latents(pipe, video)[None])[0]


def encode_animation(pipe: Any, reference: torch.Tensor, pose: torch.Tensor, face: torch.Tensor,
                     previous: torch.Tensor | None, background: torch.Tensor | None = None,
                     mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One segment's animation inputs as ``WanAnimatePipeline`` builds them: the reference image ``[3, H, W]``, the
    pose video ``[3, F, H, W]`` and the previous segment's last frames ``[3, P, H, W]`` (None: a first segment) in
    [-1, 1], the face video ``[3, F, S, S]`` as uint8; for the replace mode the background video ``[3, F, H, W]`` in
    [-1, 1] behind the frames given (where the animate mode has zeros) and its mask ``[1, F, H, W]`` (1: to be made;
    the rest kept, one in the condition mask at the latent grid, nearest). Returns ``reference_latents [C + 4, T + 1,
    h, w]``, ``pose_latents [C, T, h, w]``, ``face_pixels`` (uint8, as given) and ``reference [C, 1, h, w]``: the
    reference's latent in the VAE's own scale, the clean frame 0 of ``vae_latent``."""
    frames, height, width = pose.shape[1:]
    given = 0 if previous is None else previous.shape[1]
    condition = (torch.zeros(3, frames, height, width, device=pose.device) if background is None
                 else background.clone().to(pose.device))
    if previous is not None:
        condition[:, :given] = previous
    segment = normalized(pipe, condition)
    raw = raw_latents(pipe, reference[:, None])  # encoded once: vae_latent's frame 0 and, normalised, the condition's
    image = wan.normalized(pipe, raw[None])[0]
    (latent_frames, h, w), stride = segment.shape[1:], pipe.vae_scale_factor_temporal
    keep = None if mask is None else preprocess.kept_cells(mask, h, w)
    reference_latents = torch.cat([
        torch.cat([condition_mask(1, 1, h, w, stride).to(image.device), image], dim=0),
        torch.cat([condition_mask(latent_frames, given, h, w, stride, keep).to(segment.device), segment], dim=0)],
        dim=1)
    return {REFERENCE: reference_latents, POSE: normalized(pipe, pose), FACE: face, "reference": raw}


ENCODERS = dataclasses.replace(wan.ENCODERS, pipeline="WanAnimatePipeline", animation=encode_animation,
                               image_wanted=lambda config: True)
"""Wan's encoders (UMT5 at 512 tokens, the VAE's means, the CLIP image features of the reference) and Wan-Animate's
segment inputs as the pipeline builds them."""


WAN_ANIMATE = wan.WAN.variant(
    name="wan_animate",
    presets=PRESETS,
    encoders=ENCODERS,
    architecture={"skeleton": skeleton, "init_rules": INIT_RULES, "widths": widths, "sequence_parallel": None,
                  "derived": lambda config: {},
                  "unit_groups": {"blocks": ("blocks",), "face_adapter": ("face_adapter",)},
                  "activations": {**wan.IMAGE_ATTENTION_ACTIVATIONS, "face_adapter": FACE_ADAPTER_ACTIVATIONS}},
    forward={"inputs": inputs, "output": lambda config, out, x, t, cond: out[0], "with_r": None, "lead_frames": 1},
    conditioning={"spec": cond_spec, "from_batch": cond_from_batch,
                  "data_keys": ("text", "text_mask", "image_embeds", *ANIMATE_COND),
                  "image": frozenset({"image_embeds", REFERENCE, POSE}), "blank": {FACE: blank_face}},
    checkpoints={"pipeline_files": pipeline_files, "original_name": original_name, "stored_names": None,
                 "original_formats": ("comfyui",)},
    training={"latent_rule": latent_rule},
)
"""Wan's spec with Wan-Animate's skeleton and inputs; no sequence parallelism (the face adapters attend per latent
frame over the whole frame's tokens) and no second time."""


class WanAnimateConfig(ModelConfig, tag="wan_animate"):
    """A Wan 2.2 Animate DiT (presets: tiny, world, wan2.2-animate-14b); the shared knobs are
    :class:`fvx_models.build.ModelConfig`'s. Data: ``data.kind=animate``."""

    family = WAN_ANIMATE
