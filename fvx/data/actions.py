"""Keys drawn on videos: :func:`overlay_keys` lights a small W/A/S/D cross in a frame's top-left corner per frame,
as FastVideo overlays a Matrix-Game validation video's actions (``_matrixgame2_overlay_keys_from_keyboard``'s mapping
of keyboard widths to W, S, A, D, :func:`pressed`), so a person sees whether the motion follows the keys."""
from __future__ import annotations

import torch

WASD = ("W", "S", "A", "D")
# columns of W, S, A, D by keyboard width (FastVideo's mapping): Solaris' 23+ keys, Temple Run's 7, the universal
# 4 (and 6: its first four), GTA's 2 (W, S)
_COLUMNS = {7: (1, 2, 5, 6), 2: (0, 1, None, None)}
_SOLARIS = (11, 12, 13, 14)
PRESSED, RELEASED = (0.0, 1.0, 0.0), (0.78, 0.78, 0.78)  # cell colours in [0, 1]
PRESSED_ALPHA, RELEASED_ALPHA = 0.8, 0.5


def columns(width: int) -> tuple[int | None, ...]:
    """The keyboard columns of W, S, A, D for a keyboard ``width`` wide (None: the layout has no such key)."""
    if width >= 23:
        return _SOLARIS
    if width in _COLUMNS:
        return _COLUMNS[width]
    if width == 4 or width >= 6:
        return (0, 1, 2, 3)
    return (None,) * 4


def pressed(keyboard: torch.Tensor) -> torch.Tensor:
    """Keyboard rows ``[F, K]`` as ``[F, 4]`` bool: whether W, S, A, D are pressed (> 0.5) in each row."""
    rows = keyboard.float()
    out = torch.zeros(rows.shape[0], 4, dtype=torch.bool)
    for i, column in enumerate(columns(rows.shape[1])):
        if column is not None:
            out[:, i] = rows[:, column] > 0.5
    return out


def cells(height: int, width: int) -> dict[str, tuple[int, int, int]]:
    """Each key's cell ``(top, left, side)`` in pixels: W above S, A and D left and right of S (a keyboard's
    cross), in the top-left corner, sides about a tenth of the frame's shorter edge (at least 2 px)."""
    side = max(2, min(height, width) // 10)
    margin, gap = max(1, side // 2), max(1, side // 6)
    row_2, col_2 = margin + side + gap, margin + side + gap
    return {"W": (margin, col_2, side), "A": (row_2, margin, side), "S": (row_2, col_2, side),
            "D": (row_2, col_2 + side + gap, side)}


def overlay_keys(video: torch.Tensor, keyboard: torch.Tensor) -> torch.Tensor:
    """``video [3, T, H, W]`` in [0, 1] with frame ``t``'s keys (``keyboard [F, K]`` row ``t``, the last for frames
    beyond ``F``) drawn as a cross of 4 cells in its top-left corner: pressed ones green, the others grey."""
    if video.dim() != 4 or video.shape[0] != 3 or keyboard.dim() != 2 or keyboard.shape[0] == 0:
        raise ValueError(f"overlay_keys: video must be [3, T, H, W] and keyboard [F, K], got {list(video.shape)} "
                         f"and {list(keyboard.shape)}")
    frames, height, width = video.shape[1:]
    keys = pressed(keyboard.cpu())[torch.clamp(torch.arange(frames), max=keyboard.shape[0] - 1)]  # [T, 4]
    out = video.clone()
    for name, (top, left, side) in cells(height, width).items():
        bottom, right = min(top + side, height), min(left + side, width)
        if bottom <= top or right <= left:
            continue
        on = keys[:, WASD.index(name)].to(video.device)  # [T]
        alpha = torch.where(on, PRESSED_ALPHA, RELEASED_ALPHA).to(video.dtype)[None, :, None, None]
        colour = torch.where(on[None], torch.tensor(PRESSED)[:, None].to(video),
                             torch.tensor(RELEASED)[:, None].to(video))[..., None, None]  # [3, T, 1, 1]
        region = out[:, :, top:bottom, left:right]
        out[:, :, top:bottom, left:right] = (1 - alpha) * region + alpha * colour
    return out


def overlay_batch(videos: torch.Tensor, keyboard: torch.Tensor) -> torch.Tensor:
    """:func:`overlay_keys` of each video ``[N, 3, T, H, W]`` with its keys ``keyboard [N, F, K]``."""
    return torch.stack([overlay_keys(v, k) for v, k in zip(videos, keyboard)])
