"""Image-to-video conditioning of Wan: how the given first frame (and, for Wan 2.1, its CLIP image embedding) enter
the DiT. Two forms, as diffusers' ``WanImageToVideoPipeline`` builds them:

``concat`` (Wan 2.1 I2V 14B, Wan 2.2 A14B I2V): the input is ``[x_t | mask | first_frame_latents]`` on channels, the
mask ``[B, s, T, H, W]`` one on the first latent frame and zero elsewhere (``s`` the VAE's temporal stride: a latent
frame packs ``s`` video frames, and only the first video frame is given), the first-frame latents the VAE latents of
the first frame followed by zero frames, already normalised to the DiT's input scale (FastVideo's preprocessing stores
``first_frame_latent`` normalised, ``vae_latent`` raw). Wan 2.1
I2V adds the CLIP image encoder's hidden states ``image_embeds [B, N, 1280]`` (FastVideo's ``clip_feature``) to its
cross-attention. The loss covers every frame, as FastVideo's I2V fine-tuning does.

``first_frame`` (Wan 2.2 TI2V-5B's image-to-video, the pipeline's ``expand_timesteps`` path): the first latent frame
of the input is the clean first-frame latent and its tokens get timestep 0; the other frames are denoised. The
velocity of that frame is not the DiT's to predict: the model returns ``(x_t - x_first) / sigma``, the exact velocity
of a path ending at the given frame, so samplers land on the given frame and the frame's error is zero (the loss
covers the other frames).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from fvx_models.family import first_frame_from_batch, first_frame_spec, require

CONCAT, FIRST_FRAME = "concat", "first_frame"
IMAGE_COND = frozenset({"first_frame_latents", "image_embeds"})


def form(config: Any) -> str | None:
    """The image-to-video form of ``config`` (a Wan config): its preset's, or ``first_frame`` when asked of a
    per-token-timestep preset; None for text-to-video."""
    return config.spec.options.get("i2v") or (FIRST_FRAME if getattr(config, "first_frame", False) else None)


def cond_spec(config: Any) -> dict[str, tuple]:
    """The image cond tensors of ``config``'s form: first-frame latents ``[C, T, H, W]`` and, for a model with an image
    cross-attention, image embeddings ``[N, image_dim]``."""
    if form(config) is None:
        return {}
    spec = first_frame_spec(config)
    if config.spec.kwargs.get("image_dim"):
        spec["image_embeds"] = ("N", config.spec.kwargs["image_dim"])
    return spec


def cond_from_batch(config: Any, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The image cond tensors from a data batch of kind ``i2v`` (a ValueError names the parquet column it lacks)."""
    family = config.family.name
    spec = cond_spec(config)
    if "first_frame_latents" in spec:
        first_frame_from_batch(config, batch)
    if "image_embeds" in spec:
        require(batch, ("image_embeds",), family, "the CLIP image embeddings: parquet column clip_feature of "
                "data.kind='i2v' data")
    return {name: batch[name] for name in spec}


def given_frames(x: torch.Tensor, cond: Mapping[str, torch.Tensor], who: str) -> torch.Tensor:
    """The first-frame latents for latents ``x [B, C, T, H, W]``: their first ``T`` frames (a ValueError when they
    have fewer frames or another size)."""
    given = cond["first_frame_latents"]
    if given.shape[2] < x.shape[2] or given.shape[3:] != x.shape[3:]:
        raise ValueError(f"{who}: first_frame_latents {list(given.shape)} do not fit latents {list(x.shape)} (the "
                         "same height and width, at least as many frames)")
    return given[:, :, :x.shape[2]]


def concat_input(config: Any, x: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[x | mask | first_frame_latents]`` on channels (the ``concat`` form)."""
    stride = config.spec.latents.vae_stride[0]
    mask = torch.zeros(x.shape[0], stride, *x.shape[2:], dtype=x.dtype, device=x.device)
    mask[:, :, 0] = 1
    return torch.cat([x, mask, given_frames(x, cond, config.family.name)], dim=1)


def chunk_concat_input(x: torch.Tensor, given: torch.Tensor, first: int, mask_channels: int,
                       who: str) -> torch.Tensor:
    """The ``concat`` form of a streamed chunk: ``[x | mask | given]`` of the clip's latent frames ``first .. first +
    T - 1`` (``x [B, C, T, H, W]``; ``given [B, C, T', H, W]`` the clip's first-frame latents; the mask's
    ``mask_channels`` one on the clip's frame 0 only), as FastVideo's causal image-to-video slices them per chunk."""
    frames = x.shape[2]
    window = given[:, :, first:first + frames]
    if window.shape[2] != frames or window.shape[3:] != x.shape[3:]:
        raise ValueError(f"{who}: first_frame_latents {list(given.shape)} do not cover latent frames {first}.."
                         f"{first + frames - 1} of {list(x.shape)} (the same height and width, every frame)")
    mask = torch.zeros(x.shape[0], mask_channels, frames, *x.shape[3:], dtype=x.dtype, device=x.device)
    if first == 0:
        mask[:, :, 0] = 1
    return torch.cat([x, mask, window.to(x.dtype)], dim=1)


def first_frame_input(x: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``x`` with its first latent frame the given one (the ``first_frame`` form)."""
    return clean_frames_input(x, cond["first_frame_latents"][:, :, :1])


def clean_frames_input(x: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """``x [B, C, T, H, W]`` with its first ``k`` latent frames the ``given [B, C, k, H, W]``."""
    return torch.cat([given.to(x.dtype), x[:, :, given.shape[2]:]], dim=2)


def first_frame_timesteps(t: torch.Tensor, frames: int, tokens_per_frame: int) -> torch.Tensor:
    """One timestep per token ``[B, frames * tokens_per_frame]``: 0 for the first frame's tokens, ``t`` elsewhere."""
    per_frame = t[:, None].expand(t.shape[0], frames).clone()
    per_frame[:, 0] = 0
    return per_frame.repeat_interleave(tokens_per_frame, dim=1)


def first_frame_velocity(v: torch.Tensor, x: torch.Tensor, t: torch.Tensor,
                         cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``v`` with the first frame's velocity the exact one toward the given frame, ``(x_t - x_first) / sigma``
    (zero where ``sigma`` is 0)."""
    return clean_frames_velocity(v, x, t, cond["first_frame_latents"][:, :, :1])


def clean_frames_velocity(v: torch.Tensor, x: torch.Tensor, t: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """``v`` with the first ``k`` frames' velocity the exact one toward ``given [B, C, k, H, W]``, ``(x_t - x_given) /
    sigma`` (zero where ``sigma`` is 0)."""
    count = given.shape[2]
    sigma = (t.float() / 1000.0).view(-1, 1, 1, 1, 1)
    offset = x[:, :, :count].float() - given.float()
    exact = torch.where(sigma > 0, offset / sigma.clamp_min(1e-12), torch.zeros_like(offset))
    return torch.cat([exact.to(v.dtype), v[:, :, count:]], dim=2)
