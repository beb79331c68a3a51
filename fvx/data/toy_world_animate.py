"""The toy world as character animation (data kind "animate", Wan-Animate's inputs, ``fvx_models.wan_animate``): each
clip is animated from its first frame (the "character") by a pose video (the clip in white: where the bars are, not
their colour) and a face video (the clip itself, each frame held for the face encoder's 4 video frames per latent
frame: the motion encoder of the ``world`` preset reads 16 x 16 pixels, the world's default size). A sample's latents
are the reference frame's then the clip's; its reference latents are the reference frame (mask one) then a first
segment's zero video (mask zero), as ``WanAnimatePipeline`` builds a first segment.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fvx.data.toy_world import WorldDataset, space_to_depth, tokens_of_first_frame

MASK_CHANNELS = 4  # Wan-Animate's reference mask (fvx_models.wan_animate.MASK_CHANNELS)


def pose_video(clip: np.ndarray) -> np.ndarray:
    """The clip ``[3, T, H, W]`` in [-1, 1] with every lit pixel white: the motion without the colour."""
    lit = (clip > -1).any(axis=0, keepdims=True)
    return np.where(lit, 1.0, -1.0).astype(np.float32).repeat(3, axis=0)


def face_video(clip: np.ndarray) -> np.ndarray:
    """The clip ``[3, T, H, W]`` in [-1, 1] as the face video ``[3, 4 (T - 1) + 1, H, W]`` in [-1, 1]: frame ``t``
    held for video frames ``4 (t - 1) + 1 .. 4 t`` (frame 0 alone), the frames a segment of ``T`` latent frames has."""
    return np.concatenate([clip[:, :1], clip[:, 1:].repeat(4, axis=1)], axis=1)


def reference_latents(reference: torch.Tensor, segment: torch.Tensor, given: int = 0,
                      keep: torch.Tensor | None = None) -> torch.Tensor:
    """The toy codec's ``reference_latents [4 + C, T + 1, h, w]`` (Wan-Animate's layout): the reference frame's
    latent ``[C, 1, h, w]`` (mask one), then the segment's condition latents ``[C, T, h, w]`` (zeros, or the replace
    mode's background), mask one on its first ``given`` frames (the previous segment's) and where ``keep [T, h, w]``
    (the replace mode's cells kept) is one; the codec is frame-wise, a video frame a latent frame."""
    mask = torch.zeros(MASK_CHANNELS, segment.shape[1] + 1, *segment.shape[2:])
    if keep is not None:
        mask[:, 1:] = keep
    mask[:, :1 + given] = 1
    return torch.cat([mask, torch.cat([reference, segment], dim=1)])


def animation(clip: np.ndarray, factor: int) -> dict[str, np.ndarray]:
    """A clip's kind-"animate" sample tensors (module docstring), the codec exact and unnormalised: ``latents [C,
    T + 1, h, w]``, ``reference_latents [C + 4, T + 1, h, w]``, ``pose_latents [C, T, h, w]``, ``face_pixels [3,
    4 (T - 1) + 1, S, S]`` in [-1, 1] as read from parquet, and ``image_embeds``, the reference's latent tokens."""
    latents = space_to_depth(clip, factor)
    reference = latents[:, :1]
    condition = reference_latents(torch.from_numpy(reference), torch.zeros(latents.shape))
    return {"latents": np.concatenate([reference, latents], axis=1), "reference_latents": condition.numpy(),
            "pose_latents": space_to_depth(pose_video(clip), factor),
            "face_pixels": face_video(clip), "image_embeds": tokens_of_first_frame(latents)}


class AnimateWorldDataset(WorldDataset):
    """The world of kind "animate" (module docstring); the sample's own clip is its truth (``continuation_mse``: the
    pose fixes where the bars are, the reference their colour)."""

    def sample(self, index: int) -> dict[str, Any]:
        sample = super().sample(index)
        sample.update(animation(self.clip(index), self.config.factor))
        return sample
