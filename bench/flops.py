"""Analytic FLOPs of a Wan-style DiT step, for MFU (MaxDiffusion's per-block count; a multiply-add is 2 FLOPs).

Per block and sample, with ``S`` video tokens, ``L`` text tokens, width ``D`` and FFN width ``F``:

    qkv              6 S D^2        self-attention q, k, v projections
    self_attention   4 S^2 D        Q K^T and A V
    self_out         2 S D^2        self-attention output projection
    cross_q_out      4 S D^2        cross-attention q and output projections
    cross_kv         4 L D^2        cross-attention k, v projections of the (already D-wide) text
    cross_attention  4 S L D
    ffn              4 S D F

and once per sample the root: patch embedding ``2 S D C p``, output projection ``2 S D C_out p`` (``p`` the patch
volume), text embedder ``2 L (D_text D + D^2)``, time embedder ``2 (D_freq D + D^2) + 12 D^2``. Norms, activations
and softmax are not counted. Training is 3x the forward (backward = 2x); activation recompute (remat) is *not*
counted, as MFU counts the model's FLOPs, not the hardware's. tests/fvx/test_memory.py checks these numbers against
``torch.utils.flop_counter`` on the tiny Wan model.
"""
from __future__ import annotations

import math
from typing import NamedTuple

H200_BF16_DENSE = 989e12  # FLOP/s, dense bf16 tensor cores


class DitDims(NamedTuple):
    """The sizes of a Wan-style DiT that the FLOP count needs."""

    layers: int
    dim: int
    ffn_dim: int
    text_len: int  # tokens the cross-attention attends to
    text_dim: int  # width of the text encoder's embeddings
    in_channels: int
    out_channels: int
    patch: tuple[int, int, int]
    freq_dim: int  # width of the sinusoidal timestep embedding


def wan_dims(preset: str, text_len: int | None = None) -> DitDims:
    """The :class:`DitDims` of a ``fvx_models.wan`` preset; ``text_len`` defaults to the preset's (512 for UMT5)."""
    from fvx_models import wan

    spec = wan.WAN.preset(preset)
    k = spec.kwargs
    return DitDims(layers=k["num_layers"], dim=k["num_attention_heads"] * k["attention_head_dim"],
                   ffn_dim=k["ffn_dim"], text_len=spec.text_len if text_len is None else text_len,
                   text_dim=k["text_dim"], in_channels=k["in_channels"], out_channels=k["out_channels"],
                   patch=tuple(k["patch_size"]), freq_dim=k["freq_dim"])


def block_flops(dims: DitDims, tokens: int) -> dict[str, int]:
    """Forward FLOPs of one block for one sample of ``tokens`` tokens, term by term."""
    s, l, d, f = tokens, dims.text_len, dims.dim, dims.ffn_dim
    return {"qkv": 6 * s * d * d, "self_attention": 4 * s * s * d, "self_out": 2 * s * d * d,
            "cross_q_out": 4 * s * d * d, "cross_kv": 4 * l * d * d, "cross_attention": 4 * s * l * d,
            "ffn": 4 * s * d * f}


def root_flops(dims: DitDims, tokens: int) -> dict[str, int]:
    """Forward FLOPs outside the blocks for one sample."""
    d, p = dims.dim, math.prod(dims.patch)
    return {"patch_embedding": 2 * tokens * d * dims.in_channels * p,
            "proj_out": 2 * tokens * d * dims.out_channels * p,
            "text_embedder": 2 * dims.text_len * (dims.text_dim * d + d * d),
            "time_embedder": 2 * (dims.freq_dim * d + d * d) + 12 * d * d}


def forward_flops(dims: DitDims, tokens: int, batch: int = 1) -> int:
    """Forward FLOPs of the whole model for ``batch`` samples."""
    per_sample = dims.layers * sum(block_flops(dims, tokens).values()) + sum(root_flops(dims, tokens).values())
    return batch * per_sample


def training_flops(dims: DitDims, tokens: int, batch: int = 1) -> int:
    """FLOPs of one training step (forward + backward) for ``batch`` samples: 3x the forward."""
    return 3 * forward_flops(dims, tokens, batch)


def mfu(flops: float, seconds: float, peak: float = H200_BF16_DENSE) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak."""
    return flops / seconds / peak
