"""fvx.core.flow against hand computation and diffusers' FlowMatchEulerDiscreteScheduler."""
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from fvx.core import flow, random

SHAPE = (2, 3, 2, 2, 2)  # [B, C, T, H, W]


def _normal(key, shape=SHAPE):
    return random.normal(key, shape)


# ------------------------------------------------------------------------------------------------- shift and grid


def test_shift_sigma_by_hand():
    assert flow.shift_sigma(0.5, 3.0) == pytest.approx(0.75)  # 1.5 / (1 + 2 * 0.5)
    assert flow.shift_sigma(0.25, 5.0) == pytest.approx(1.25 / 2.0)
    s = torch.tensor([0.0, 0.3, 1.0])
    assert torch.equal(flow.shift_sigma(s, 1.0), s)
    assert flow.shift_sigma(torch.tensor(1.0), 7.0).item() == 1.0


def test_shift_timestep_by_hand_and_identity():
    assert flow.shift_timestep(500.0, 3.0) == pytest.approx(750.0)
    t = torch.tensor([1000, 250, 0])
    out = flow.shift_timestep(t, 3.0)
    torch.testing.assert_close(out, torch.tensor([1000.0, 500.0, 0.0]))
    assert flow.shift_timestep(t, 1.0) is t  # identity keeps dtype (long) and object, like FastVideo


@pytest.mark.parametrize("shift", [0, -1.0, True, "3"])
def test_bad_shift(shift):
    with pytest.raises(ValueError, match="shift"):
        flow.shift_sigma(0.5, shift)


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_training_grid_equals_diffusers_at_construction(shift):
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    grid = flow.training_sigmas(shift)
    assert grid.shape == (1000,) and grid.dtype == torch.float32
    assert torch.equal(grid, sched.sigmas)  # no terminal 0 at construction
    assert torch.equal(flow.to_timestep(grid), sched.timesteps)
    assert grid[0].item() == 1.0 and grid[-1].item() > 0
    assert bool((grid[1:] < grid[:-1]).all())


def test_training_grid_by_hand():
    grid = flow.training_sigmas(3.0)
    u = 750 / 1000  # i = 250
    assert grid[250].item() == pytest.approx(3 * u / (1 + 2 * u))
    with pytest.raises(ValueError, match="num_train_timesteps"):
        flow.training_sigmas(3.0, num_train_timesteps=0)


@pytest.mark.parametrize("shift, n", [(5.0, 48), (3.0, 12), (1.0, 4), (5.0, 2)])
def test_self_forcing_grid_is_fastvideos_formula(shift, n):
    """SelfForcingFlowMatchScheduler(n, shift, sigma_min=0, sigma_max=1, extra_one_step=True): sigma_j =
    shift u_j / (1 + (shift - 1) u_j), u_j = 1 - j / n for j < n, timesteps 1000 sigma; in float64 here, and in its own
    fp32 ops (torch.linspace, then the shift) bit for bit."""
    u = 1.0 - np.arange(n, dtype=np.float64) / n
    reference = shift * u / (1.0 + (shift - 1.0) * u)
    grid = flow.self_forcing_sigmas(shift, n)
    assert grid.shape == (n,) and grid.dtype == torch.float32
    np.testing.assert_allclose(grid.numpy(), reference, rtol=2e-7, atol=0)
    np.testing.assert_allclose(flow.to_timestep(grid).numpy(), 1000 * reference, rtol=2e-7, atol=0)
    linear = torch.linspace(1.0, 0.0, n + 1)[:-1]
    assert torch.equal(grid, shift * linear / (1 + (shift - 1) * linear))
    assert grid[0].item() == 1.0 and grid[-1].item() > 0 and bool((grid[1:] < grid[:-1]).all())


def test_self_forcing_grid_refuses_a_bad_length():
    for n in (0, 2.0, True):
        with pytest.raises(ValueError, match="positive int number of levels"):
            flow.self_forcing_sigmas(5.0, n)


@pytest.mark.parametrize("shift, n", [(8.0, 25), (8.0, 40), (3.0, 4), (3.0, 20), (5.0, 1), (1.0, 10), (3.3, 7)])
def test_scheduler_levels_equal_diffusers_set_timesteps(shift, n):
    """FlowMatchEulerDiscreteScheduler(shift).set_timesteps(n): its sigmas but the terminal 0, and its timesteps
    1000 sigma, bit for bit."""
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(n)
    levels = flow.scheduler_sigmas(shift, n)
    assert levels.shape == (n,) and levels.dtype == torch.float32
    assert torch.equal(levels, sched.sigmas[:-1]) and sched.sigmas[-1].item() == 0.0
    assert torch.equal(flow.to_timestep(levels), sched.timesteps)


def test_scheduler_levels_shift_the_low_end_twice():
    """Shift 8, 25 steps by hand in float64: u_k = 1 + k / 24 (g - 1) with g = shift(1 / 1000) (the training grid's
    last level), levels shift(u_k); the last is shift(shift(0.001)) = 0.0602 (the once-shifted even levels end at
    0.25)."""
    def shift8(s):
        return 8.0 * s / (1.0 + 7.0 * s)

    grid_min = float(np.float32(shift8(0.001)))  # the scheduler's training grid is fp32
    levels = flow.scheduler_sigmas(8.0, 25)
    np.testing.assert_allclose(levels.numpy(), shift8(1.0 + np.arange(25) / 24 * (grid_min - 1.0)), rtol=2e-7, atol=0)
    assert levels[0].item() == 1.0 and levels[-1].item() == pytest.approx(shift8(grid_min), rel=1e-6)
    assert levels[-1].item() == pytest.approx(0.0602, abs=1e-4) and levels[-2].item() == pytest.approx(0.2931, abs=1e-4)
    assert flow.scheduler_sigmas(3.0, 4)[-1].item() == pytest.approx(0.00893, abs=1e-5)  # shift 3 twice of 0.001
    for n in (0, 2.0, True):
        with pytest.raises(ValueError, match="positive int number of steps"):
            flow.scheduler_sigmas(8.0, n)


# ------------------------------------------------------------------------------------------------- path and conversions


def test_add_noise_by_hand():
    x0, noise = torch.ones(SHAPE), torch.full(SHAPE, 2.0)
    out = flow.add_noise(x0, noise, torch.tensor([0.25, 0.5]))
    assert out.shape == SHAPE
    assert torch.allclose(out[0], torch.full(SHAPE[1:], 1.25)) and torch.allclose(out[1], torch.full(SHAPE[1:], 1.5))
    assert torch.allclose(flow.add_noise(x0, noise, 0.75), torch.full(SHAPE, 1.75))
    per_frame = torch.tensor([[0.0, 1.0], [0.5, 0.5]]).reshape(2, 1, 2, 1, 1)  # [B, 1, T, 1, 1]
    out = flow.add_noise(x0, noise, per_frame)
    assert torch.equal(out[0, :, 0], torch.ones(3, 2, 2)) and torch.equal(out[0, :, 1], torch.full((3, 2, 2), 2.0))


def test_add_noise_keeps_input_dtype():
    x0, noise = torch.ones(SHAPE, dtype=torch.bfloat16), torch.zeros(SHAPE, dtype=torch.bfloat16)
    assert flow.add_noise(x0, noise, torch.tensor([0.1, 0.2])).dtype == torch.bfloat16
    assert flow.add_noise(x0, noise.float(), 0.1).dtype == torch.float32


def test_add_noise_equals_diffusers_scale_noise_on_grid(key):
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    k1, k2 = random.split(key)
    x0, noise = _normal(k1), _normal(k2)
    idx = torch.tensor([10, 700])
    t = sched.timesteps[idx]
    ref = sched.scale_noise(x0, t, noise)
    assert torch.equal(flow.add_noise(x0, noise, flow.training_sigmas(3.0)[idx]), ref)  # same fp32 ops: bitwise


def test_sigma_batch_mismatch_is_an_error():
    with pytest.raises(ValueError, match="sigma"):
        flow.add_noise(torch.zeros(SHAPE), torch.zeros(SHAPE), torch.tensor([0.1, 0.2, 0.3]))


def test_conversions_round_trip(key):
    k1, k2 = random.split(key)
    x0, eps = _normal(k1), _normal(k2)
    sigma = torch.tensor([0.3, 0.9])
    x_t = flow.add_noise(x0, eps, sigma)
    v = flow.velocity_target(x0, eps)
    assert torch.equal(v, eps - x0)
    torch.testing.assert_close(flow.x0_from_velocity(x_t, v, sigma), x0)
    torch.testing.assert_close(flow.noise_from_velocity(x_t, v, sigma), eps)
    torch.testing.assert_close(flow.velocity_from_x0(x_t, x0, sigma), v, rtol=1e-5, atol=1e-5)


def test_x0_from_velocity_by_hand():
    x_t, v = torch.full(SHAPE, 3.0), torch.full(SHAPE, 2.0)
    out = flow.x0_from_velocity(x_t, v, torch.tensor([0.5, 0.25]))
    assert torch.equal(out[0], torch.full(SHAPE[1:], 2.0)) and torch.equal(out[1], torch.full(SHAPE[1:], 2.5))


def test_cfg_convention():
    cond, uncond = torch.tensor([3.0, -1.0]), torch.tensor([1.0, 1.0])
    assert torch.equal(flow.cfg(cond, uncond, 1.0), cond)
    assert torch.equal(flow.cfg(cond, uncond, 0.0), uncond)
    assert torch.equal(flow.cfg(cond, uncond, 5.0), torch.tensor([11.0, -9.0]))  # 1 + 5 * 2, 1 + 5 * (-2)
    w = 3.5  # FastVideo legacy / Self-Forcing / CausVid: cond + w (cond - uncond) is g = w + 1
    assert torch.allclose(cond + w * (cond - uncond), flow.cfg(cond, uncond, w + 1))


# ------------------------------------------------------------------------------------------------- densities


def test_unknown_density_lists_the_valid_ones(key):
    with pytest.raises(ValueError, match="'uniform', 'logit_normal', 'mode'"):
        flow.sample_u(key, "lognormal", batch=2)


@pytest.mark.parametrize("density", flow.DENSITIES)
def test_density_deterministic_per_key_and_in_range(key, density):
    a = flow.sample_u(key, density, batch=64)
    assert a.shape == (64,) and a.dtype == torch.float32
    assert torch.equal(a, flow.sample_u(key, density, batch=64))
    assert not torch.equal(a, flow.sample_u(random.fold_in(key, 1), density, batch=64))
    assert bool(((a >= 0) & (a <= 1)).all())


def test_uniform_moments(key):
    u = flow.sample_u(key, "uniform", batch=20000)
    assert bool((u < 1).all())
    assert u.mean().item() == pytest.approx(0.5, abs=0.01)
    assert u.var().item() == pytest.approx(1 / 12, abs=0.004)


def test_logit_normal_moments(key):
    u = flow.sample_u(key, "logit_normal", batch=20000, logit_mean=0.5, logit_std=0.8).double()
    logit = torch.log(u / (1 - u))
    assert logit.mean().item() == pytest.approx(0.5, abs=0.03)
    assert logit.std().item() == pytest.approx(0.8, abs=0.03)
    with pytest.raises(ValueError, match="logit_std"):
        flow.sample_u(key, "logit_normal", batch=2, logit_std=0.0)


def test_mode_transform_by_hand():
    u = torch.tensor([0.0, 0.25, 0.5, 1.0])
    out = flow.mode_transform(u, 1.29)
    c = math.cos(math.pi / 8) ** 2
    expected = [1.0, 0.75 - 1.29 * (c - 0.75), 0.5, 0.0]
    torch.testing.assert_close(out, torch.tensor(expected), rtol=0, atol=1e-6)
    assert torch.equal(flow.mode_transform(u, 0.0), 1 - u)


def test_mode_density_is_mode_transform_of_the_uniform_draw(key):
    u = flow.sample_u(key, "uniform", batch=32)
    assert torch.equal(flow.sample_u(key, "mode", batch=32, mode_scale=0.7), flow.mode_transform(u, 0.7))


def test_per_sample_keys_do_not_depend_on_the_batch_split(key):
    keys = torch.stack([random.fold_in(key, i) for i in range(4)])
    for density in flow.DENSITIES:
        whole = flow.sample_u(keys, density)
        assert whole.shape == (4,)
        assert torch.equal(whole[2:], flow.sample_u(keys[2:], density))


def test_key_and_batch_errors(key):
    with pytest.raises(ValueError, match="batch"):
        flow.sample_u(key, "uniform")
    with pytest.raises(ValueError, match="batch=3"):
        flow.sample_u(torch.stack([key, key]), "uniform", batch=3)
    with pytest.raises(ValueError, match="key"):
        flow.sample_u(torch.zeros(3, dtype=torch.int64), "uniform", batch=1)


def test_lookup_sigmas_indexes_floor_u_times_n():
    grid = flow.training_sigmas(3.0)
    sigma, t = flow.lookup_sigmas(grid, torch.tensor([0.0, 0.2505, 0.9999, 1.0]))
    assert torch.equal(sigma, grid[torch.tensor([0, 250, 999, 999])])  # u = 1 (mode at u = 0) clamps
    assert torch.equal(t, sigma * 1000) and t[0].item() == 1000.0


@pytest.mark.parametrize("density", flow.DENSITIES)
def test_sample_training_sigmas_is_grid_lookup_of_sample_u(key, density):
    grid = flow.training_sigmas(3.0)
    sigma, t = flow.sample_training_sigmas(key, grid, density, batch=16)
    u = flow.sample_u(key, density, batch=16)
    assert torch.equal(sigma, grid[(u * 1000).long()])
    assert torch.equal(t, flow.to_timestep(grid)[(u * 1000).long()])


# ------------------------------------------------------------------------------------------------- schedules


def test_denoising_sigmas_without_warp():
    out = flow.denoising_sigmas([1000, 750, 500, 250], shift=3.0)
    assert out.dtype == torch.float32 and torch.equal(out, torch.tensor([1.0, 0.75, 0.5, 0.25]))


@pytest.mark.parametrize("shift", [3.0, 5.0])
def test_warp_maps_through_the_shifted_grid(shift):
    steps = [1000, 937, 750, 500, 250, 1, 0]
    grid0 = torch.cat([flow.training_sigmas(shift), torch.zeros(1)])
    expected = grid0[1000 - torch.tensor(steps)]  # DMD2's warp_denoising_step
    assert torch.equal(flow.denoising_sigmas(steps, shift=shift, warp=True), expected)
    assert flow.denoising_sigmas([500], shift=3.0, warp=True).item() == pytest.approx(0.75)


@pytest.mark.parametrize("steps, error, match", [
    ([], ValueError, "non-empty"),
    ([750, 1000], ValueError, "descending"),
    ([1000, 500, 500], ValueError, "descending"),
    ([1001, 500], ValueError, r"\[0, 1000\]"),
    ([500, -1], ValueError, r"\[0, 1000\]"),
    ([1000, "500"], TypeError, "ints or floats"),
    ([True], TypeError, "ints or floats"),
])
def test_denoising_sigmas_errors(steps, error, match):
    with pytest.raises(error, match=match):
        flow.denoising_sigmas(steps, shift=3.0, warp=True)


# ------------------------------------------------------------------------------------------------- samplers


def _point_mass_velocity(target):
    """The exact velocity field when all data sits at ``target``: v = (x_t - target) / sigma."""
    def apply_fn(params, x_t, t, cond):
        return (x_t - target) / (t / 1000).reshape(-1, 1, 1, 1, 1)
    return apply_fn


def _smooth_velocity(params, x_t, t, cond):
    return params * torch.sin(x_t) + cond * (t / 1000).reshape(-1, 1, 1, 1, 1)


def test_euler_sampler_reaches_the_point_mass(key):
    k1, k2 = random.split(key)
    target, noise = _normal(k1), _normal(k2)
    out = flow.euler_sample(_point_mass_velocity(target), None, noise, flow.denoising_sigmas([1000, 750, 500, 250]))
    torch.testing.assert_close(out, target, rtol=0, atol=1e-5)
    half = flow.euler_sample(_point_mass_velocity(target), None, noise, [1.0, 0.5, 0.0])  # explicit terminal 0
    torch.testing.assert_close(half, target, rtol=0, atol=1e-5)


def test_euler_first_step_by_hand(key):
    seen = []

    def apply_fn(params, x_t, t, cond):
        seen.append(t)
        return torch.full_like(x_t, 2.0)

    noise = _normal(key)
    out = flow.euler_sample(apply_fn, None, noise, [0.8])  # one step: 0.8 -> 0
    torch.testing.assert_close(out, noise - 0.8 * 2.0)
    flow.euler_sample(apply_fn, None, noise, [1.0, 0.5, 0.25])
    assert [tuple(t.tolist()) for t in seen[1:]] == [(1000.0, 1000.0), (500.0, 500.0), (250.0, 250.0)]
    assert all(t.dtype == torch.float32 and t.shape == (2,) for t in seen)


def test_euler_equals_diffusers_step(key):
    sigmas = flow.denoising_sigmas([1000, 750, 500, 250], shift=3.0, warp=True)
    noise, params, cond = _normal(key), torch.tensor(0.7), torch.tensor(-0.3)
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)  # shift 1: no second shift
    sched.set_timesteps(sigmas=sigmas.tolist())
    assert torch.equal(sched.sigmas[:-1], sigmas) and sched.sigmas[-1].item() == 0.0
    x = noise
    for t in sched.timesteps:
        v = _smooth_velocity(params, x, t.expand(2), cond)
        x = sched.step(v, t, x, return_dict=False)[0]
    assert torch.equal(flow.euler_sample(_smooth_velocity, params, noise, sigmas, cond=cond), x)  # bitwise


def test_sde_sampler_reaches_the_point_mass(key):
    k1, k2, k3 = random.split(key, 3)
    target, noise = _normal(k1), _normal(k2)
    out = flow.sde_sample(_point_mass_velocity(target), None, noise, [1.0, 0.75, 0.5, 0.25], k3)
    torch.testing.assert_close(out, target, rtol=0, atol=1e-5)


def test_sde_by_hand(key):
    k1, k2 = random.split(key)
    noise, params, cond = _normal(k1), torch.tensor(0.7), torch.tensor(-0.3)
    sig = [1.0, 0.6]
    out = flow.sde_sample(_smooth_velocity, params, noise, sig, k2, cond=cond)
    t = lambda s: torch.full((2,), s * 1000)  # noqa: E731
    x0 = noise - 1.0 * _smooth_velocity(params, noise, t(1.0), cond)
    x = 0.4 * x0 + 0.6 * random.normal(random.fold_in(k2, 0), SHAPE)
    expected = x - 0.6 * _smooth_velocity(params, x, t(0.6), cond)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_sde_deterministic_per_key_and_per_sample_keys(key):
    noise = _normal(key)
    sig = [1.0, 0.75, 0.5, 0.25]

    def run(k):
        return flow.sde_sample(_smooth_velocity, torch.tensor(0.7), noise, sig, k, cond=torch.tensor(-0.3))

    a = run(random.fold_in(key, 1))
    assert torch.equal(a, run(random.fold_in(key, 1)))
    assert not torch.allclose(a, run(random.fold_in(key, 2)))
    keys = torch.stack([random.fold_in(key, 10), random.fold_in(key, 11)])
    both = run(keys)
    one = flow.sde_sample(_smooth_velocity, torch.tensor(0.7), noise[1:], sig, keys[1:], cond=torch.tensor(-0.3))
    assert torch.equal(both[1:], one)


def test_sample_dispatches(key):
    noise, sig = _normal(key), [1.0, 0.5]
    args = (_smooth_velocity, torch.tensor(0.7), noise, sig)
    assert torch.equal(flow.sample(*args, cond=torch.tensor(0.1)), flow.euler_sample(*args, cond=torch.tensor(0.1)))
    assert torch.equal(flow.sample(*args, key, cond=torch.tensor(0.1), sampler="sde"),
                       flow.sde_sample(*args, key, cond=torch.tensor(0.1)))
    with pytest.raises(ValueError, match="'ode', 'sde'"):
        flow.sample(*args, key, sampler="heun")
    with pytest.raises(ValueError, match="key"):
        flow.sample(*args, sampler="sde")


def test_sampler_keeps_noise_dtype(key):
    noise = _normal(key).bfloat16()
    out = flow.euler_sample(lambda p, x, t, c: x, None, noise, [1.0, 0.5])
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("sigmas, match", [
    ([], "non-empty"),
    ([1.2, 0.5], r"\[0, 1\]"),
    ([0.5, -0.1], r"\[0, 1\]"),
    ([0.5, 0.5], "descending"),
    ([0.2, 0.6], "descending"),
    ([[1.0, 0.5]], "1-D"),
])
def test_sampler_schedule_errors(key, sigmas, match):
    with pytest.raises(ValueError, match=match):
        flow.euler_sample(lambda p, x, t, c: x, None, _normal(key), sigmas)


@pytest.mark.parametrize("terminal", [0.1, 0.05])
def test_a_terminal_stretch_is_diffusers_shift_terminal(terminal):
    """``stretch_to_terminal``: the first level kept, the last ``terminal``, as FlowMatchEulerDiscreteScheduler's
    ``shift_terminal`` stretches them (LTX-Video's released schedulers)."""
    levels = flow.scheduler_sigmas(3.0, 6)
    stretched = flow.stretch_to_terminal(levels, terminal)
    want = FlowMatchEulerDiscreteScheduler(shift_terminal=terminal).stretch_shift_to_terminal(levels)
    torch.testing.assert_close(stretched, want, rtol=0, atol=1e-7)
    assert stretched[0].item() == 1.0 and stretched[-1].item() == pytest.approx(terminal, abs=1e-7)
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="terminal level must be in"):
            flow.stretch_to_terminal(levels, bad)
