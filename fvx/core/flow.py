"""Flow matching as pure functions: the noising path, its targets, timestep densities, schedules and samplers.

Conventions (design §2): a noise level ``sigma`` in [0, 1] mixes data and noise as
``x_t = (1 - sigma) x0 + sigma eps``; the model predicts the velocity ``v = eps - x0``, so ``x0 = x_t - sigma v``;
its timestep is ``t = 1000 sigma``.
Latents are ``[B, C, T, H, W]``; a per-sample ``sigma`` is ``[B]`` (or any shape that broadcasts against the latents,
e.g. ``[B, 1, T, 1, 1]`` for per-frame levels). A joint model's latents, noise, levels and velocities are dicts keyed by
modality (``{"video": [B, C, T, H, W], "audio": [B, C, F, A]}``, each modality at its own ``sigma``): the noising path,
its targets and the ODE sampler apply modality by modality (a ``sigma`` that is not a dict applies to every one).

Dtypes: arithmetic runs in at least fp32 (fp64 stays fp64) and results come back in the data inputs' common dtype, so
bf16 in gives bf16 out. Unlike FastVideo, ``x0_from_velocity`` does not detour through fp64.
Checks that need tensor values (ranges, ordering) live where schedules are built or consumed (``denoising_sigmas``,
the samplers); the per-step math never reads tensor values on the host, so it compiles without graph breaks.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch

from fvx.core import random

NUM_TRAIN_TIMESTEPS = 1000
DENSITIES = ("uniform", "logit_normal", "mode")
SAMPLERS = ("ode", "sde")

Sigma = float | torch.Tensor
ApplyFn = Callable[[Any, torch.Tensor, torch.Tensor, Any], torch.Tensor]


# ---------------------------------------------------------------------------------------------------------------------
# Shift and the training grid


def shift_sigma(sigma: Sigma, shift: float) -> Sigma:
    """``shift * sigma / (1 + (shift - 1) * sigma)``: shift > 1 moves levels towards noise; shift 1 is identity."""
    _check_shift(shift)
    return shift * sigma / (1 + (shift - 1) * sigma)


def shift_timestep(t: Sigma, shift: float, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> Sigma:
    """``shift_sigma`` on the timestep scale: ``N * shift_sigma(t / N)``; returns ``t`` itself (any dtype) at shift 1.

    No clamping: FastVideo's callers clamp to [0, N] afterwards.
    """
    _check_shift(shift)
    if shift == 1:
        return t
    return num_train_timesteps * shift_sigma(t / num_train_timesteps, shift)


def to_timestep(sigma: Sigma, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> Sigma:
    """The model's timestep for a noise level: ``N * sigma`` (0..1000)."""
    return sigma * num_train_timesteps


def training_sigmas(shift: float, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The training grid ``[N]`` fp32, descending: ``shift_sigma((N - i) / N)`` for ``i = 0..N-1``, no terminal 0.

    Bitwise equal to ``FlowMatchEulerDiscreteScheduler(num_train_timesteps=N, shift=shift).sigmas`` at construction;
    the grid's timesteps are ``to_timestep(grid)``.
    """
    if not isinstance(num_train_timesteps, int) or isinstance(num_train_timesteps, bool) or num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be a positive int, got {num_train_timesteps!r}")
    u = torch.arange(num_train_timesteps, 0, -1, dtype=torch.float32, device=device) / num_train_timesteps
    return shift_sigma(u, shift)


def self_forcing_sigmas(shift: float, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``n``-level grid ``[n]`` fp32, descending: ``shift_sigma(linspace(1, 0, n + 1)[:-1])``, no terminal 0.

    FastVideo's ``SelfForcingFlowMatchScheduler(num_inference_steps=n, shift=shift, sigma_min=0, sigma_max=1,
    extra_one_step=True).sigmas`` (its steps of causal consistency distillation and of Self-Forcing); the grid's
    timesteps are ``to_timestep(grid)``, as that scheduler's ``timesteps``.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"the grid needs a positive int number of levels, got {n!r}")
    return shift_sigma(torch.linspace(1.0, 0.0, n + 1, dtype=torch.float32, device=device)[:-1], shift)


def scheduler_sigmas(shift: float, num_steps: int, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """The ``num_steps`` sampling levels ``[K]`` fp32, descending, of diffusers' (and FastVideo's)
    ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(K)``: its ``sigmas[:-1]`` (the samplers end at 0).

    The scheduler spaces ``K`` timesteps evenly from ``N sigma_max`` to ``N sigma_min``, the first and last levels of
    its *shifted* training grid (``training_sigmas(shift)``: 1 and ``shift_sigma(1 / N)``), divides by ``N`` and shifts
    again, so the low end is shifted twice: ``shift_sigma(linspace(1, shift_sigma(1 / N), K), shift)``. For shift 8
    and 25 steps the last level is 0.060 (the once-shifted even levels ``shift_sigma(1 - k / K)`` end at 0.250); for
    shift 3 it is 0.0089 at any ``K``. As diffusers does, the spacing and the shift run in float64 (numpy's
    ``linspace``: ``start + k step``, the endpoint set exactly) and the result is rounded to fp32 once, so it is
    bitwise equal for the scheduler's default config (no dynamic shifting, terminal stretch or Karras/exponential/beta
    levels); the scheduler's timesteps are ``to_timestep(levels)``.
    """
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
        raise ValueError(f"the scheduler needs a positive int number of steps, got {num_steps!r}")
    grid = training_sigmas(shift, num_train_timesteps)
    t_max, t_min = grid[0].item() * num_train_timesteps, grid[-1].item() * num_train_timesteps
    timesteps = torch.full((1,), t_max, dtype=torch.float64)
    if num_steps > 1:
        timesteps = torch.arange(num_steps, dtype=torch.float64) * ((t_min - t_max) / (num_steps - 1)) + t_max
        timesteps[-1] = t_min
    return shift_sigma(timesteps / num_train_timesteps, shift).to(device=device, dtype=torch.float32)


def stretch_to_terminal(sigmas: torch.Tensor, terminal: float) -> torch.Tensor:
    """Descending levels ``[K]`` rescaled in ``1 - sigma`` so the last is ``terminal``, the first kept (LTX-Video's
    schedule; diffusers' ``shift_terminal``): ``1 - (1 - sigma) (1 - terminal) / (1 - sigma_last)``."""
    if not 0.0 < terminal < 1.0:
        raise ValueError(f"the terminal level must be in (0, 1), got {terminal}")
    distance = 1 - sigmas
    if float(distance[-1]) <= 0:
        raise ValueError("stretching to a terminal level needs a last level below 1")
    return 1 - distance * ((1 - terminal) / distance[-1])


# ---------------------------------------------------------------------------------------------------------------------
# The noising path and its conversions


def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: Sigma) -> torch.Tensor:
    """``x_t = (1 - sigma) x0 + sigma noise``; ``sigma`` a scalar, ``[B]``, or broadcastable against ``x0``."""
    if isinstance(x0, Mapping):
        return _by_modality(add_noise, x0, noise, sigma)
    dtype, compute = _dtypes(x0, noise)
    s = _broadcast(sigma, x0, compute, "sigma")
    return ((1 - s) * x0.to(compute) + s * noise.to(compute)).to(dtype)


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The flow-matching regression target ``v = noise - x0`` (independent of sigma)."""
    if isinstance(x0, Mapping):
        return _by_modality(velocity_target, x0, noise)
    dtype, compute = _dtypes(x0, noise)
    return (noise.to(compute) - x0.to(compute)).to(dtype)


def x0_from_velocity(x_t: torch.Tensor, velocity: torch.Tensor, sigma: Sigma) -> torch.Tensor:
    """The clean sample a velocity implies: ``x0 = x_t - sigma v``."""
    if isinstance(x_t, Mapping):
        return _by_modality(x0_from_velocity, x_t, velocity, sigma)
    dtype, compute = _dtypes(x_t, velocity)
    s = _broadcast(sigma, x_t, compute, "sigma")
    return (x_t.to(compute) - s * velocity.to(compute)).to(dtype)


def noise_from_velocity(x_t: torch.Tensor, velocity: torch.Tensor, sigma: Sigma) -> torch.Tensor:
    """The noise a velocity implies: ``eps = x_t + (1 - sigma) v``."""
    dtype, compute = _dtypes(x_t, velocity)
    s = _broadcast(sigma, x_t, compute, "sigma")
    return (x_t.to(compute) + (1 - s) * velocity.to(compute)).to(dtype)


def velocity_from_x0(x_t: torch.Tensor, x0: torch.Tensor, sigma: Sigma) -> torch.Tensor:
    """The velocity that points from ``x0`` through ``x_t``: ``v = (x_t - x0) / sigma``; undefined at sigma 0."""
    dtype, compute = _dtypes(x_t, x0)
    s = _broadcast(sigma, x_t, compute, "sigma")
    return ((x_t.to(compute) - x0.to(compute)) / s).to(dtype)


def cfg(cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float | torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance ``uncond + g (cond - uncond)``: g = 1 gives ``cond``, g = 0 gives ``uncond``.

    FastVideo's legacy trainer, Self-Forcing and CausVid write ``cond + w (cond - uncond)``, which is ``g = w + 1``.
    Works on velocities and on x0 predictions alike (both are affine in the model output), and modality by modality
    on a joint model's dicts.
    """
    if isinstance(cond, Mapping):
        return {name: cfg(part, uncond[name], guidance_scale) for name, part in cond.items()}
    return uncond + guidance_scale * (cond - uncond)


# ---------------------------------------------------------------------------------------------------------------------
# Timestep densities (FastVideo/diffusers ``compute_density_for_timestep_sampling``)


def mode_transform(u: torch.Tensor, mode_scale: float = 1.29) -> torch.Tensor:
    """Map uniform ``u`` to the "mode" density: ``1 - u - mode_scale (cos^2(pi u / 2) - 1 + u)``.

    Decreasing (so it stays in [0, 1]) for ``mode_scale < 1 / (pi / 2 - 1) ~ 1.75``; note u = 0 maps to 1.
    """
    return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)


def sample_u(key: torch.Tensor, density: str, *, batch: int | None = None, logit_mean: float = 0.0,
             logit_std: float = 1.0, mode_scale: float = 1.29,
             device: torch.device | str | None = None) -> torch.Tensor:
    """``[B]`` fp32 draws in [0, 1] from a timestep density: ``uniform`` U[0, 1), ``logit_normal``
    sigmoid(N(logit_mean, logit_std)), or ``mode`` (``mode_transform`` of a uniform).

    ``key`` is one key ``[2]`` (then give ``batch``) or one key per sample ``[B, 2]`` (sample b's draw depends only
    on its own key, so a batch split across ranks draws what the whole batch would).
    """
    if density not in DENSITIES:
        raise ValueError(f"unknown density {density!r}; expected one of {', '.join(map(repr, DENSITIES))}")
    if density == "logit_normal":
        if not logit_std > 0:
            raise ValueError(f"logit_std must be > 0, got {logit_std!r}")
        z = _draw(random.normal, key, batch, (), device)
        return torch.sigmoid(z * logit_std + logit_mean)
    u = _draw(random.uniform, key, batch, (), device)
    return mode_transform(u, mode_scale) if density == "mode" else u


def lookup_sigmas(grid: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid entries at ``idx = floor(u * N)`` (clamped to ``N - 1``, where u = 1 would fall off): ``(sigma, t)``.

    ``grid`` is ``training_sigmas(...)`` ``[N]``; returns ``sigma`` ``[B]`` and its timestep ``t = N sigma`` ``[B]``.
    """
    n = grid.shape[0]
    idx = torch.floor(u * n).long().clamp(0, n - 1)
    sigma = grid[idx.to(grid.device)]
    return sigma, to_timestep(sigma, n)


def nearest_grid_sigma(grid: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The grid level whose timestep is nearest each ``t``: ``grid[argmin_i |N grid_i - t|]`` (first on ties).

    FastVideo's ``add_noise`` and ``predict_x0`` look a timestep up this way on the model's training grid
    (``training_sigmas(shift)`` ``[N]``); ``t`` is any shape (0..1000), the result has its shape.
    """
    timesteps = to_timestep(grid, grid.shape[0])
    flat = t.reshape(-1, 1).to(device=grid.device, dtype=torch.float32)
    return grid[(timesteps[None, :] - flat).abs().argmin(dim=1)].reshape(t.shape)


def per_sample_noise(key: torch.Tensor, sample_index: torch.Tensor, shape: tuple[int, ...] | Mapping[str, tuple],
                     device: torch.device) -> tuple[Any, torch.Tensor]:
    """Per-sample keys ``fold_in(key, index)`` split into (noise ``[B, *shape]``, timestep keys ``[B, 2]``): what a
    flow-matching loss draws for each sample of the global batch, whatever ranks or micro-batches it falls in. A dict
    of shapes (a joint model's modalities) draws modality ``i``'s noise from ``fold_in(noise key, i)``."""
    sample_keys = torch.vmap(random.split)(random.fold_in(key, sample_index))
    if isinstance(shape, Mapping):
        noise = {name: random.normal_each(torch.vmap(lambda k, i=i: random.fold_in(k, i))(sample_keys[:, 0]), part,
                                          device=device) for i, (name, part) in enumerate(shape.items())}
        return noise, sample_keys[:, 1]
    return random.normal_each(sample_keys[:, 0], shape, device=device), sample_keys[:, 1]


def sample_training_sigmas(key: torch.Tensor, grid: torch.Tensor, density: str, *, batch: int | None = None,
                           logit_mean: float = 0.0, logit_std: float = 1.0,
                           mode_scale: float = 1.29) -> tuple[torch.Tensor, torch.Tensor]:
    """Training noise levels on the grid: ``u ~ density`` then ``lookup_sigmas``; returns ``(sigma [B], t [B])``.

    ``key`` as in ``sample_u``: ``[2]`` with ``batch``, or ``[B, 2]`` one per sample.
    """
    u = sample_u(key, density, batch=batch, logit_mean=logit_mean, logit_std=logit_std, mode_scale=mode_scale,
                 device=grid.device)
    return lookup_sigmas(grid, u)


# ---------------------------------------------------------------------------------------------------------------------
# Few-step schedules and samplers


def denoising_sigmas(steps: Sequence[int | float], *, shift: float = 1.0, warp: bool = False,
                     num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """A few-step schedule ``[K]`` fp32 from timestep values (e.g. ``[1000, 750, 500, 250]``), strictly descending.

    Without ``warp`` a step s becomes ``s / N`` (``shift`` unused). With ``warp`` (DMD2's ``warp_denoising_step``) it
    goes through the shifted training grid: ``cat(training_sigmas(shift), [0])[N - s]``, i.e. ``shift_sigma(s / N)``
    (bitwise, for integer steps), so 0 stays 0. The samplers step from the last level to 0.
    """
    steps = list(steps)
    if not steps:
        raise ValueError("steps must be a non-empty list of timesteps, got []")
    for s in steps:
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise TypeError(f"steps must hold ints or floats, got {s!r} in {steps}")
        if not 0 <= s <= num_train_timesteps:
            raise ValueError(f"steps must lie in [0, {num_train_timesteps}], got {s!r} in {steps}")
    if any(a <= b for a, b in zip(steps, steps[1:])):
        raise ValueError(f"steps must be strictly descending, got {steps}")
    sigmas = torch.tensor(steps, dtype=torch.float32) / num_train_timesteps
    return shift_sigma(sigmas, shift) if warp else sigmas


def euler_sample(apply_fn: ApplyFn, params: Any, noise: torch.Tensor, sigmas: Sequence[float] | torch.Tensor, *,
                 cond: Any = None, timesteps: Sequence[float] | torch.Tensor | None = None) -> torch.Tensor:
    """Integrate the probability-flow ODE from ``noise`` (at ``sigmas[0]``) to 0: ``x <- x + (sigma_next - sigma) v``.

    ``apply_fn(params, x_t, t, cond) -> velocity`` with ``t = 1000 sigma`` a ``[B]`` fp32 tensor; ``cond`` is passed
    through untouched (wrap ``apply_fn`` with ``cfg`` for guidance). ``sigmas`` ``[K]`` in [0, 1], strictly descending;
    one model call per nonzero level; the last step lands on sigma 0. The state is carried in fp32; the result has
    ``noise``'s dtype. ``timesteps``: the model's timestep at each level instead of ``1000 sigma`` (as ``sde_sample``).
    """
    if isinstance(noise, Mapping):
        return _joint_euler_sample(apply_fn, params, noise, sigmas, cond)
    levels = _schedule(sigmas, noise.device)
    model_t = _model_timesteps(timesteps, sigmas, noise.device)
    x = noise.to(_compute_dtype(noise.dtype))
    for i in range(levels.shape[0] - 1):
        t = _timesteps(levels[i], x) if model_t is None else model_t[i].expand(x.shape[0])
        v = apply_fn(params, x, t, cond)
        x = x + (levels[i + 1] - levels[i]) * v.to(x.dtype)
    return x.to(noise.dtype)


def _joint_euler_sample(apply_fn: ApplyFn, params: Any, noise: Mapping[str, torch.Tensor],
                        sigmas: Mapping[str, Sequence[float] | torch.Tensor], cond: Any) -> dict[str, torch.Tensor]:
    """:func:`euler_sample` of a joint model: every modality steps along its own levels ``sigmas[name]`` (as many
    for each), all in one model call per step."""
    if not (isinstance(sigmas, Mapping) and set(sigmas) == set(noise)):
        raise ValueError(f"a joint sample needs one schedule per modality {sorted(noise)}, got "
                         f"{sorted(sigmas) if isinstance(sigmas, Mapping) else type(sigmas).__name__}")
    levels = {name: _schedule(sigmas[name], x.device) for name, x in noise.items()}
    if len({len(part) for part in levels.values()}) != 1:
        raise ValueError(f"a joint sample's schedules must have one length, got "
                         f"{ {name: len(part) for name, part in levels.items()} }")
    x = {name: part.to(_compute_dtype(part.dtype)) for name, part in noise.items()}
    for i in range(len(next(iter(levels.values()))) - 1):
        t = {name: _timesteps(levels[name][i], part) for name, part in x.items()}
        v = apply_fn(params, x, t, cond)
        x = {name: part + (levels[name][i + 1] - levels[name][i]) * v[name].to(part.dtype) for name, part in x.items()}
    return {name: part.to(noise[name].dtype) for name, part in x.items()}


def sde_sample(apply_fn: ApplyFn, params: Any, noise: torch.Tensor, sigmas: Sequence[float] | torch.Tensor,
               key: torch.Tensor, *, cond: Any = None,
               timesteps: Sequence[float] | torch.Tensor | None = None) -> torch.Tensor:
    """Few-step sampling by re-noising: at each level predict ``x0 = x - sigma v``, then draw fresh noise
    ``eps_i`` and move to the next level, ``x <- (1 - sigma_next) x0 + sigma_next eps_i``; returns the last ``x0``.

    ``eps_i`` is ``normal(fold_in(key, i))``; ``key`` is ``[2]`` for the batch or ``[B, 2]`` one per sample.
    ``apply_fn``, ``cond``, ``sigmas`` and dtypes as in ``euler_sample``. ``timesteps`` (one per entry of
    ``sigmas``): the model's timestep at each level instead of ``1000 sigma``, for schedules that call the model at a
    timestep and convert with the grid level nearest it (FastVideo's few-step DMD sampler; ``nearest_grid_sigma``).
    """
    levels = _schedule(sigmas, noise.device)
    x = noise.to(_compute_dtype(noise.dtype))
    n = levels.shape[0] - 1
    model_t = _model_timesteps(timesteps, sigmas, noise.device)
    for i in range(n):
        t = _timesteps(levels[i], x) if model_t is None else model_t[i].expand(x.shape[0])
        v = apply_fn(params, x, t, cond)
        x0 = x - levels[i] * v.to(x.dtype)
        if i == n - 1:
            x = x0
        else:
            eps = _draw(random.normal, _fold_in(key, i), x.shape[0], x.shape[1:], x.device).to(x.dtype)
            x = (1 - levels[i + 1]) * x0 + levels[i + 1] * eps
    return x.to(noise.dtype)


def sample(apply_fn: ApplyFn, params: Any, noise: torch.Tensor, sigmas: Sequence[float] | torch.Tensor,
           key: torch.Tensor | None = None, *, cond: Any = None, sampler: str = "ode",
           timesteps: Sequence[float] | torch.Tensor | None = None) -> torch.Tensor:
    """``euler_sample`` (``sampler="ode"``) or ``sde_sample`` (``"sde"``, needs ``key``)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; expected one of {', '.join(map(repr, SAMPLERS))}")
    if sampler == "ode":
        return euler_sample(apply_fn, params, noise, sigmas, cond=cond, timesteps=timesteps)
    if isinstance(noise, Mapping):
        raise ValueError("a joint model (latents of several modalities) samples with sampler='ode' only")
    if key is None:
        raise ValueError("sampler='sde' draws fresh noise at every step and needs a key")
    return sde_sample(apply_fn, params, noise, sigmas, key, cond=cond, timesteps=timesteps)


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def _by_modality(fn: Callable[..., Any], x: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor],
                 *sigma: Any) -> dict[str, torch.Tensor]:
    """``fn`` modality by modality of a joint model's dicts (``sigma``: a dict keyed alike, or one for all)."""
    if not (isinstance(other, Mapping) and set(other) == set(x)):
        raise ValueError(f"joint latents keyed {sorted(x)} need their partner keyed alike, got "
                         f"{sorted(other) if isinstance(other, Mapping) else type(other).__name__}")
    level = (lambda name: ()) if not sigma else (  # noqa: E731
        lambda name: (sigma[0][name] if isinstance(sigma[0], Mapping) else sigma[0],))
    return {name: fn(part, other[name], *level(name)) for name, part in x.items()}


def _check_shift(shift: float) -> None:
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not shift > 0:
        raise ValueError(f"shift must be a number > 0, got {shift!r}")


def _dtypes(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(result dtype: the inputs' common dtype, compute dtype: that promoted to at least fp32)."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    return dtype, _compute_dtype(dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` promoted to at least fp32."""
    return torch.promote_types(dtype, torch.float32)


def _broadcast(sigma: Sigma, x: torch.Tensor, dtype: torch.dtype, name: str) -> Sigma:
    """A ``[B]`` sigma reshaped to ``[B, 1, ..., 1]`` for ``x``; scalars and other shapes as given (in ``dtype``)."""
    if not isinstance(sigma, torch.Tensor):
        return sigma
    if sigma.ndim == 1 and x.ndim > 1:
        if sigma.shape[0] != x.shape[0]:
            raise ValueError(f"{name} has shape {tuple(sigma.shape)} but the batch has {x.shape[0]} samples "
                             f"(x is {tuple(x.shape)})")
        sigma = sigma.reshape(-1, *([1] * (x.ndim - 1)))
    return sigma.to(device=x.device, dtype=dtype)


def _check_key(key: torch.Tensor) -> None:
    if not isinstance(key, torch.Tensor) or key.ndim not in (1, 2) or key.shape[-1] != 2:
        shape = tuple(key.shape) if isinstance(key, torch.Tensor) else type(key).__name__
        raise ValueError(f"key must be an fvx key [2] or a batch of keys [B, 2], got {shape}")


def _draw(draw: Callable[..., torch.Tensor], key: torch.Tensor, batch: int | None, shape: Sequence[int],
          device: torch.device | str | None) -> torch.Tensor:
    """``[B, *shape]`` fp32 draws from one key ``[2]`` (needs ``batch``) or one ``shape`` draw per key of ``[B, 2]``."""
    _check_key(key)
    shape = tuple(shape)
    if key.ndim == 1:
        if batch is None:
            raise ValueError("batch is required with a single key [2]; or pass one key per sample [B, 2]")
        return draw(key, (batch, *shape), dtype=torch.float32, device=device)
    if batch is not None and batch != key.shape[0]:
        raise ValueError(f"batch={batch} disagrees with the {key.shape[0]} per-sample keys")
    return torch.stack([draw(k, shape, dtype=torch.float32, device=device) for k in key])


def _fold_in(key: torch.Tensor, data: int) -> torch.Tensor:
    """``fold_in`` for one key ``[2]`` or for each key of ``[B, 2]``."""
    _check_key(key)
    if key.ndim == 1:
        return random.fold_in(key, data)
    return torch.stack([random.fold_in(k, data) for k in key])


def _schedule(sigmas: Sequence[float] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Validate a sampling schedule and append the terminal 0 unless it ends there already: fp32 on ``device``."""
    levels = torch.as_tensor(sigmas, dtype=torch.float32).detach()
    if levels.ndim != 1 or levels.shape[0] == 0:
        raise ValueError(f"sigmas must be a non-empty 1-D schedule, got shape {tuple(levels.shape)}")
    host = levels.cpu()
    if not bool(((host >= 0) & (host <= 1)).all()):
        raise ValueError(f"sigmas must lie in [0, 1], got {host.tolist()}")
    if levels.shape[0] > 1 and not bool((host[1:] < host[:-1]).all()):
        raise ValueError(f"sigmas must be strictly descending, got {host.tolist()}")
    levels = levels.to(device)
    if host[-1] == 0:
        return levels
    return torch.cat([levels, torch.zeros(1, dtype=torch.float32, device=device)])


def _model_timesteps(timesteps: Sequence[float] | torch.Tensor | None, sigmas: Sequence[float] | torch.Tensor,
                     device: torch.device) -> torch.Tensor | None:
    """``timesteps`` as fp32 ``[K]`` on ``device``, one per level of ``sigmas`` (None stays None)."""
    if timesteps is None:
        return None
    model_t = torch.as_tensor(timesteps, dtype=torch.float32).detach().to(device)
    if model_t.ndim != 1 or model_t.shape[0] != len(sigmas):
        raise ValueError(f"timesteps must give one timestep per level of sigmas ({len(sigmas)}), got shape "
                         f"{tuple(model_t.shape)}")
    return model_t


def _timesteps(sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The model timestep ``[B]`` fp32 for a 0-dim level and a batch ``x``."""
    return to_timestep(sigma).expand(x.shape[0])
