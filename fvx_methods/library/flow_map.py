"""What flow-map methods share (AnyFlow, MeanFlow): a two-time student ``u(x_t, t, r)``, the average velocity from
``t`` to ``r``, so that ``x_r = x_t - ((t - r) / 1000) u`` (``sigma = t / 1000``); its time pairs, its few-step
sampler and its validation.

A pair ``(t, r)`` with ``t >= r`` is one of three kinds: ``GENERAL`` (two draws, sorted), ``DIAGONAL`` (``r = t``: the
flow-matching velocity, AnyFlow's "diffusion" samples) and ``ENDPOINT`` (``r = 0``: one jump to the data, AnyFlow's
"consistency" samples). Each sample's kind and times come from its own key, so a batch draws the same whatever ranks
or micro-batches it is split over.
"""
from __future__ import annotations

from typing import Any, Literal, Sequence

import torch

from fvx.core import flow, random
from fvx.training import validation
from fvx_models.model import Model, Params

GENERAL, DIAGONAL, ENDPOINT = 0, 1, 2


def check_two_time(model: Model, role_name: str, method: str) -> None:
    """A one-line ValueError when the role's model has no second time input: what adds one to its config, or (its
    family takes none: ``Model.rules.two_time_refusal``) which families take one."""
    if not model.rules.two_time:
        fix = model.rules.two_time_refusal or f"set models.{role_name}.r_embedder={{}} (fvx_models.wan_two_time)"
        raise ValueError(f"{method} trains a flow map u(x_t, t, r), but models.{role_name} ({model.name}) has no r "
                         f"input; {fix}")


def check_fractions(diagonal: float, endpoint: float, names: tuple[str, str]) -> None:
    """A one-line ValueError unless both fractions are in [0, 1] and sum to at most 1."""
    for value, name in zip((diagonal, endpoint), names):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"method.{name} must be in [0, 1], got {value}")
    if diagonal + endpoint > 1.0:
        raise ValueError(f"method.{names[0]} + method.{names[1]} = {diagonal + endpoint} is above 1")


def time_pairs(keys: torch.Tensor, *, diagonal: float, endpoint: float, shift: float = 1.0,
               density: Literal["uniform", "logit_normal"] = "uniform", logit_mean: float = 0.0,
               logit_std: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``(sigma_t [B], sigma_r [B], kind [B])`` from keys ``[B, 2]``: two draws of ``density`` (``uniform``
    U[0, 1), ``logit_normal`` sigmoid(N(logit_mean, logit_std))), ``t`` the larger; a third, uniform, picks the kind
    (``DIAGONAL`` below ``diagonal``, then ``ENDPOINT`` below ``diagonal + endpoint``); both times shifted by ``shift``
    (``flow.shift_sigma``)."""
    parts = torch.vmap(random.split)(keys)
    if density == "logit_normal":
        draws = torch.sigmoid(torch.vmap(lambda k: random.normal(k, (2,)))(parts[:, 0]) * logit_std + logit_mean)
    elif density == "uniform":
        draws = torch.vmap(lambda k: random.uniform(k, (2,)))(parts[:, 0])
    else:
        raise ValueError(f"unknown time density {density!r}; expected uniform or logit_normal")
    draws = draws.to(keys.device).unbind(1)
    t, r = torch.maximum(*draws), torch.minimum(*draws)
    pick = torch.vmap(lambda k: random.uniform(k, ()))(parts[:, 1])
    kind = torch.where(pick < diagonal, DIAGONAL, torch.where(pick < diagonal + endpoint, ENDPOINT, GENERAL))
    r = torch.where(kind == DIAGONAL, t, torch.where(kind == ENDPOINT, torch.zeros_like(r), r))
    return flow.shift_sigma(t, shift), flow.shift_sigma(r, shift), kind


def per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B]`` values shaped ``[B, 1, ..., 1]`` to broadcast against ``like``."""
    return values.view(-1, *([1] * (like.dim() - 1)))


def sample(model: Model, params: Params, noise: torch.Tensor, sigmas: Sequence[float] | torch.Tensor,
           cond: Any, *, mean_velocity: bool = True) -> torch.Tensor:
    """Latents from ``noise`` in ``len(sigmas) - 1`` flow-map jumps ``x <- x - (sigma - sigma') u(x, t, r)``, ``r``
    the next level (``mean_velocity=False``: ``r = t``, Euler steps of the instantaneous velocity)."""
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32, device=noise.device)
    x = noise.float()
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        t = torch.full((x.shape[0],), float(sigma) * flow.NUM_TRAIN_TIMESTEPS, device=x.device)
        r = torch.full_like(t, float(sigma_next) * flow.NUM_TRAIN_TIMESTEPS)
        x = x - (sigma - sigma_next) * model.apply(params, x, t, cond, r=r if mean_velocity else t)
    return x


def few_step_sigmas(steps: int, shift: float = 1.0) -> torch.Tensor:
    """``steps + 1`` levels from 1 to 0, uniform in sigma before ``shift``."""
    return flow.shift_sigma(torch.linspace(1.0, 0.0, steps + 1), shift)


def samplers(model: Model, steps: Sequence[int], shift: float):
    """Validation of a flow-map student: one sampler per entry of ``steps`` (tagged ``student_<n>step``, ``_ema``
    when its EMA), unguided (guidance is learned or absent)."""
    def make(params: Params, is_ema: bool, config: validation.ValidationConfig) -> list[validation.Sampler]:
        out = []
        for n in steps:
            sigmas = few_step_sigmas(n, shift)
            draw = (lambda sigmas: lambda p, noise, cond, key, guidance=None: sample(model, p, noise, sigmas, cond))
            out.append(validation.Sampler(f"student_{n}step" + ("_ema" if is_ema else ""), model.apply, params,
                                          sigmas, draw=draw(sigmas)))
        return out
    return make


def sampling(steps: Sequence[int], shift: float) -> dict:
    """How a flow-map student is sampled (recorded on export)."""
    return {"sampler": "flow map: x_r = x_t - ((t - r) / 1000) u(x_t, t, r), r the next level",
            "steps": {str(n): flow.to_timestep(few_step_sigmas(n, shift)).tolist() for n in steps}}
