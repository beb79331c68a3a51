"""A DDPM-schedule model run as a flow: the point ``x = a x0 + b noise`` of a variance-preserving schedule, divided by
``s = a + b``, is the flow's ``x_t = (1 - sigma) x0 + sigma noise`` at ``sigma = b / (a + b)``.

A family trained on a DDPM schedule (its cumulative product ``abar [N]`` over integer timesteps ``tau``,
``a = sqrt(abar_tau)``, ``b = sqrt(1 - abar_tau)``) gives its DiT ``s x_t`` at the (fractional) ``tau`` of ``sigma``
and reads its prediction back as the flow velocity ``noise - x0``:

- v-prediction (``v = a noise - b x0``, CogVideoX): ``s ((b - a) x_t + v)``;
- epsilon prediction (Latte, Allegro): ``s (eps - x_t) / a``.

Its own training is a weight on the velocity loss: an x0 loss weighted ``1 / (1 - abar)`` is ``1 / s^2`` of it, an
epsilon loss ``(a / s)^2 = (1 - sigma)^2``. An Euler step of the flow between two of its scheduler's levels is the
scheduler's DDIM step (eta 0). Every method then trains and samples it as a flow family.
"""
from __future__ import annotations

import torch

from fvx.core import random


def coefficients(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)`` fp32 of the VP point on the flow level ``sigma``: ``(1 - sigma, sigma) / sqrt((1 - sigma)^2 +
    sigma^2)`` (so ``a^2 + b^2 = 1``, ``b / (a + b) = sigma``)."""
    sigma = sigma.float()
    norm = torch.sqrt((1 - sigma) ** 2 + sigma ** 2)
    return (1 - sigma) / norm, sigma / norm


def level_of(abar: torch.Tensor) -> torch.Tensor:
    """The flow level ``sigma = b / (a + b)`` fp32 of ``abar`` (``a = sqrt(abar)``, ``b = sqrt(1 - abar)``)."""
    a, b = abar.sqrt(), (1 - abar).sqrt()
    return (b / (a + b)).float()


def timestep_of(abar: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The (fractional) timestep ``tau [B]`` fp32 whose ``abar`` is the level ``sigma``'s ``a^2``: linear in ``abar``
    between the table's integer timesteps (so an integer one comes back as itself), clamped to the table's range."""
    table = abar.flip(0).to(sigma.device, torch.float32)  # increasing: abar_{N-1} .. abar_0
    target = (coefficients(sigma)[0] ** 2).clamp(table[0], table[-1])
    upper = torch.searchsorted(table, target).clamp(1, table.shape[0] - 1)
    low, high = table[upper - 1], table[upper]
    flipped = (upper - 1).float() + (target - low) / (high - low)
    return (table.shape[0] - 1) - flipped


def integer_levels(abar: torch.Tensor, keys: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Training levels of uniform integer timesteps ``tau = floor(N u)``, ``u ~ U[0, 1)`` from per-sample keys
    ``[B, 2]`` (a DDPM trainer's ``torch.randint(0, N)``), as ``(sigma [B], t = 1000 sigma [B])``."""
    u = torch.vmap(lambda key: random.uniform(key, ()))(keys.to(device))
    count = abar.shape[0]
    tau = torch.floor(u * count).long().clamp(max=count - 1)
    sigma = level_of(abar.to(device)[tau])
    return sigma, 1000 * sigma


def scheduler_levels(abar: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """A DDPM scheduler's sampling timesteps ``[K]`` (its ``set_timesteps``) as flow levels ``[K]`` (the samplers end
    at 0: its ``final_alpha_cumprod`` 1)."""
    return level_of(abar.to(torch.float64)[timesteps.long()])


def model_input(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``s x_t``: the VP point the DiT denoises, for ``x [B, ...]`` at levels ``sigma [B]``."""
    a, b = coefficients(sigma)
    return x * (a + b).view(-1, *[1] * (x.dim() - 1)).to(x.dtype)


def velocity_of_v(v: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A v-prediction ``v`` as the velocity ``noise - x0 = s ((b - a) x_t + v)``, in ``v``'s dtype."""
    a, b = (c.view(-1, *[1] * (x.dim() - 1)) for c in coefficients(sigma))
    return ((a + b) * ((b - a) * x.float() + v.float())).to(v.dtype)


def velocity_of_epsilon(eps: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, abar: torch.Tensor) -> torch.Tensor:
    """An epsilon prediction as the velocity ``noise - x0 = s (eps - x_t) / a``, in ``eps``'s dtype. Above the
    schedule's top level (its last timestep's, ``a = sqrt(abar[-1])``) ``a`` is read there: the DiT never saw a point
    nearer noise, and ``a`` goes to 0 at ``sigma = 1``."""
    a, b = (c.view(-1, *[1] * (x.dim() - 1)) for c in coefficients(sigma))
    return ((a + b) * (eps.float() - x.float()) / a.clamp(min=float(abar[-1]) ** 0.5)).to(eps.dtype)


def x0_loss_weight(sigma: torch.Tensor) -> torch.Tensor:
    """``1 / s^2``: an x0 loss weighted ``1 / (1 - abar)`` (CogVideoX's) as a weight on the velocity loss."""
    a, b = coefficients(sigma)
    return 1 / (a + b) ** 2


def epsilon_loss_weight(sigma: torch.Tensor) -> torch.Tensor:
    """``(a / s)^2 = (1 - sigma)^2``: the plain epsilon loss (``eps_pred - eps = (a / s) (v_pred - v)``) as a weight on
    the velocity loss."""
    return (1 - sigma.float()) ** 2
