"""The latent layouts a DiT's ``hidden_states`` come in, and the conversions to and from fvx's ``[B, C, T, H, W]``.

A family declares its DiT's layout (``fvx_models.family.Family.forward.layout``); the generic builder hands the family's
``inputs`` the latents in that layout and turns the family's ``output`` back. Token-sequence DiTs (LTX-Video) declare
``"BTHWC"`` and flatten to tokens themselves: their ``output`` sees the input's shape.
"""
from __future__ import annotations

import torch

PERMUTATIONS = {
    "BCTHW": (0, 1, 2, 3, 4),  # Wan, HunyuanVideo, Cosmos
    "BTCHW": (0, 2, 1, 3, 4),  # frames first (AnyFlow)
    "BTHWC": (0, 2, 3, 4, 1),  # channels last (Kandinsky 5; token sequences before flattening)
}
"""Layout name -> the permutation of ``[B, C, T, H, W]`` that gives it."""


def check(layout: str, who: str) -> None:
    if layout not in PERMUTATIONS:
        raise ValueError(f"{who}: unknown latent layout {layout!r}; layouts: {', '.join(PERMUTATIONS)}")


def to_native(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x [B, C, T, H, W]`` in ``layout`` (a view)."""
    return x.permute(PERMUTATIONS[layout])


def to_canonical(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of :func:`to_native`: ``x`` in ``layout`` as ``[B, C, T, H, W]`` (a view)."""
    inverse = sorted(range(5), key=PERMUTATIONS[layout].__getitem__)
    return x.permute(inverse)
