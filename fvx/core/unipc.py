"""UniPC (Zhao et al. 2023) for flow-matching models as pure functions: diffusers' ``UniPCMultistepScheduler`` in the
flow configuration Wan 2.1/2.2, SkyReels-V2 and Cosmos 2.5 ship (``prediction_type="flow_prediction"``,
``use_flow_sigmas=True``, ``flow_shift=S``, ``solver_order=2``, ``predict_x0=True``, ``solver_type="bh2"``,
``lower_order_final=True``, ``disable_corrector=[]``, ``final_sigmas_type="zero"``).

On the flow path ``x_t = (1 - sigma) x0 + sigma eps`` the log-SNR is ``lambda(sigma) = log((1 - sigma) / sigma)``.
From level ``s0`` to level ``t`` (``h = lambda_t - lambda_s0``), with x0 predictions ``m0`` (at ``s0``) and ``m_k``
(at earlier levels ``s_k``, ``r_k = (lambda_sk - lambda_s0) / h``, ``D_k = (m_k - m0) / r_k``), one update is

    x_t = (sigma_t / sigma_s0) x_s0 - (1 - sigma_t) (e^{-h} - 1) m0 - (1 - sigma_t) B(h) sum_k rho_k D_k,

with ``B(h) = e^{-h} - 1`` (bh2). The predictor (UniP-p) sums over the ``p - 1`` earlier predictions, ``rho``
solving the leading ``p - 1`` rows and columns of ``R rho = b`` (``rho = 1/2`` at p = 2); the corrector (UniC-p), once
the model has been called at the predicted ``x_t``, redoes the update from ``x_s0`` with the new prediction as one more
term ``D = m_t - m0`` (``r = 1``), solving the whole system (``rho = 1/2`` at p = 1); the model's prediction at the
uncorrected ``x_t`` is what the history keeps. ``R[i, k] = r_k^i``, ``b_i = i! (-h) phi_{i+1}(-h) / B(h)`` with
``phi_1(z) = (e^z - 1) / z``, ``phi_{i+1}(z) = (phi_i(z) - 1 / i!) / z``. Step ``i`` of ``K`` predicts with order
``min(order, i + 1, K - i)`` (warm-up, and a first-order last step into 0, where ``h`` is infinite) and corrects with
the order its previous step predicted with.

The step coefficients are computed in fp32 on the host from the fp32 levels, one 0-dim op at a time as the scheduler
does, so they are bitwise its own. The latents are carried in at least fp32 and the velocity is upcast before
``x0 = x - sigma v`` (the scheduler, fed fp32 latents and a bf16 velocity, rounds ``sigma v`` to bf16 first).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from fvx.core import flow

ORDERS = (1, 2, 3)
NUM_TRAIN_TIMESTEPS = flow.NUM_TRAIN_TIMESTEPS
FIRST_LEVEL_NUDGE = 1e-6  # the scheduler lowers a first level of 1 by this, so its log-SNR stays finite

ApplyFn = Callable[[Any, torch.Tensor, torch.Tensor, Any], torch.Tensor]


# ---------------------------------------------------------------------------------------------------------------------
# The scheduler's levels and timesteps


def unipc_sigmas(num_steps: int, shift: float, karras: tuple[float, float] | None = None) -> torch.Tensor:
    """The ``K`` levels ``[K]`` fp32, descending, of ``UniPCMultistepScheduler(use_flow_sigmas=True,
    flow_shift=shift).set_timesteps(K)`` (its ``sigmas[:-1]``): ``shift_sigma(linspace(1, 1 / N, K + 1)[:-1])``
    in float64, the first lowered by 1e-6 when it is 1 (always), then rounded to fp32 once. ``karras=(sigma_min,
    sigma_max)``: the scheduler with ``use_karras_sigmas=True`` (Cosmos 2.5's), Karras' rho-7 spacing of the EDM
    sigmas ``s`` mapped to ``s / (s + 1)`` (no shift)."""
    return _levels64(num_steps, shift, karras).to(torch.float32)


def unipc_timesteps(num_steps: int, shift: float, karras: tuple[float, float] | None = None) -> torch.Tensor:
    """The model timesteps ``[K]`` fp32 the scheduler's pipelines pass: its int64 ``timesteps``, ``trunc(N sigma)``
    of the float64 levels (999 at the first level, not 1000 sigma = 999.999). Pass as ``unipc_sample(timesteps=)``."""
    return torch.trunc(_levels64(num_steps, shift, karras) * NUM_TRAIN_TIMESTEPS).to(torch.float32)


def _levels64(num_steps: int, shift: float, karras: tuple[float, float] | None = None) -> torch.Tensor:
    """:func:`unipc_sigmas` before the rounding to fp32 ``[K]`` float64 (numpy's ``linspace``: ``start + k step``)."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"UniPC needs a positive int number of steps, got {num_steps!r}")
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not shift > 0:
        raise ValueError(f"UniPC's flow shift must be a number > 0, got {shift!r}")
    if karras is not None:
        return _karras_levels64(num_steps, *karras)
    step = (1 / NUM_TRAIN_TIMESTEPS - 1) / num_steps
    even = torch.arange(num_steps, dtype=torch.float64) * step + 1.0
    levels = flow.shift_sigma(even, float(shift))
    if abs(levels[0].item() - 1) < FIRST_LEVEL_NUDGE:
        levels = torch.cat([levels[:1] - FIRST_LEVEL_NUDGE, levels[1:]])
    return levels


def _karras_levels64(num_steps: int, sigma_min: float, sigma_max: float) -> torch.Tensor:
    """Karras' levels ``(s_max^(1/7) + k / (K - 1) (s_min^(1/7) - s_max^(1/7)))^7`` as flow levels ``s / (s + 1)``
    ``[K]`` float64."""
    if not 0 < sigma_min < sigma_max:
        raise ValueError(f"Karras levels need 0 < sigma_min < sigma_max, got {sigma_min} and {sigma_max}")
    ramp = torch.linspace(0, 1, num_steps, dtype=torch.float64)
    low, high = sigma_min ** (1 / 7.0), sigma_max ** (1 / 7.0)
    sigmas = (high + ramp * (low - high)) ** 7.0
    return sigmas / (sigmas + 1)


# ---------------------------------------------------------------------------------------------------------------------
# The sampler


def unipc_sample(apply_fn: ApplyFn, params: Any, noise: torch.Tensor, sigmas: Sequence[float] | torch.Tensor, *,
                 cond: Any = None, order: int = 2,
                 timesteps: Sequence[float] | torch.Tensor | None = None) -> torch.Tensor:
    """Sample from ``noise`` ``[B, ...]`` (at ``sigmas[0]``) to 0 with UniPC-``order`` (module docstring): one model
    call per level, x0 predictions ``x - sigma v``, the predictor to the next level and the corrector after each call.

    ``apply_fn(params, x_t, t, cond) -> velocity`` with ``t`` a ``[B]`` fp32 tensor, ``1000 sigma`` or
    ``timesteps[i]`` (e.g. :func:`unipc_timesteps`, what diffusers' pipelines pass); ``cond`` passes through.
    ``sigmas`` ``[K]`` strictly descending in (0, 1) (e.g. :func:`unipc_sigmas`; a terminal 0 may be given). The
    result has ``noise``'s dtype; the state is carried in at least fp32.
    """
    if isinstance(noise, Mapping):
        raise ValueError("unipc_sample takes one latent tensor; a joint model's dict of modalities samples with Euler")
    if isinstance(order, bool) or order not in ORDERS:
        raise ValueError(f"UniPC order must be one of {ORDERS}, got {order!r}")
    levels = _checked_levels(sigmas)
    model_t = _model_timesteps(timesteps, sigmas, levels, noise.device)
    plan = _plan(levels, order)
    x = noise.to(torch.promote_types(noise.dtype, torch.float32))
    history: tuple[torch.Tensor, ...] = ()  # the x0 predictions so far, newest last, at most `order`
    before = x  # the latents the last predictor started from
    for i, (corrector, predictor) in enumerate(plan):
        v = apply_fn(params, x, model_t[i].expand(x.shape[0]), cond)
        x0 = x - levels[i].item() * v.to(x.dtype)
        if corrector is not None:
            x = _update(corrector, before, history[-1], history[-2::-1], new=x0)
        history = (*history, x0)[-order:]
        before = x
        x = _update(predictor, x, history[-1], history[-2::-1])
    return x.to(noise.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Step coefficients


class _Update(NamedTuple):
    """One UniP/UniC update's fp32 coefficients: ``x_t = ratio x_s0 - m0_weight m0 - residual_weight sum_k rho_k D_k``
    with ``D_k = (m_k - m0) / r_k`` over the earlier predictions, newest first (the corrector's last ``rho`` weighs
    ``m_t - m0``)."""
    ratio: float
    m0_weight: float
    residual_weight: float
    r: tuple[float, ...]
    rho: tuple[float, ...]


def _plan(levels: torch.Tensor, order: int) -> list[tuple[_Update | None, _Update]]:
    """(corrector or None, predictor) of each step for the fp32 levels ``[K + 1]`` (ending at 0)."""
    log_snr = [torch.log(1 - s) - torch.log(s) for s in levels]  # one 0-dim op at a time, as the scheduler
    num_steps = levels.shape[0] - 1
    orders = [min(order, i + 1, num_steps - i) for i in range(num_steps)]
    plan = []
    for i in range(num_steps):
        corrector = None
        if i > 0:
            earlier = tuple(range(i - 2, i - 1 - orders[i - 1], -1))
            corrector = _coefficients(levels, log_snr, i, i - 1, earlier, corrects=True)
        earlier = tuple(range(i - 1, i - orders[i], -1))
        plan.append((corrector, _coefficients(levels, log_snr, i + 1, i, earlier, corrects=False)))
    return plan


def _coefficients(levels: torch.Tensor, log_snr: list[torch.Tensor], target: int, source: int,
                  earlier: tuple[int, ...], *, corrects: bool) -> _Update:
    """The bh2 update from level ``source`` to ``target`` using predictions at the ``earlier`` levels (newest first);
    its order is ``len(earlier) + 1``."""
    h = log_snr[target] - log_snr[source]
    r = [(log_snr[k] - log_snr[source]) / h for k in earlier]
    order = len(earlier) + 1
    neg_h = -h
    h_phi_1 = torch.expm1(neg_h)  # -h phi_1(-h) = e^{-h} - 1
    b_h = torch.expm1(neg_h)  # bh2's B(h)
    b, h_phi, factorial = [], h_phi_1 / neg_h - 1, 1
    for i in range(1, order + 1):
        b.append(h_phi * factorial / b_h)
        factorial *= i + 1
        h_phi = h_phi / neg_h - 1 / factorial
    rks = torch.stack([*r, torch.ones(())])
    system = torch.stack([torch.pow(rks, i) for i in range(order)])
    b = torch.stack(b)
    if corrects:
        rho = [0.5] if order == 1 else torch.linalg.solve(system, b).tolist()
    else:
        rho = [] if order == 1 else [0.5] if order == 2 else torch.linalg.solve(system[:-1, :-1], b[:-1]).tolist()
    alpha_t = 1 - levels[target]
    return _Update(ratio=(levels[target] / levels[source]).item(), m0_weight=(alpha_t * h_phi_1).item(),
                  residual_weight=(alpha_t * b_h).item(), r=tuple(k.item() for k in r), rho=tuple(rho))


def _update(update: _Update, x: torch.Tensor, m0: torch.Tensor, earlier: Sequence[torch.Tensor],
            new: torch.Tensor | None = None) -> torch.Tensor:
    """Apply ``update`` to latents ``x`` with prediction ``m0``, ``earlier`` ones (newest first) and, correcting,
    the ``new`` one."""
    base = update.ratio * x - update.m0_weight * m0
    diffs = [(m - m0) / r for m, r in zip(earlier, update.r)]
    if new is not None:
        diffs.append(new - m0)
    if not diffs:
        return base
    residual = update.rho[0] * diffs[0]
    for rho, diff in zip(update.rho[1:], diffs[1:]):
        residual = residual + rho * diff
    return base - update.residual_weight * residual


# ---------------------------------------------------------------------------------------------------------------------
# Checks


def _checked_levels(sigmas: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """The levels as fp32 on the host ``[K + 1]``, a terminal 0 appended unless given."""
    levels = torch.as_tensor(sigmas, dtype=torch.float32).detach().cpu()
    if levels.ndim != 1 or levels.shape[0] == 0:
        raise ValueError(f"sigmas must be a non-empty 1-D schedule, got shape {tuple(levels.shape)}")
    if levels[-1] != 0:
        levels = torch.cat([levels, torch.zeros(1)])
    inner = levels[:-1]
    if not bool(((inner > 0) & (inner < 1)).all()) or levels.shape[0] < 2:
        raise ValueError(f"UniPC's levels must lie in (0, 1) before a terminal 0 (its log-SNR is infinite at 1; "
                         f"unipc_sigmas lowers a first 1 by 1e-6), got {levels.tolist()}")
    if not bool((levels[1:] < levels[:-1]).all()):
        raise ValueError(f"sigmas must be strictly descending, got {levels.tolist()}")
    return levels


def _model_timesteps(timesteps: Sequence[float] | torch.Tensor | None, sigmas: Sequence[float] | torch.Tensor,
                     levels: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The model's timestep at each level ``[K]`` fp32 on ``device``: ``timesteps`` (one per entry of ``sigmas``)
    or ``1000 sigma``."""
    if timesteps is None:
        return flow.to_timestep(levels[:-1]).to(device)
    model_t = torch.as_tensor(timesteps, dtype=torch.float32).detach().to(device)
    if model_t.ndim != 1 or model_t.shape[0] != len(sigmas):
        raise ValueError(f"timesteps must give one timestep per level of sigmas ({len(sigmas)}), got shape "
                         f"{tuple(model_t.shape)}")
    return model_t
