"""Conditioning on a section's clean history (data kind ``framepack``, ``fvx.data.sections``), shared by the families
that predict a video a section at a time (FramePack, Helios): its cond tensors, read from a batch with its shapes
checked, and split as the DiTs take it.

    framepack_history [B, C, 20, H, W]   the first frame, the newest frame (1x), two frames the DiT packs 2x coarser,
                                         sixteen it packs 4x coarser
    frame_indices     [B, T + 20]        the RoPE time positions of the section's T frames, then of the 20
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from fvx.data.sections import HISTORY, HISTORY_SPLIT
from fvx_models.family import require

NAMES = ("framepack_history", "frame_indices")
CLEAN, COARSE_2X, COARSE_4X = HISTORY_SPLIT[0] + HISTORY_SPLIT[1], HISTORY_SPLIT[2], HISTORY_SPLIT[3]  # 2, 2, 16


def cond_spec(config: Any) -> dict[str, tuple]:
    return {"framepack_history": (config.spec.latents.channels, HISTORY, "H", "W"), "frame_indices": ("P",)}


def cond_from_batch(config: Any, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The history and its positions from a batch of kind ``framepack``; a ValueError names the parquet column that
    is missing or of the wrong shape for the batch's latents."""
    name = config.family.name
    require(batch, NAMES, name, "a section's history and frame positions: data.kind='framepack'")
    history, indices = batch["framepack_history"], batch["frame_indices"]
    if "latents" not in batch:  # a prompt's cond, its history to be made by the sampler (fvx.training.sampling)
        return {"framepack_history": history, "frame_indices": indices}
    latents = batch["latents"]
    want = [latents.shape[1], HISTORY, *latents.shape[3:]]
    if list(history.shape[1:]) != want:
        raise ValueError(f"{name}: framepack_history {list(history.shape[1:])} must be {want} (the section's 20 "
                         f"clean frames beside latents {list(latents.shape[1:])})")
    if list(indices.shape[1:]) != [latents.shape[2] + HISTORY]:
        raise ValueError(f"{name}: frame_indices {list(indices.shape[1:])} must be [{latents.shape[2] + HISTORY}] "
                         f"(the positions of the section's {latents.shape[2]} frames and its 20 history frames; "
                         "data.num_latent_t must not cut a section)")
    return {"framepack_history": history, "frame_indices": indices}


def split(cond: Mapping[str, torch.Tensor], window: int, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, ...]]:
    """The history as the DiTs take it: ``"latents"`` (clean = first frame and 1x ``[B, C, 2, H, W]``, 2x
    ``[B, C, 2, H, W]``, 4x ``[B, C, 16, H, W]``) in ``dtype`` and ``"positions"`` (the section's ``[B, window]``,
    then the clean, 2x and 4x frames') as integers."""
    positions = cond["frame_indices"].float().round().long()
    latents = cond["framepack_history"].to(dtype).split([CLEAN, COARSE_2X, COARSE_4X], dim=2)
    return {"latents": latents, "positions": (positions[:, :window],
                                              *positions[:, window:].split([CLEAN, COARSE_2X, COARSE_4X], dim=1))}
