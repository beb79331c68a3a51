"""Sparse-linear attention (SLA, arXiv 2509.24006): block-sparse softmax attention over the key blocks a cheap pooled
pass ranks highest, plus a linear attention over all tokens mixed in through a learned projection ``proj_l``.

A PyTorch reference of FastVideo's ``SLA_ATTN`` backend (TurboDiffusion's SLA, what TurboWan runs), as read in
FastVideo's ``fastvideo/attention/backends/sla.py`` (``get_block_map``, ``mean_pool``/``compress_kernel``,
``SLAAttentionImpl.__init__``/``_init_weights``/``_calc_linear_attention``/``forward``) and
``fastvideo-kernel/python/fastvideo_kernel/triton_kernels/sla_triton.py`` (``_attn_fwd``, ``_attention``), and a thin
wrapper that runs that Triton kernel for the sparse part where installed. Per (batch, head), ``q, k, v [L, D]``:

    smooth    k~ = k - mean over tokens of k                               (SageAttention's smooth-k)
    pool      q_b = per-block means of q (blocks of ``block_q`` tokens), k_b = of k~ (``block_k``); a partial last
              block is the mean of its own tokens
    select    S = q_b k_b^T (no scale) [Mq, Nk]; each query block keeps its top ``c = min(Nk, int(topk_ratio Nk))``
              key blocks (``torch.topk``; not differentiable)
    sparse    o_s = softmax(q k^T / sqrt(D)) v over the tokens of the kept key blocks only (one softmax per query)
    linear    phi = softmax over D (``elu``: elu + 1, ``relu``);
              o_l = phi(q) (phi(k)^T v) / (1e-5 + phi(q) . sum_j phi(k_j)) over ALL tokens (not only unselected blocks)
    output    o = o_s + proj_l(o_l), ``proj_l`` one Linear(D, D) per layer shared by its heads, zero-initialised
              (weight and bias): a fresh SLA layer is its block-sparse part alone, not dense attention (equal to
              dense only when every key block is kept, ``int(topk_ratio Nk) = Nk``)

FastVideo runs the sparse and linear parts in bf16 (``use_bf16``; the kernel accumulates in fp32) and ``proj_l``
under bf16 autocast; the reference computes the block map in the inputs' dtype (FastVideo's ``mean_pool`` sums in
fp32 and stores in it), the sparse and linear parts in fp32, ``proj_l`` in the inputs' dtype (the compute dtype its
params are in: bf16 in a bf16 model, as FastVideo's autocast), and returns the inputs' dtype. The sparse kernel
always uses the scale ``1 / sqrt(D)``; the reference takes any. ``c = 0`` (fewer than ``1 / topk_ratio`` key blocks)
leaves a query with no key: FastVideo's kernel then divides by zero (NaN); here it is a ValueError.
"""
from __future__ import annotations

import importlib
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

FEATURE_MAPS: dict[str, Callable[[Tensor], Tensor]] = {
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "elu": lambda x: F.elu(x) + 1,
    "relu": F.relu,
}
IMPLEMENTATIONS = ("reference", "kernel")
KERNEL_MODULE = "fastvideo_kernel.triton_kernels.sla_triton"  # FastVideo's Triton sparse part (``_attention``)
KERNEL_BLOCK_Q = (64, 128)  # what its ``_attention.forward`` asserts
KERNEL_BLOCK_K = (64,)
KERNEL_HEAD_DIMS = (64, 128)  # SLAAttentionBackend.get_supported_head_sizes
LINEAR_EPS = 1e-5  # the linear part's denominator guard (``_calc_linear_attention``)


def topk_count(topk_ratio: float, blocks: int) -> int:
    """Key blocks each query block keeps: FastVideo's ``min(blocks, int(topk_ratio * blocks))`` (truncation of the
    float product, as FastVideo: ``int(0.29 * 100)`` is 28)."""
    return min(blocks, int(topk_ratio * blocks))


def block_means(x: Tensor, block: int) -> Tensor:
    """Means of ``x [B, H, L, D]`` over consecutive blocks of ``block`` tokens (a partial last block over its own
    tokens): ``[B, H, ceil(L / block), D]``, summed in fp32 and returned in x's dtype."""
    b, h, length, d = x.shape
    n = -(-length // block)
    sums = F.pad(x.float(), (0, 0, 0, n * block - length)).reshape(b, h, n, block, d).sum(3)
    counts = (length - torch.arange(n, device=x.device) * block).clamp(max=block)
    return (sums / counts[:, None]).to(x.dtype)


def select_blocks(q: Tensor, k: Tensor, topk_ratio: float, block_q: int, block_k: int) -> Tensor:
    """The key blocks each query block attends to: ``q, k [B, H, L, D]`` -> ``[B, H, Mq, c]`` long indices (module
    docstring: smoothed k, block means, unscaled pooled scores, top ``c``); not differentiable."""
    q, k = q.detach(), k.detach()
    smooth = k - k.mean(dim=-2, keepdim=True)
    scores = block_means(q, block_q) @ block_means(smooth, block_k).transpose(-1, -2)
    blocks = scores.shape[-1]
    count = topk_count(topk_ratio, blocks)
    if count < 1:
        raise ValueError(f"topk_ratio={topk_ratio}: {q.shape[-2]} tokens make {blocks} key blocks of {block_k}, and "
                         f"int({topk_ratio} * {blocks}) = 0 keeps none; use more tokens, smaller blocks or a larger "
                         f"ratio")
    return torch.topk(scores, count, dim=-1, sorted=False).indices


def sparse_part(q: Tensor, k: Tensor, v: Tensor, selected: Tensor, block_q: int, block_k: int,
                scale: float) -> Tensor:
    """Block-sparse softmax attention: each query of block ``i`` attends (one softmax) to the tokens of the key blocks
    ``selected[..., i, :]``. Gathers those blocks ``[B, H * Mq, c * block_k, D]`` and runs one SDPA per query block
    with the padding of a partial last key block masked, so the cost scales with ``c``. ``[B, H, L, D]`` in and out."""
    b, h, length, d = q.shape
    dv = v.shape[-1]
    mq, nk, count = -(-length // block_q), -(-length // block_k), selected.shape[-1]
    queries = F.pad(q, (0, 0, 0, mq * block_q - length)).reshape(b, h * mq, block_q, d)
    index = selected.reshape(b, h, mq * count, 1)

    def gathered(x: Tensor) -> Tensor:
        blocks = F.pad(x, (0, 0, 0, nk * block_k - length)).reshape(b, h, nk, block_k * x.shape[-1])
        picked = torch.gather(blocks, 2, index.expand(b, h, mq * count, blocks.shape[-1]))
        return picked.view(b, h * mq, count * block_k, x.shape[-1])

    valid = (torch.arange(nk * block_k, device=q.device) < length).view(nk, block_k)
    keep = valid[selected].view(b, h * mq, 1, count * block_k)
    out = F.scaled_dot_product_attention(queries, gathered(k), gathered(v), attn_mask=keep, scale=scale)
    return out.view(b, h, mq * block_q, dv)[:, :, :length]


def linear_part(q: Tensor, k: Tensor, v: Tensor, feature_map: str) -> Tensor:
    """Linear attention over all tokens: ``phi(q) (phi(k)^T v) / (1e-5 + phi(q) . sum_j phi(k_j))``, ``[B, H, L, D]``
    in and out (FastVideo's ``_calc_linear_attention`` after its feature maps)."""
    phi = FEATURE_MAPS[feature_map]
    fq, fk = phi(q), phi(k)
    kv = fk.transpose(-1, -2) @ v  # [B, H, D, Dv]
    ksum = fk.sum(dim=-2, keepdim=True)  # [B, H, 1, D]
    return (fq @ kv) / (LINEAR_EPS + (fq * ksum).sum(dim=-1, keepdim=True))


def _check(q: Tensor, k: Tensor, v: Tensor, projection: Callable[[Tensor], Tensor], topk_ratio: float,
           block_q: int, block_k: int, feature_map: str) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v: shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} are not allowed; SLA "
                         f"is self-attention: one shape [B, H, L, D]")
    d = q.shape[-1]
    sizes = (getattr(projection, "in_features", d), getattr(projection, "out_features", d))
    if not callable(projection) or sizes != (d, d):
        raise ValueError(f"proj_l: {type(projection).__name__} of features {sizes} is not allowed; it must be a "
                         f"callable Linear({d}, {d}) (the head dim)")
    if not 0.0 < topk_ratio <= 1.0:
        raise ValueError(f"topk_ratio={topk_ratio} is not allowed; it must be in (0, 1]")
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}={size!r} is not allowed; it must be a positive int (tokens)")
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map={feature_map!r} is not allowed; one of {', '.join(FEATURE_MAPS)}")


def sparse_linear_attention(q: Tensor, k: Tensor, v: Tensor, projection: Callable[[Tensor], Tensor],
                            topk_ratio: float = 0.1, block_q: int = 128, block_k: int = 64,
                            feature_map: str = "softmax", scale: float | None = None,
                            implementation: str = "reference") -> Tensor:
    """SLA (module docstring) of ``q, k, v [B, H, L, D]`` with ``projection`` its ``proj_l`` (a Linear(D, D), called:
    hooks on it, a LoRA's, apply) -> ``[B, H, L, D]`` in q's dtype; ``scale`` defaults to ``1 / sqrt(D)``. The
    projection takes the linear part in q's dtype (the compute dtype its params are in; FastVideo's autocast).
    Differentiable in q, k, v and the projection (the block selection is not). ``implementation="kernel"``:
    :func:`sla_attention_kernel`."""
    _check(q, k, v, projection, topk_ratio, block_q, block_k, feature_map)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not allowed; one of {', '.join(IMPLEMENTATIONS)}")
    if implementation == "kernel":
        return sla_attention_kernel(q, k, v, projection, topk_ratio, block_q, block_k, feature_map, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    selected = select_blocks(q, k, topk_ratio, block_q, block_k)
    qf, kf, vf = q.float(), k.float(), v.float()
    o_s = sparse_part(qf, kf, vf, selected, block_q, block_k, scale)
    o_l = linear_part(qf, kf, vf, feature_map)
    return (o_s + projection(o_l.to(q.dtype)).float()).to(q.dtype)


# ----------------------------------------------------------------------------------------------------------- kernel


def kernel_available() -> str | None:
    """None if FastVideo's Triton SLA kernel can run here, else one line why."""
    if not torch.cuda.is_available():
        return "no CUDA device (fastvideo-kernel's sla_triton is a Triton CUDA kernel)"
    try:
        importlib.import_module(KERNEL_MODULE)
    except Exception as error:  # a probe: a missing package, triton or CUDA toolchain are all reasons
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        return f"{KERNEL_MODULE} is not importable ({type(error).__name__}: {detail})"
    return None


def kernel_refusal(head_dim: int, block_q: int, block_k: int, scale: float | None = None) -> str | None:
    """Why the kernel cannot take these sizes (one line), or None."""
    if head_dim not in KERNEL_HEAD_DIMS:
        return f"the SLA kernel takes head dims {KERNEL_HEAD_DIMS}, not {head_dim}"
    if block_q not in KERNEL_BLOCK_Q or block_k not in KERNEL_BLOCK_K:
        return (f"the SLA kernel takes block_q in {KERNEL_BLOCK_Q} and block_k {KERNEL_BLOCK_K[0]}, not {block_q}, "
                f"{block_k}")
    if scale is not None and not math.isclose(scale, head_dim ** -0.5):
        return f"the SLA kernel uses the scale 1/sqrt(D) = {head_dim ** -0.5:.6g}, not {scale}"
    return None


def sla_attention_kernel(q: Tensor, k: Tensor, v: Tensor, projection: Callable[[Tensor], Tensor],
                         topk_ratio: float = 0.1, block_q: int = 128, block_k: int = 64,
                         feature_map: str = "softmax", scale: float | None = None) -> Tensor:
    """SLA with the sparse part on FastVideo's Triton ``_attention`` (forward and backward), called as its
    ``SLAAttentionImpl.forward`` calls it: q, k, v in bf16, the int8 block map and the top-k table, the linear part
    in bf16, ``projection`` (``proj_l``) taking it in q's dtype. ``[B, H, L, D]`` in, q's dtype out. ImportError
    (one line) where :func:`kernel_available` says it cannot run; ValueError for sizes it does not take
    (:func:`kernel_refusal`)."""
    why = kernel_available()
    if why is not None:
        raise ImportError(f"FastVideo's SLA kernel is not available here: {why}")
    why = kernel_refusal(q.shape[-1], block_q, block_k, scale)
    if why is not None:
        raise ValueError(why)
    attention = importlib.import_module(KERNEL_MODULE)._attention
    selected = select_blocks(q, k, topk_ratio, block_q, block_k).contiguous()
    b, h, mq, count = selected.shape
    blocks = -(-q.shape[-2] // block_k)
    block_map = torch.zeros(b, h, mq, blocks, dtype=torch.int8, device=q.device).scatter_(-1, selected, 1)
    qb, kb, vb = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    o_s = attention.apply(qb, kb, vb, block_map, selected, count, block_q, block_k)
    o_l = linear_part(qb, kb, vb, feature_map)
    return (o_s.to(q.dtype) + projection(o_l.to(q.dtype))).to(q.dtype)
