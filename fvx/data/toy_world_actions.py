"""The toy world with actions (data kind "matrixgame2"): a lattice of squares that moves as a per-frame key says.

Sample ``i`` shows squares of its prompt's colour (prompt ``i mod P``), ``width`` px on a period of ``2 width`` on
both axes (the world's bars of both axes crossed), on black, from a start phase drawn on the ``grid`` from
``fold_in(key, i)``. Its keys, one per video frame (:data:`KEYS`, FastVideo's universal keyboard order W, S, A, D = up,
down, left, right), are drawn from the same key: a first direction and, with probability 1/2, one change to another
direction at a random frame, so a clip may turn mid-clip. Frame ``t``'s key is the key held while frame ``t`` shows: it
moves the lattice by ``speed`` px into frame ``t + 1`` (the last frame's key moves nothing within the clip), as a key
pressed in a game shows in the next frame; Matrix-Game's action window for a latent frame holds the actions of the
frames before it (``fvx_models.matrixgame2_actions``), so the model sees every key that moved it there. An all-zero row (standing still) is a valid
key the world never draws. The camera does not move, so ``mouse`` is zeros ``[T, 2]``.

Latents are the world's exact space-to-depth codec (time stride 1, so ``F = T`` action rows); ``first_frame_latents``
the first frame's then zeros; ``image_embeds`` the first frame's latent tokens ``[h w, 3 f^2]``.
:func:`action_quality` scores decoded samples: ``action_following`` (the fraction of frame transitions whose best
matching shift by ``speed`` px, among still and the four keys, is the key pressed; chance 1/4) and ``continuation_mse``
(pixel MSE to the sample's own true clip, which its first frame and keys determine).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from fvx.core import random
from fvx.data.sections import SectionsConfig
from fvx.data.toy_world import (COLOURS, DIRECTIONS, WorldConfig, WorldDataset, first_frame_only, space_to_depth,
                                tokens_of_first_frame)
from fvx.data.toy_world_animate import AnimateWorldDataset
from fvx.data.toy_world_sections import SectionWorldDataset

KEYS = ("up", "down", "left", "right")  # keyboard columns W, S, A, D (FastVideo's universal order)
STILL = -1  # a frame whose keyboard row presses nothing


def random_actions(key: torch.Tensor, frames: int, keys: int = 4) -> dict[str, np.ndarray]:
    """Synthetic actions: ``keyboard`` one-hot ``[frames, keys]`` (a uniform key per frame) and ``mouse`` normal x 0.1
    ``[frames, 2]``, float32."""
    key_key, mouse_key = random.split(key, 2)
    pressed = random.randint(key_key, (frames,), 0, keys).numpy()
    return {"keyboard": np.eye(keys, dtype=np.float32)[pressed],
            "mouse": (0.1 * random.normal(mouse_key, (frames, 2))).numpy()}


def draw_keys(config: WorldConfig, key: torch.Tensor) -> np.ndarray:
    """One clip's keys ``[frames]`` (indices into :data:`KEYS`): a first direction of ``config.directions``, and with
    probability 1/2 (when there are 3+ frames and 2+ directions) another one from a frame in ``[1, frames - 1)`` on
    (a turn the clip shows)."""
    allowed = [KEYS.index(d) for d in config.directions]
    first_key, turn_key, frame_key, second_key = random.split(key, 4)
    first = allowed[int(random.randint(first_key, (), 0, len(allowed)))]
    keys = np.full(config.frames, first, dtype=np.int64)
    if config.frames >= 3 and len(allowed) > 1 and float(random.uniform(turn_key, ())) < 0.5:
        others = [k for k in allowed if k != first]
        keys[int(random.randint(frame_key, (), 1, config.frames - 1)):] = others[
            int(random.randint(second_key, (), 0, len(others)))]
    return keys


def keyboard_of(keys: np.ndarray, width: int = len(KEYS)) -> np.ndarray:
    """Key indices ``[T]`` (:data:`STILL` for none) as keyboard rows ``[T, width]`` float32, one-hot."""
    rows = np.zeros((len(keys), width), dtype=np.float32)
    pressed = keys >= 0
    rows[np.flatnonzero(pressed), keys[pressed]] = 1.0
    return rows


def keys_of(keyboard: torch.Tensor) -> torch.Tensor:
    """Keyboard rows ``[..., F, K]`` as key indices ``[..., F]``: the strongest pressed key (> 0.5), else
    :data:`STILL`."""
    value, index = keyboard.float()[..., :len(KEYS)].max(dim=-1)
    return torch.where(value > 0.5, index, torch.full_like(index, STILL))


def phases(config: WorldConfig) -> list[tuple[int, int]]:
    """Every start phase (row, column) of the lattice on the ``grid``: both in ``[0, 2 width)``."""
    axis = range(0, 2 * config.width, config.grid)
    return [(r, c) for r in axis for c in axis]


def positions(config: WorldConfig, start: tuple[int, int], keys: np.ndarray) -> np.ndarray:
    """The lattice's phase ``[T, 2]`` (row, column) per frame: ``start``, then the previous frame's key's move by
    ``speed``."""
    moves = np.array([(0, 0)] + [DIRECTIONS[KEYS[k]] if k >= 0 else (0, 0) for k in keys[:-1]], dtype=np.int64)
    return np.asarray(start, dtype=np.int64) + config.speed * np.cumsum(moves, axis=0)


def render(config: WorldConfig, colour: str, start: tuple[int, int], keys: np.ndarray) -> np.ndarray:
    """The clip ``[3, T, size, size]`` float32 in [-1, 1]: black, with the lattice of ``colour`` squares moved by
    ``keys`` from phase ``start``."""
    video = -np.ones((3, len(keys), config.size, config.size), dtype=np.float32)
    period, axis = 2 * config.width, np.arange(config.size)
    value = np.asarray(COLOURS[colour], dtype=np.float32)[:, None]
    for t, (row, column) in enumerate(positions(config, start, keys)):
        on = (((axis - row) % period) < config.width)[:, None] & (((axis - column) % period) < config.width)[None]
        video[:, t, on] = value
    return video


def check_identifiable(config: WorldConfig) -> None:
    """A ValueError unless a move of ``speed`` px is told from standing still and from the opposite move on the
    lattice's period (``speed`` and ``2 speed`` not multiples of ``2 width``)."""
    period = 2 * config.width
    if config.speed % period == 0 or (2 * config.speed) % period == 0:
        raise ValueError(f"data.world.speed {config.speed}: on a lattice of period {period} (2 x data.world.width) "
                         "a key's move looks like standing still or the opposite key; make speed not a multiple of "
                         f"{period // 2}")


class ActionWorldDataset(WorldDataset):
    """The world of kind "matrixgame2" (module docstring): samples with actions, scored by :func:`action_quality`."""

    def __init__(self, config: WorldConfig, key: torch.Tensor, *, kind: str, collate: Callable[..., dict]):
        super().__init__(config, key, kind=kind, collate=collate)
        check_identifiable(config)
        self.phases = phases(config)

    def keys(self, index: int) -> np.ndarray:
        """Sample ``index``'s keys ``[frames]`` (:func:`draw_keys` of ``fold_in(fold_in(key, index), 1)``)."""
        return draw_keys(self.config, random.fold_in(random.fold_in(self.key, index), 1))

    def clip(self, index: int) -> np.ndarray:
        """Sample ``index``'s clip ``[3, T, size, size]`` in [-1, 1]: its colour's lattice from a phase drawn from
        ``fold_in(key, index)``, moved by its keys."""
        colour = self.prompts[index % len(self.prompts)][0]
        start = self.phases[int(random.randint(random.fold_in(self.key, index), (), 0, len(self.phases)))]
        return render(self.config, colour, start, self.keys(index))

    def sample(self, index: int) -> dict[str, Any]:
        latents = space_to_depth(self.clip(index), self.config.factor)
        colour = self.prompts[index % len(self.prompts)][0]
        return {"latents": latents, "first_frame_latents": first_frame_only(latents),
                "image_embeds": tokens_of_first_frame(latents), "keyboard": keyboard_of(self.keys(index)),
                "mouse": np.zeros((self.config.frames, 2), dtype=np.float32), "caption": caption(colour),
                "where": self.where(index)}

    def sample_quality(self, videos: torch.Tensor, indices: Sequence[int]) -> dict[str, float]:
        """:func:`action_quality` of decoded samples ``[N, 3, T, H, W]`` in [0, 1] made from the first frames and
        keys of dataset samples ``indices``."""
        keyboard = torch.from_numpy(np.stack([keyboard_of(self.keys(int(i))) for i in indices]))
        truth = torch.from_numpy(np.stack([self.clip(int(i)) for i in indices])) / 2 + 0.5
        return action_quality(videos, keyboard, truth, self.config.speed, self.config.score_window)

    def caption_quality(self, videos: torch.Tensor, captions: Sequence[str]) -> dict[str, float]:
        raise ValueError("the toy world with actions scores samples by their keys, which captions do not give")


def world_dataset(config: WorldConfig, key: torch.Tensor, *, kind: str, collate: Callable[..., dict],
                  sections: SectionsConfig | None = None) -> WorldDataset:
    """The toy world of data ``kind``: with actions (:class:`ActionWorldDataset`) for kind "matrixgame2", cut into
    ``sections`` (``fvx.data.toy_world_sections``) for kind "framepack", animated (``fvx.data.toy_world_animate``)
    for kind "animate"."""
    if kind == "framepack":
        return SectionWorldDataset(config, key, kind=kind, collate=collate, sections=sections or SectionsConfig())
    if kind == "animate":
        return AnimateWorldDataset(config, key, kind=kind, collate=collate)
    world = ActionWorldDataset if kind == "matrixgame2" else WorldDataset
    return world(config, key, kind=kind, collate=collate)


def caption(colour: str) -> str:
    return f"{colour} squares moving by the keys"


def best_moves(videos: torch.Tensor, speed: int) -> torch.Tensor:
    """``[N, T - 1]``: per frame transition ``t - 1 -> t`` of videos ``[N, 3, T, H, W]``, the key (index into
    :data:`KEYS`, or :data:`STILL`) whose shift of frame ``t - 1`` by ``speed`` px (rolled) is nearest frame ``t``
    (pixel MSE; ties go to the first of still, up, down, left, right)."""
    previous, current = videos[:, :, :-1].float(), videos[:, :, 1:].float()
    shifts = [(0, 0)] + [tuple(speed * s for s in DIRECTIONS[k]) for k in KEYS]
    errors = torch.stack([((torch.roll(previous, shifts=shift, dims=(-2, -1)) - current) ** 2).mean(dim=(1, 3, 4))
                          for shift in shifts], dim=-1)  # [N, T - 1, 5]
    return errors.argmin(dim=-1) - 1


def action_quality(videos: torch.Tensor, keyboard: torch.Tensor, truth: torch.Tensor, speed: int,
                   window: int | None = None) -> dict[str, float]:
    """Figures of decoded samples ``[N, 3, T, H, W]`` in [0, 1] against their keys ``keyboard [N, F >= T, K]`` and
    true clips ``truth [N, 3, F, H, W]`` in [0, 1] (both cut to ``T``): ``action_following`` (the fraction of
    transitions whose :func:`best_moves` is the key held at its first frame) and ``continuation_mse``. With ``window`` shorter
    than the clip, also ``window_i/<figure>`` per window of ``window`` frames (transitions into a frame count in its
    window), so a person sees whether a long streamed clip keeps following the keys."""
    frames = videos.shape[2]
    if keyboard.shape[1] < frames or truth.shape[2] < frames or truth.shape[-2:] != videos.shape[-2:]:
        raise ValueError(f"sample_quality: videos {tuple(videos.shape)} are longer or larger than their keys "
                         f"{tuple(keyboard.shape)} and true clips {tuple(truth.shape)}")
    follows = torch.cat([torch.zeros(len(videos), 1, dtype=torch.bool),
                         best_moves(videos, speed) == keys_of(keyboard[:, :frames])[:, :-1]], dim=1)  # [N, T]
    errors = ((videos.float() - truth[:, :, :frames].float()) ** 2).mean(dim=(1, 3, 4))  # [N, T]

    def figures(start: int, stop: int) -> dict[str, float]:
        moves = follows[:, max(start, 1):stop]
        return {"action_following": float(moves.float().mean()) if moves.numel() else float("nan"),
                "continuation_mse": float(errors[:, start:stop].mean())}

    whole = figures(0, frames)
    if window is None or window >= frames:
        return whole
    return {**whole, **{f"window_{i}/{name}": value for i, start in enumerate(range(0, frames, window))
                        for name, value in figures(start, min(start + window, frames)).items()}}
