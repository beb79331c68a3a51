"""Next-section data (kind "framepack"): a clip's latents cut into FramePack's sections, each a target window and the
clean history it is predicted from, as musubi-tuner's ``fpack_cache_latents.py`` cuts them.

A clip of ``T`` latent frames holds ``k = (T - 1) // window`` sections of ``window`` frames after its first frame
(frames past ``k * window + 1`` are dropped, as musubi-tuner trims them). A section sample is

    latents        [C, window, H, W]   the frames to predict
    history        [C, 20, H, W]       the clean frames it sees, in fvx's fixed layout: the clip's first frame, one
                                       frame at full resolution (1x), two frames the DiT packs 2x coarser, sixteen it
                                       packs 4x coarser; frames the clip does not have are zeros
    frame_indices  [window + 20]       the RoPE time position of each: the window's frames, then the 20 history frames

``order`` is the order a sampler makes the sections in, which sets what the history holds:
``inverted_anti_drifting`` (FramePack's): the last section first, each seeing the first frame and the frames after it
(already made), placed after a gap as long as the sections still to make (at most three windows);
``vanilla`` (FramePack-F1's): sections in time order, each seeing the 19 frames before it, left-padded with zeros;
``chunks`` (Helios's): the vanilla history, but the sections tile the clip from its first frame (``T // window`` of
them), so the first section makes the first frame too and is given no first frame (zeros), as Helios's training data
cuts a clip (its ``dataloader_history_latents_dist.py``);
``one_frame`` (musubi-tuner's ``--one_frame`` training, its default layout, ``fpack_cache_latents.py``'s
``encode_and_save_batch_one_frame``): one frame made from a control frame, the clip's last latent frame from its
first. The section is that one frame at RoPE position ``window`` (musubi's ``latent_window_size``, its default
``target_index``); the history holds the control at 0, a zero "post" frame at ``1 + window`` and zero 2x and 4x
frames at ``window + 2, window + 3`` and ``window + 4 ..``. A one-frame clip is the two frames ``[first, last]``
(:func:`one_frame_clip`), which a sampler makes from the control as one section.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import torch

from fvx.config import Config

Order = Literal["inverted_anti_drifting", "vanilla", "chunks", "one_frame"]
HISTORY_SPLIT = (1, 1, 2, 16)  # the history's first frame, 1x, 2x and 4x frames
HISTORY = sum(HISTORY_SPLIT)  # 20


class SectionsConfig(Config):
    """How clips become sections (``data.sections``; the module docstring): ``window`` latent frames a section
    predicts (musubi-tuner's ``--latent_window_size``, default 9; it must match what sampling uses; ``one_frame``:
    the made frame's RoPE position) and the sampler's ``order``."""

    window: Annotated[int, msgspec.Meta(gt=0)] = 9
    order: Order = "inverted_anti_drifting"


def history_tokens(height: int, width: int, patch: tuple[int, int, int]) -> int:
    """The tokens a section's history adds to each forward at latent ``height x width`` under the DiT's ``patch``
    ``(1, p, p)``: the first and 1x frames at that patch, the two 2x frames packed by ``(2, 2p, 2p)`` and the sixteen
    4x frames by ``(4, 4p, 4p)`` (FramePack's and Helios's packing; 2.5 frames' worth)."""
    _, ph, pw = patch
    return sum(frames // (scale * patch[0]) * (height // (scale * ph)) * (width // (scale * pw))
               for frames, scale in ((HISTORY_SPLIT[0] + HISTORY_SPLIT[1], 1), (HISTORY_SPLIT[2], 2),
                                     (HISTORY_SPLIT[3], 4)))


def section_frames(config: SectionsConfig) -> int:
    """The latent frames a section makes: ``window``, or one (``one_frame``)."""
    return 1 if config.order == "one_frame" else config.window


def count(frames: int, config: SectionsConfig) -> int:
    """The sections of a clip of ``frames`` latent frames."""
    if config.order == "one_frame":
        return int(frames >= 2)
    return frames // config.window if config.order == "chunks" else (frames - 1) // config.window


def check(frames: int, config: SectionsConfig, where: str) -> int:
    """The section count of a clip of ``frames`` latent frames; a ValueError naming ``where`` when it has none."""
    sections = count(frames, config)
    if sections < 1:
        if config.order == "one_frame":
            raise ValueError(f"{where}: {frames} latent frame holds no one-frame section (data.sections.order="
                             "one_frame makes the last latent frame from the first: it needs at least 2)")
        after = "" if config.order == "chunks" else " after the first frame"
        raise ValueError(f"{where}: {frames} latent frames hold no section of data.sections.window={config.window}"
                         f"{after} (it needs at least {config.window + (config.order != 'chunks')})")
    return sections


def first_frame(config: SectionsConfig, section: int) -> int:
    """The clip's latent frame a section starts at (``one_frame``: of the clip's ``[first, last]``)."""
    return section * section_frames(config) + (config.order != "chunks")


def one_frame_clip(latents: torch.Tensor) -> torch.Tensor:
    """A clip's latents ``[C, T, H, W]`` as a one-frame clip ``[C, 2, H, W]``: its first frame (the control) and its
    last (the frame made)."""
    return torch.cat([latents[:, :1], latents[:, -1:]], dim=1)


def cut(latents: torch.Tensor, config: SectionsConfig) -> list[dict[str, torch.Tensor]]:
    """The sections of one clip's latents ``[C, T, H, W]``, in time order: dicts of ``latents``, ``history`` and
    ``frame_indices`` (float32), as the module docstring lays them out."""
    sections, frames = check(latents.shape[1], config, "a clip"), section_frames(config)
    latents = one_frame_clip(latents) if config.order == "one_frame" else latents[:, :first_frame(config, sections)]
    return [{"latents": latents[:, first_frame(config, n):first_frame(config, n) + frames],
             **history_of(latents, n, config)} for n in range(sections)]


def making_order(sections: int, config: SectionsConfig) -> list[int]:
    """The order a sampler makes the sections of a clip in: the last first in the inverted anti-drifting order."""
    return list(range(sections))[::-1 if config.order == "inverted_anti_drifting" else 1]


def history_of(known: torch.Tensor, section: int, config: SectionsConfig) -> dict[str, torch.Tensor]:
    """Section ``section``'s ``history`` and ``frame_indices`` from a clip's latents ``[C, T, H, W]`` as far as they
    are known: the true clip (data), or what a sampler has made so far in :func:`making_order` (zeros elsewhere)."""
    sections, window = count(known.shape[1], config), config.window
    start = first_frame(config, section)
    if config.order == "one_frame":  # the control, then zeros: musubi's post, 2x and 4x placeholders
        indices = torch.cat([torch.tensor([window, 0]), torch.arange(window + 1, window + HISTORY)])
        return {"history": torch.cat([known[:, :1], known.new_zeros(known.shape[0], HISTORY - 1, *known.shape[2:])],
                                     dim=1), "frame_indices": indices.float()}
    if config.order == "inverted_anti_drifting":  # the first frame, then the frames after the section (made before)
        paddings = list(reversed(range(sections))) if sections <= 4 else [3] + [2] * (sections - 3) + [1, 0]
        gap = 1 + paddings[sections - 1 - section] * window
        after = known[:, start + window:start + window + HISTORY - 1]
        after = torch.cat([after, after.new_zeros(after.shape[0], HISTORY - 1 - after.shape[1], *after.shape[2:])],
                          dim=1)
        indices = torch.cat([torch.arange(gap, gap + window), torch.tensor([0]),
                             torch.arange(gap + window, gap + window + HISTORY - 1)])
        return {"history": torch.cat([known[:, :1], after], dim=1), "frame_indices": indices.float()}
    # in time order: the 19 frames before the section, 4x / 2x / 1x from oldest to newest, left-padded; the first
    # frame but for the first of Helios's chunks, which makes it
    before = known[:, max(0, start - (HISTORY - 1)):start]
    before = torch.cat([before.new_zeros(before.shape[0], HISTORY - 1 - before.shape[1], *before.shape[2:]), before],
                       dim=1)
    coarse4, coarse2, recent = before.split([16, 2, 1], dim=1)
    # positions: first frame 0, the 4x frames 1..16, the 2x 17..18, the 1x 19, the section 20..
    indices = torch.cat([torch.arange(HISTORY, HISTORY + window), torch.tensor([0, 19, 17, 18]),
                         torch.arange(1, 17)])
    first = known[:, :1] if config.order == "vanilla" or section > 0 else torch.zeros_like(known[:, :1])
    return {"history": torch.cat([first, recent, coarse2, coarse4], dim=1), "frame_indices": indices.float()}
