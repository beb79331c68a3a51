"""Forward-mode derivatives of a function: ``d/dh fn(primals + h tangents)`` at ``h = 0`` (a Jacobian-vector product),
what losses on a model's own derivative need (a flow map's ``du/dt`` along a trajectory).

Three ways, chosen by the caller's config, never switched silently:
  ``ad``                 ``torch.func.jvp``: exact, about 8x a forward; eager only (it cannot be traced inside a
                         ``torch.compile``'d function), one process only (module-level autograd functions, such as
                         the gathers of sharded params, need functorch support it refuses without)
  ``dual``               dual tensors (``torch.autograd.forward_ad``): exact, the same numbers, about 5x a forward;
                         eager only; runs on sharded params
  ``finite_difference``  ``(fn(p + h t) - fn(p - h t)) / 2h``: two plain forwards, so it runs with any attention kernel
                         and compiled; error O(h^2) plus rounding / h
Forward-mode AD through scaled-dot-product attention needs the math kernel (the fused CPU and GPU kernels have no
forward derivative), so ``ad`` and ``dual`` run ``fn`` under ``sdpa_kernel(MATH)``, restored after.
"""
from __future__ import annotations

from typing import Callable, Literal, Sequence

import torch
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel

Mode = Literal["ad", "dual", "finite_difference"]
MODES = ("ad", "dual", "finite_difference")


def directional(fn: Callable[..., torch.Tensor], primals: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor],
                *, mode: Mode = "ad", step: float = 1e-3) -> torch.Tensor:
    """The derivative of ``fn(*primals)`` (one tensor) along ``tangents`` (one per primal, same shapes), by ``mode``
    (module docstring; ``step`` is the finite difference's ``h``). Gradients flow as the caller's grad mode says."""
    if mode not in MODES:
        raise ValueError(f"unknown derivative mode {mode!r}; expected one of {', '.join(MODES)}")
    if len(primals) != len(tangents):
        raise ValueError(f"{len(primals)} primals but {len(tangents)} tangents")
    tangents = [torch.broadcast_to(t.to(p.dtype), p.shape).contiguous() for p, t in zip(primals, tangents)]
    if mode == "finite_difference":
        if not step > 0:
            raise ValueError(f"finite_difference needs step > 0, got {step}")
        ahead = fn(*[p + step * t for p, t in zip(primals, tangents)])
        behind = fn(*[p - step * t for p, t in zip(primals, tangents)])
        return (ahead - behind) / (2 * step)
    with sdpa_kernel([SDPBackend.MATH]):
        if mode == "ad":
            return torch.func.jvp(fn, tuple(primals), tuple(tangents))[1]
        with forward_ad.dual_level():
            out = fn(*[forward_ad.make_dual(p, t) for p, t in zip(primals, tangents)])
            return forward_ad.unpack_dual(out).tangent


def check_mode(mode: Mode, *, compiled: bool, sharded: bool, who: str, no_forward_ad: str | None = None) -> None:
    """A ValueError when ``mode`` cannot run on a model (``who``, the knob that chose it): exact forward-mode AD on a
    compiled model, or through an attention kernel without forward derivatives (``no_forward_ad`` says why);
    ``ad`` through sharded params, whose gathers are autograd functions ``torch.func`` transforms refuse (dual
    tensors pass them: the params carry no tangent)."""
    if mode in ("ad", "dual") and no_forward_ad is not None:
        raise ValueError(f"{who}={mode} needs forward-mode derivatives, but {no_forward_ad}; use "
                         f"{who}=finite_difference, or the model's attention=math")
    if mode in ("ad", "dual") and compiled:
        raise ValueError(f"{who}={mode} runs forward-mode AD eagerly and cannot run inside a compiled model "
                         f"(compile=blocks or model); use {who}=finite_difference, or compile=none")
    if mode == "ad" and sharded:
        raise ValueError(f"{who}=ad (torch.func.jvp) cannot run through the gathers of params sharded over "
                         f"processes; use {who}=dual (the same numbers, by dual tensors)")
