"""The attention kernels a model can run its self-attention with, by name (``models.<name>.attention``).

Each kernel takes SDPA's arguments (``q, k, v [B, H, L, D]``, ``attn_mask``, ``dropout_p``, ``is_causal``,
``scale``, ``enable_gqa``) and returns ``[B, H, Lq, D]``:
  ``sdpa``   PyTorch's ``scaled_dot_product_attention`` (its fused kernels; the default)
  ``math``   softmax attention written out in fp32 torch ops: every transform (``torch.func.jvp``, dual tensors) runs
             through it, the reference the others are checked against
  ``flex``   ``torch.nn.attention.flex_attention`` (an additive or boolean mask as its score_mod); no backward on a
             CPU in torch 2.13
  ``vsa``    Video Sparse Attention (``fvx_models.attention.vsa``), ``qat`` fake-quantized attention
             (``fvx_models.attention.qat``), ``sla`` sparse-linear attention (``fvx_models.attention.sla``):
             installed with their own inputs (``fvx_models.attention.install``)
  and each kernel of diffusers' attention dispatcher that is usable here (``flash``, ``sage``, ``xformers``, ...).
A name that is unknown or not usable here is refused in one line listing the usable ones; nothing falls back.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

OWN = ("sdpa", "math", "flex", "vsa", "qat", "sla")
FORWARD_AD = ("sdpa", "math")  # kernels with forward-mode derivatives (sdpa through its math backend)


def dispatcher_names() -> tuple[str, ...]:
    """The kernels of diffusers' attention dispatcher that fvx offers: its public names but PyTorch's own (``native``,
    ``flex``, which are ``sdpa`` and ``flex`` here) and the hub downloads (nothing is downloaded during a run)."""
    from diffusers.models.attention_dispatch import AttentionBackendName
    return tuple(member.value for member in AttentionBackendName if not member.value.startswith("_")
                 and member.value not in ("native", "flex") and not member.value.endswith("_hub"))


def unusable(name: str) -> str | None:
    """Why kernel ``name`` cannot run on this machine, or None when it can."""
    if name in OWN:
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements
    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except (RuntimeError, ImportError) as error:
        return str(error).split(". ")[0]
    return None


def usable() -> tuple[str, ...]:
    """Every kernel name that runs here: fvx's own and the dispatcher's installed ones."""
    return OWN + tuple(name for name in dispatcher_names() if unusable(name) is None)


def check_known(name: str) -> None:
    """A ValueError unless ``name`` is one of fvx's kernels or of diffusers' dispatcher (usable here or not)."""
    if name not in OWN + dispatcher_names():
        raise ValueError(f"attention={name!r} is not an attention kernel; usable here: {', '.join(usable())}")


def check(name: str, who: str) -> None:
    """A ValueError naming ``who`` (the knob) unless the known kernel ``name`` is usable here."""
    why = unusable(name)
    if why is not None:
        raise ValueError(f"{who}={name}: diffusers' {name} kernel is not usable here ({why}); usable here: "
                         f"{', '.join(usable())}")


def math_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """``softmax(q k^T scale + mask) v`` in fp32, returned in q's dtype (``[B, H, Lq, D]``); a fully masked query
    row gives 0."""
    _no_dropout(dropout_p)
    q, k, v = query.float(), key.float(), value.float()
    if enable_gqa and k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.float())
    weights = scores.softmax(dim=-1)
    if attn_mask is not None:  # a query that may see no key attends to nothing: 0, as PyTorch's SDPA gives
        weights = weights.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
    return (weights @ v).to(query.dtype)


def flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
         enable_gqa: bool = False) -> torch.Tensor:
    """``flex_attention`` with SDPA's arguments: a mask (boolean or additive, broadcast to ``[B, H, Lq, Lk]``) becomes
    its score_mod."""
    from torch.nn.attention.flex_attention import flex_attention
    _no_dropout(dropout_p)
    if is_causal:
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    score_mod = None if attn_mask is None else _added(attn_mask, query, key)
    return flex_attention(query, key, value, score_mod=score_mod, scale=scale, enable_gqa=enable_gqa)


def _added(attn_mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> Callable:
    """A score_mod adding SDPA's mask (boolean: -inf where False), broadcast to ``[B, H, Lq, Lk]``."""
    mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[-2], key.shape[-2])
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))

    def score_mod(score, b, h, q_index, k_index):
        return score + mask[b, h, q_index, k_index].to(score.dtype)
    return score_mod


def dispatched(name: str) -> Callable[..., torch.Tensor]:
    """Kernel ``name`` of diffusers' dispatcher with SDPA's arguments and layout (the dispatcher takes
    ``[B, L, H, D]``)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
    backend = AttentionBackendName(name)

    def kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        out = dispatch_attention_fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                    attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                    enable_gqa=enable_gqa, backend=backend)
        return out.transpose(1, 2)
    return kernel


def plain(name: str) -> Callable[..., torch.Tensor] | None:
    """The SDPA-shaped kernel of a name that needs nothing beyond SDPA's inputs (None for ``sdpa``: the call stays)."""
    if name == "sdpa":
        return None
    if name == "math":
        return math_attention
    if name == "flex":
        return flex
    return dispatched(name)


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise ValueError(f"attention dropout {dropout_p} is not supported by fvx's kernels (training runs without)")
