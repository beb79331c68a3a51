"""DiffusionNFT (FastVideo's DiffusionNFTMethod, spec §2.11; NVlabs' DiffusionNFT): online RL for a flow model by
negative-aware fine-tuning. Samples of a slow-moving old policy are scored by rewards, the rewards become per-group
advantages (``fvx_methods.library.rl``), and the student learns to move towards the samples the advantage favours
and away from the others through two implicit policies around the old one.

The loss at one timestep ``t`` (in [0, 1]) of a sample ``x0`` with advantage ``A``::

    x_t  = (1 - t) x0 + t eps
    A_c  = clamp(A, -C, C), then by adv_mode: positive_only clamp(A_c, 0, C); negative_only clamp(A_c, -C, 0);
           one_only 1[A_c > 0]; binary sign(A_c); all: A_c
    r    = clamp((A_c / C) / 2 + 0.5, 0, 1)
    v+   = beta v_theta + (1 - beta) sg(v_old);          v- = (1 + beta) sg(v_old) - beta v_theta
    x0+- = x_t - t v+-;   w+- = sg(max(mean_{CTHW} |x0+- - x0| (float64), 1e-5))
    L+-_b = mean_{CTHW}((x0+- - x0)^2 / w+-)
    L_policy = mean_b(C (r L+_b / beta + (1 - r) L-_b / beta))
    L_kl     = mean_b mean_{CTHW}((v_theta - sg(v_ref))^2)
    total    = L_policy + kl_beta L_kl

(``C`` is ``adv_clip_max``; ``v_old`` and ``v_ref`` the old policy's and the reference's velocities, no grad). The
outer step, sampling with the old policy, scoring, the inner epochs and the old policy's update, is to come (issue 27).
"""
from __future__ import annotations

from typing import Literal

import torch

AdvantageMode = Literal["all", "positive_only", "negative_only", "one_only", "binary"]
WEIGHT_FLOOR = 1e-5  # the adaptive x0-space weights' floor


def clipped_advantages(advantages: torch.Tensor, clip_max: float, mode: AdvantageMode) -> torch.Tensor:
    """``advantages [B]`` clamped to ``[-C, C]`` and shaped by ``mode`` (module docstring)."""
    clipped = torch.clamp(advantages, -clip_max, clip_max)
    if mode == "positive_only":
        return torch.clamp(clipped, 0, clip_max)
    if mode == "negative_only":
        return torch.clamp(clipped, -clip_max, 0)
    if mode == "one_only":
        return (clipped > 0).to(clipped.dtype)
    if mode == "binary":
        return torch.sign(clipped)
    if mode != "all":
        raise ValueError(f"adv_mode must be one of all, positive_only, negative_only, one_only, binary; got {mode!r}")
    return clipped


def weighted_x0_loss(x0_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """``[B]``: ``mean((x0_pred - x0)^2 / w)`` per sample, ``w = sg(max(mean|x0_pred - x0|, 1e-5))`` computed in
    float64 as DiffusionNFT does."""
    dims = tuple(range(1, x0.dim()))
    with torch.no_grad():
        weight = (x0_pred.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp_min(WEIGHT_FLOOR)
    return ((x0_pred - x0) ** 2 / weight).mean(dim=dims)


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, v_ref: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor,
             t: torch.Tensor, advantages: torch.Tensor, *, beta: float, adv_clip_max: float, adv_mode: AdvantageMode,
             kl_beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(total, aux)`` of the module docstring for velocities ``[B, C, T, H, W]`` at ``x_t``, clean samples ``x0``,
    timesteps ``t [B]`` in [0, 1] and ``advantages [B]``; differentiable in ``v_theta`` only. aux: ``policy_loss``,
    ``unweighted_policy_loss``, ``kl_div_loss``, ``old_deviate`` (mean (v_theta - v_old)^2), ``old_kl_div`` (mean
    (v_old - v_ref)^2), ``x0_norm`` (mean x0^2)."""
    v_old, v_ref = v_old.detach(), v_ref.detach()
    t = t.view(-1, *([1] * (x0.dim() - 1)))
    r = torch.clamp(clipped_advantages(advantages, adv_clip_max, adv_mode) / adv_clip_max / 2 + 0.5, 0, 1)
    positive = weighted_x0_loss(x_t - t * (beta * v_theta + (1 - beta) * v_old), x0)
    negative = weighted_x0_loss(x_t - t * ((1 + beta) * v_old - beta * v_theta), x0)
    unweighted = r * positive / beta + (1 - r) * negative / beta
    policy = (unweighted * adv_clip_max).mean()
    kl = ((v_theta - v_ref) ** 2).mean(dim=tuple(range(1, x0.dim()))).mean()
    aux = {"policy_loss": policy.detach(), "unweighted_policy_loss": unweighted.mean().detach(),
           "kl_div_loss": kl.detach(), "old_deviate": ((v_theta - v_old) ** 2).mean().detach(),
           "old_kl_div": ((v_old - v_ref) ** 2).mean(), "x0_norm": (x0 ** 2).mean()}
    return policy + kl_beta * kl, aux
