"""Autoregressive streaming sampling of a block-causal model (``Model.causal``), block by block with its KV cache.

Block ``b`` starts from its slice of the noise and is denoised along the schedule (Euler ODE or re-noising SDE, as
``fvx.core.flow``), every call attending to the cached context of blocks ``< b``; the clean result is then run once more
at ``t = context_noise`` (re-noised to that level when above 0, FastVideo's ``context_noise``) and that pass's keys
and values become the context of the next block (the last block's is never needed, so never computed).
Classifier-free guidance keeps a second cache for the unconditional branch (each branch's context is its own, as two
streams of one model). Randomness: block ``b`` uses
``fold_in(key, b)``, split into the sampler's key and the context noise's.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from fvx.core import flow, random
from fvx_models.model import Causal, Cond, Params

Guidance = tuple[Callable[[Cond], Cond], float]  # (uncond(cond) -> the unconditional cond, the CFG scale)


def sample(causal: Causal, params: Params, noise: torch.Tensor, sigmas: Sequence[float] | torch.Tensor, cond: Cond,
           key: torch.Tensor | None = None, *, sampler: str = "ode", context_noise: float = 0.0,
           guidance: Guidance | None = None, timesteps: Sequence[float] | torch.Tensor | None = None,
           context_sigma: float | None = None) -> torch.Tensor:
    """Latents ``[B, C, T, H, W]`` sampled from ``noise`` (same shape; ``T`` whole blocks) block by block; ``key``
    ``[2]`` or one per sample ``[B, 2]`` (needed by the SDE sampler and by ``context_noise > 0``, a timestep in
    ``[0, 1000)``); ``guidance = (uncond, g)``: ``uncond(cond)`` the unconditional cond, ``g`` the CFG scale.
    ``timesteps``: the model's timestep at each level of ``sigmas`` (``fvx.core.flow.sample``), and
    ``context_sigma`` the level of ``context_noise`` (default ``context_noise / 1000``), for schedules that call the
    model at a timestep and convert with a grid's level nearest it."""
    size, frames = causal.frames_per_block, noise.shape[2]
    if frames % size:
        raise ValueError(f"streaming: {frames} latent frames are not whole blocks of {size}")
    if not 0.0 <= context_noise < 1000.0:
        raise ValueError(f"streaming: context_noise must be a timestep in [0, 1000), got {context_noise}")
    if key is None and (sampler == "sde" or context_noise > 0):
        raise ValueError("streaming: the SDE sampler and context noise draw noise and need a key")
    guided = guidance is not None and guidance[1] != 1.0
    conds = (cond, guidance[0](cond)) if guided else (cond,)
    caches, blocks = [causal.empty_cache(frames) for _ in conds], []
    for b in range(frames // size):
        sampler_key = context_key = None
        if key is not None:
            sampler_key, context_key = _split(_fold_in(key, b))
        apply = _with_caches(causal, caches, conds, guidance[1] if guided else 1.0)
        x0 = flow.sample(apply, params, noise[:, :, b * size:(b + 1) * size], sigmas, sampler_key, cond=cond,
                         sampler=sampler, timesteps=timesteps)
        blocks.append(x0)
        if b + 1 == frames // size:
            break  # no block reads the last one's context
        context = x0
        if context_noise > 0:
            eps = _normal(context_key, x0.shape, x0.device).to(x0.dtype)
            level = context_noise / 1000.0 if context_sigma is None else context_sigma
            context = flow.add_noise(x0, eps, torch.tensor(level, device=x0.device))
        t = torch.full((x0.shape[0],), float(context_noise), device=x0.device)
        caches = [causal.apply_cached(params, context, t, c, cache)[1] for c, cache in zip(conds, caches)]
    return torch.cat(blocks, dim=2)


def draw(causal: Causal, sigmas: Sequence[float] | torch.Tensor, *, sampler: str = "ode",
         context_noise: float = 0.0, timesteps: Sequence[float] | torch.Tensor | None = None,
         context_sigma: float | None = None) -> Callable[..., torch.Tensor]:
    """``draw(params, noise, cond, key, guidance=None) -> latents`` for
    ``fvx.training.validation.Sampler(draw=...)``."""
    def run(params: Params, noise: torch.Tensor, cond: Cond, key: torch.Tensor,
            guidance: Guidance | None = None) -> torch.Tensor:
        return sample(causal, params, noise, sigmas, cond, key, sampler=sampler, context_noise=context_noise,
                      guidance=guidance, timesteps=timesteps, context_sigma=context_sigma)

    return run


def _with_caches(causal: Causal, caches: Sequence[Any], conds: Sequence[Cond], scale: float):
    """The velocity at the current block on the cached context: of ``conds[0]``, or guided by ``conds[1]``'s."""
    def apply(params: Params, x_t: torch.Tensor, t: torch.Tensor, cond: Cond) -> torch.Tensor:
        v = [causal.apply_cached(params, x_t, t, c, cache)[0] for c, cache in zip(conds, caches)]
        return v[0] if len(v) == 1 else flow.cfg(v[0], v[1], scale)

    return apply


def _fold_in(key: torch.Tensor, data: int) -> torch.Tensor:
    return random.fold_in(key, data) if key.ndim == 1 else torch.stack([random.fold_in(k, data) for k in key])


def _split(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if key.ndim == 1:
        a, b = random.split(key)
        return a, b
    pairs = torch.stack([random.split(k) for k in key])  # [B, 2, 2]
    return pairs[:, 0], pairs[:, 1]


def _normal(key: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if key.ndim == 1:
        return random.normal(key, shape, device=device)
    return torch.stack([random.normal(k, shape[1:], device=device) for k in key])
