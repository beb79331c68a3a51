"""The knobs of a model's sparse (``vsa``), fake-quantized (``qat``) and sparse-linear (``sla``) attention, beside
``models.<name>.attention``."""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from fvx.config import Config


class VSAConfig(Config):
    """Video Sparse Attention (``fvx_models.attention.vsa``): ``sparsity`` the fraction of key tiles each query tile
    skips in training steps (FastVideo's ``training.vsa.sparsity``; validation samples at it too), reached by a
    ramp when ``decay_rate`` > 0 (FastVideo's ``vsa.decay_rate`` and ``decay_interval_steps``, which its modular
    trainer parses but never applies: ``decay_rate`` more every ``decay_interval_steps`` steps from dense, as its
    legacy trainer did); ``implementation``: ``reference`` (PyTorch, any device), ``flex`` (flex-attention block
    masks), ``kernel`` (fastvideo-kernel's CUDA kernel), ``auto`` the kernel when installed on a GPU, else the
    reference."""

    sparsity: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.9
    decay_rate: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
    decay_interval_steps: Annotated[int, msgspec.Meta(ge=1)] = 1
    implementation: Literal["auto", "reference", "flex", "kernel"] = "auto"


class QATConfig(Config):
    """Fake-quantized attention for quantization-aware training (``fvx_models.attention.qat``, FastVideo's
    ``ATTN_QAT_TRAIN``): ``implementation`` ``reference`` (PyTorch), ``kernel`` (fastvideo-kernel's Triton kernel),
    ``auto`` the kernel when installed on a GPU, else the reference; ``validation``: what validation samples with,
    ``train`` the same fake quantization, ``infer`` the low-bit inference kernel it simulates (FastVideo's
    ``attn_qat_infer``; needs that kernel)."""

    implementation: Literal["auto", "reference", "kernel"] = "auto"
    validation: Literal["train", "infer"] = "train"


class SLAConfig(Config):
    """Sparse-linear attention (``fvx_models.attention.sla``, FastVideo's ``SLA_ATTN``, TurboWan's attention):
    ``topk_ratio`` the fraction of key blocks each query block attends to (``int(topk_ratio * key blocks)`` of them,
    FastVideo's count), ``block_q`` / ``block_k`` the query and key block sizes in tokens (FastVideo's ``BLKQ`` /
    ``BLKK``), ``feature_map`` the linear part's ``phi`` (softmax over the head dim, ``elu`` + 1, or ``relu``); the
    defaults are FastVideo's, what TurboWan was distilled with (0.1, 128, 64, softmax). ``implementation``:
    ``reference`` (PyTorch, any device and sizes), ``kernel`` (fastvideo-kernel's Triton sparse part: block_q 64 or
    128, block_k 64, head dim 64 or 128), ``auto`` the kernel when installed on a GPU and the sizes fit, else the
    reference."""

    topk_ratio: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.1
    block_q: Annotated[int, msgspec.Meta(ge=1)] = 128
    block_k: Annotated[int, msgspec.Meta(ge=1)] = 64
    feature_map: Literal["softmax", "elu", "relu"] = "softmax"
    implementation: Literal["auto", "reference", "kernel"] = "auto"
