"""Attn-QAT: softmax attention that simulates an NVFP4 inference kernel, for quantization-aware training.

A PyTorch reference of FastVideo's ``ATTN_QAT_TRAIN`` (its Triton kernel ``attn_qat_train`` as the backend calls it:
per-block scales only, no global scale; single-level P quantization; STE backward on the fake-quantized Q, K, V;
the high-precision output for the backward's Delta), plus thin wrappers that run FastVideo's kernels where installed.

NVFP4 fake quantization (``fake_quantize``): blocks of 16 along one dim; each block's scale is ``amax / 6`` rounded to
FP8 E4M3 (saturating at 448), each element ``x / scale`` rounded to E2M1 (``e2m1``) and multiplied back.

Forward (``qat_attention``), per row of ``[B, H, Lq, Lk]`` scores, with ``q^ k^ v^`` the fake-quantized inputs:
  ``S = q^ k^T scale + mask``, ``m = rowmax(S)``, ``p = exp(S - m)`` (in [0, 1]), ``l = rowsum(p)`` (unquantised),
  ``O = fq(p) v^ / l`` (``fq`` along the key dim).
Backward (straight-through: every quantizer passes gradients unchanged), with ``P = p / l`` the normalised
probabilities and ``O_hp = p v^ / l`` the high-precision output:
  ``dV = fq(P)^T dO``, ``dP = dO v^T``, ``Delta = rowsum(dO * O_hp)``, ``dS = P * (dP - Delta)``,
  ``dq = dS k^ scale``, ``dk = dS^T q^ scale``.
  ``dV`` fake-quantizes the NORMALISED ``P`` (not ``fq(p) / l``): the kernel's backward recomputes ``P`` from the
  saved ``m + log l`` and quantizes that, so the reference does the same.

Where the reference and the kernel differ by construction:
  - the kernel quantizes ``p`` per tile against the running row max (flash-attention style); the reference uses the
    row's final max, so a block's scale (and hence its E4M3/E2M1 roundings) can differ in tiles whose running max
    was below the final one;
  - the kernel rounds ``p`` and its operands to bf16 for its matmuls; the reference stays in fp32;
  - the kernel has no attention mask; the reference's mask support (masked scores give ``p = 0``) is an extension.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

E2M1_MAX = 6.0  # largest E2M1 magnitude
E4M3_MAX = 448.0  # largest finite FP8 E4M3 (fn) magnitude
NVFP4_BLOCK = 16  # elements sharing one scale


def e2m1(x: Tensor) -> Tensor:
    """Round each element of float ``x`` (any shape) to the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} with its sign:
    nearest, ties to even code, magnitudes above 6 saturate to 6 (as PTX ``cvt.rn.satfinite.e2m1``); NaN stays NaN."""
    if not x.is_floating_point():
        raise ValueError(f"x: dtype {x.dtype} is not allowed; e2m1 takes a floating-point tensor")
    a = x.abs()
    # The grid's step is 0.5 below 2, 1 in [2, 4), 2 from 4: scale each range to integer steps and round half to
    # even there (the step index's parity is the code's parity), then saturate.
    r = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(r.clamp(max=E2M1_MAX), x)


def e4m3_scale(amax: Tensor) -> Tensor:
    """A block's NVFP4 scale from its absolute max (``[...]``, fp32): ``amax / 6`` rounded to FP8 E4M3 (nearest, ties
    to even). Clamped to 448 first, so saturation does not depend on how torch's float8 cast treats overflow."""
    return (amax / E2M1_MAX).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()


def fake_quantize(x: Tensor, dim: int = -1, block: int = NVFP4_BLOCK) -> Tensor:
    """NVFP4 quantize-dequantize of float ``x`` (any shape) in blocks of ``block`` along ``dim``; same shape and dtype.

    A block's scale is ``e4m3(amax / 6)`` and its elements ``e2m1(x * (1 / scale)) * scale`` (the kernel multiplies
    by the reciprocal). A block whose scale rounds to 0 (all zeros, or ``amax < 6 * 2**-10``: no global scale lifts
    small blocks) comes back as zeros. A ``dim`` that is not a multiple of ``block`` is padded with zeros for the
    scale computation (zeros never change a block's max: the kernel's masked tail). Computed in fp32; no gradient
    (``qat_attention`` supplies the straight-through one); inputs are expected finite.
    """
    if not x.is_floating_point():
        raise ValueError(f"x: dtype {x.dtype} is not allowed; fake_quantize takes a floating-point tensor")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} is not allowed; it must be a positive int (NVFP4 uses 16)")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is not allowed for x of shape {tuple(x.shape)}; it must index one of its dims")
    moved = x.detach().float().movedim(dim, -1)
    n = moved.shape[-1]
    blocks = F.pad(moved, (0, -n % block)).unflatten(-1, (-1, block))
    scale = e4m3_scale(blocks.abs().amax(dim=-1, keepdim=True))
    inverse = torch.where(scale > 0, 1.0 / scale, 0.0)  # guard 0/0: a zero scale gives a zero block
    out = (e2m1(blocks * inverse) * scale).flatten(-2)[..., :n]
    return out.movedim(-1, dim).to(x.dtype)


class _QatAttention(torch.autograd.Function):
    """Fake-quantized attention on fp32 ``q [B, H, Lq, D]``, ``k [B, H, Lk, D]``, ``v [B, H, Lk, Dv]`` with an
    additive fp32 ``mask`` (broadcastable to ``[B, H, Lq, Lk]``, or None); the STE backward of the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, quantize):
        qh, kh, vh = quantize(q, dim=-1), quantize(k, dim=-1), quantize(v, dim=-1)
        scores = _scores(qh, kh, mask, scale)
        m = scores.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, 0.0)  # a fully masked row: every p = 0 (and l = 0)
        p = torch.exp(scores - m)
        # l is 0 for a fully masked row and otherwise >= 1 (the max entry contributes exp(0) = 1): clamping at 1
        # changes nothing else and makes such a row's output 0 instead of 0/0.
        l = p.sum(dim=-1, keepdim=True).clamp(min=1.0)
        out = quantize(p, dim=-1) @ vh / l
        out_hp = p @ vh / l
        ctx.save_for_backward(qh, kh, vh, out_hp, m, l, mask)
        ctx.scale, ctx.quantize = scale, quantize
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qh, kh, vh, out_hp, m, l, mask = ctx.saved_tensors
        probs = torch.exp(_scores(qh, kh, mask, ctx.scale) - m) / l  # normalised P [B, H, Lq, Lk]
        grad_v = ctx.quantize(probs, dim=-1).transpose(-1, -2) @ grad_out
        delta = (grad_out * out_hp).sum(dim=-1, keepdim=True)
        grad_scores = probs * (grad_out @ vh.transpose(-1, -2) - delta)
        grad_q = grad_scores @ kh * ctx.scale
        grad_k = grad_scores.transpose(-1, -2) @ qh * ctx.scale
        return grad_q, grad_k, grad_v, None, None, None


def _scores(qh: Tensor, kh: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """``q^ k^T scale (+ mask)``: ``[B, H, Lq, Lk]`` fp32."""
    scores = qh @ kh.transpose(-1, -2) * scale
    return scores if mask is None else scores + mask


def additive_mask(attn_mask: Tensor | None, is_causal: bool, shape: tuple[int, int, int, int],
                  device: torch.device) -> Tensor | None:
    """SDPA's masks as one additive fp32 mask broadcastable to ``shape`` ``[B, H, Lq, Lk]``, or None: a bool mask
    keeps True entries (False -> -inf), a float mask is added as is, ``is_causal`` keeps ``k <= q`` (top-left)."""
    out = None
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(f"attn_mask: dtype {attn_mask.dtype} is not allowed; it must be bool or floating")
        try:
            fits = torch.broadcast_shapes(attn_mask.shape, shape) == torch.Size(shape)
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"attn_mask: shape {tuple(attn_mask.shape)} is not allowed; it must broadcast to "
                             f"[B, H, Lq, Lk] = {list(shape)}")
        attn_mask = attn_mask.to(device)
        out = (torch.where(attn_mask, 0.0, float("-inf")) if attn_mask.dtype == torch.bool
               else attn_mask.detach().float())
    if is_causal:
        keep = torch.ones(shape[-2], shape[-1], dtype=torch.bool, device=device).tril()
        causal = torch.where(keep, 0.0, float("-inf"))
        out = causal if out is None else out + causal
    return out


def qat_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, scale: float | None = None,
                  quantize: Callable[..., Tensor] = fake_quantize, is_causal: bool = False) -> Tensor:
    """Fake-quantized attention (module docstring) of ``q [B, H, Lq, D]``, ``k [B, H, Lk, D]``, ``v [B, H, Lk, Dv]``
    -> ``[B, H, Lq, Dv]`` in q's dtype, computed in fp32; ``scale`` defaults to ``1 / sqrt(D)``.

    ``attn_mask``: bool (True = attend) or additive float, broadcastable to ``[B, H, Lq, Lk]``; masked scores get
    ``p = 0`` (a row with nothing to attend to gives 0); the mask gets no gradient. ``quantize(x, dim=...)`` is the
    fake quantizer (``fake_quantize``; pass an identity to get plain softmax attention, forward and backward).
    Masking keys is not the same as dropping them unless the dropped keys are whole aligned blocks of 16 (or the
    tail): ``fq(p)`` groups keys by position.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4 or not x.is_floating_point():
            raise ValueError(f"{name}: shape {tuple(x.shape)} dtype {x.dtype} is not allowed; it must be a 4-D "
                             f"floating [B, H, L, D] tensor")
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q, k, v: shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} are not allowed; "
                         f"they must be [B, H, Lq, D], [B, H, Lk, D], [B, H, Lk, Dv]")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    mask = additive_mask(attn_mask, is_causal, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device)
    out = _QatAttention.apply(q.float(), k.float(), v.float(), mask, float(scale), quantize)
    return out.to(q.dtype)


TRAIN_MODULE = "fastvideo_kernel.triton_kernels.attn_qat_train"  # FastVideo's Triton train kernel
INFER_MODULE = "attn_qat_infer"  # FastVideo's SageAttention3-based NVFP4 inference kernel (sm_120 / sm_121)
INFER_CAPABILITIES = ((12, 0), (12, 1))


def _import_why(module: str) -> str | None:
    """None if ``module`` imports, else one line why."""
    try:
        importlib.import_module(module)
    except Exception as error:  # a probe: any failure to import (missing package, CUDA extension, triton) is a reason
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        return f"{module} is not importable ({type(error).__name__}: {detail})"
    return None


def _loaded(available: Callable[[], str | None], module: str, name: str, what: str) -> Callable:
    """``module.name`` when ``available()`` says it can run, else ImportError (one line)."""
    why = available()
    if why is not None:
        raise ImportError(f"FastVideo's {what} kernel is not available here: {why}")
    return getattr(importlib.import_module(module), name)


def kernel_available() -> str | None:
    """None if FastVideo's Triton Attn-QAT train kernel can run here, else one line why."""
    if not torch.cuda.is_available():
        return "no CUDA device (FastVideo's attn_qat_train is a Triton CUDA kernel)"
    return _import_why(TRAIN_MODULE)


def qat_attention_kernel(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """FastVideo's ``attn_qat_train`` on CUDA ``q, k, v [B, H, L, D]`` -> ``[B, H, L, D]`` in q's dtype, called as its
    ``ATTN_QAT_TRAIN`` backend calls it (per-block scales only, single-level P, STE on fake Q/K/V, high-precision O
    for Delta, no K smoothing, not causal); the kernel runs in bf16, so inputs are cast to bf16 (differentiably).
    ImportError (one line) where ``kernel_available()`` says it cannot run."""
    attention = _loaded(kernel_available, TRAIN_MODULE, "attention", "attn_qat_train")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    warp_specialize = torch.cuda.get_device_capability(q.device)[0] not in (10, 12)  # as the backend: off on Blackwell
    out = attention(q.bfloat16().contiguous(), k.bfloat16().contiguous(), v.bfloat16().contiguous(),
                    False,  # is_causal
                    float(scale),
                    True,  # use_qat_qkv_backward
                    False,  # smooth_k
                    warp_specialize,
                    True,  # is_qat
                    False,  # two_level_quant_p
                    True,  # fake_quant_p (also in the backward)
                    True,  # use_high_prec_o
                    False,  # smooth_q
                    False,  # use_global_sf_p
                    False)  # use_global_sf_qkv
    return out.to(q.dtype)


def infer_kernel_available() -> str | None:
    """None if FastVideo's Attn-QAT inference kernel (``attn_qat_infer.sageattn_blackwell``, built for sm_120/121)
    can run here, else one line why."""
    if not torch.cuda.is_available():
        return "no CUDA device (FastVideo's attn_qat_infer is a CUDA kernel)"
    capability = tuple(torch.cuda.get_device_capability())
    if capability not in INFER_CAPABILITIES:
        return f"attn_qat_infer is built for sm_120/sm_121; this device is sm_{capability[0]}{capability[1]}"
    return _import_why(INFER_MODULE)


def qat_attention_infer(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """FastVideo's NVFP4 inference attention on CUDA ``q, k, v [B, H, L, D]`` -> ``[B, H, L, D]``, called as its
    ``ATTN_QAT_INFER`` backend calls it on sm_120/121 (no mask, not causal). No gradient. ImportError (one line) where
    ``infer_kernel_available()`` says it cannot run."""
    sageattn_blackwell = _loaded(infer_kernel_available, INFER_MODULE, "sageattn_blackwell", "attn_qat_infer")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = sageattn_blackwell(q.contiguous(), k.contiguous(), v.contiguous(), attn_mask=None, is_causal=False,
                             sm_scale=float(scale))
    return out.to(q.dtype)
