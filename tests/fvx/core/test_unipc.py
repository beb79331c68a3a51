"""fvx.core.unipc against diffusers' UniPCMultistepScheduler in the flow configuration Wan, SkyReels-V2 and Cosmos 2.5
ship: levels, timesteps and whole sampling loops, bitwise on CPU in fp32 and fp64, on a toy model and on tiny Wan."""
import json

import pytest
import torch
from diffusers import UniPCMultistepScheduler

from fvx.core import flow, random, unipc

CHANNELS = 4
SHAPE = (2, CHANNELS, 2, 3, 3)  # [B, C, T, H, W]
# Wan 2.1's released scheduler/scheduler_config.json (Wan-AI/Wan2.1-T2V-1.3B-Diffusers), less diffusers' defaults
# that the flow configuration leaves alone (betas, thresholding, Karras/exponential/beta levels)
WAN_UNIPC = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, solver_order=2,
                 predict_x0=True, solver_type="bh2", lower_order_final=True, disable_corrector=[],
                 final_sigmas_type="zero", num_train_timesteps=1000, timestep_spacing="linspace")


def _toy_params(dtype=torch.float32):
    """A fixed random channel mixing ``[C, C]`` and a bias ``[1, C, T, H, W]``."""
    k = random.split(random.key(7), 2)
    return random.normal(k[0], (CHANNELS, CHANNELS)).to(dtype) / CHANNELS ** 0.5, random.normal(k[1], (1, *SHAPE[1:]))


def toy_apply(params, x, t, cond):
    """A velocity linear in ``x`` with a time-dependent gain and bias, so the trajectory is nontrivial."""
    mix, bias = params
    s = (t.to(x.dtype) / 1000).reshape(-1, 1, 1, 1, 1)
    return torch.einsum("oc,bcthw->bothw", mix.to(x.dtype), x) + torch.sin(3 * s) * bias.to(x.dtype) + s * x


def diffusers_loop(scheduler, apply_fn, params, noise, cond=None):
    """What WanPipeline does: ``set_timesteps(K)``, the model at each int timestep (as fp32), ``step``."""
    scheduler.set_begin_index(0)
    x = noise.clone()
    for t in scheduler.timesteps:
        v = apply_fn(params, x, t.to(torch.float32).expand(x.shape[0]), cond)
        x = scheduler.step(v, t, x, return_dict=False)[0]
    return x


def _scheduler(num_steps, shift, order=2):
    scheduler = UniPCMultistepScheduler(**{**WAN_UNIPC, "flow_shift": shift, "solver_order": order})
    scheduler.set_timesteps(num_steps)
    return scheduler


@pytest.mark.parametrize("shift", [1, 3, 5, 3.5])
@pytest.mark.parametrize("num_steps", [1, 2, 3, 10, 50])
def test_levels_and_timesteps_are_the_schedulers(num_steps, shift):
    scheduler = _scheduler(num_steps, shift)
    assert torch.equal(unipc.unipc_sigmas(num_steps, shift), scheduler.sigmas[:-1])
    assert torch.equal(unipc.unipc_timesteps(num_steps, shift), scheduler.timesteps.to(torch.float32))
    assert unipc.unipc_sigmas(num_steps, shift).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("order", [1, 2, 3])
def test_sample_equals_the_scheduler_loop_bitwise(order, dtype):
    params = _toy_params()
    for num_steps in (1, 2, 3, 10):
        for shift in (1, 3, 5):
            noise = random.normal(random.key(num_steps * 10 + shift), SHAPE).to(dtype)
            want = diffusers_loop(_scheduler(num_steps, shift, order), toy_apply, params, noise)
            got = unipc.unipc_sample(toy_apply, params, noise, unipc.unipc_sigmas(num_steps, shift), order=order,
                                     timesteps=unipc.unipc_timesteps(num_steps, shift))
            assert got.dtype == dtype
            assert torch.equal(got, want), (num_steps, shift, (got - want).abs().max().item())


def test_default_timesteps_are_1000_sigma():
    """Without ``timesteps`` the model sees ``1000 sigma`` (fvx's convention), within 1 of the pipeline's ints."""
    params, noise = _toy_params(), random.normal(random.key(1), SHAPE)
    sigmas, seen = unipc.unipc_sigmas(4, 3.0), []
    unipc.unipc_sample(lambda p, x, t, c: (seen.append(t), toy_apply(p, x, t, c))[1], params, noise, sigmas)
    assert torch.equal(torch.stack([t[0] for t in seen]), sigmas * 1000)
    assert all(t.shape == (SHAPE[0],) and t.dtype == torch.float32 for t in seen)
    assert (torch.stack([t[0] for t in seen]) - unipc.unipc_timesteps(4, 3.0)).abs().max() < 1


def test_pure_and_dtype_round_trip():
    params = _toy_params()
    noise = random.normal(random.key(2), SHAPE).to(torch.bfloat16)
    kept = noise.clone()
    out = unipc.unipc_sample(toy_apply, params, noise, unipc.unipc_sigmas(3, 3.0))
    assert out.dtype == torch.bfloat16 and torch.equal(noise, kept)
    again = unipc.unipc_sample(toy_apply, params, noise, unipc.unipc_sigmas(3, 3.0))
    assert torch.equal(out, again)


def test_bf16_velocity_agrees_with_the_scheduler_to_bf16_rounding():
    """A bf16 model: the scheduler rounds ``sigma v`` to bf16 before subtracting it from the fp32 latents; fvx upcasts
    ``v`` first, so the two differ by bf16 rounding of that product only."""
    params = _toy_params()

    def bf16_apply(p, x, t, c):
        return toy_apply(p, x, t, c).to(torch.bfloat16)

    noise = random.normal(random.key(3), SHAPE)
    want = diffusers_loop(_scheduler(10, 3.0), bf16_apply, params, noise)
    got = unipc.unipc_sample(bf16_apply, params, noise, unipc.unipc_sigmas(10, 3.0),
                             timesteps=unipc.unipc_timesteps(10, 3.0))
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)


GAUSS_MEAN = torch.linspace(-1, 1, CHANNELS, dtype=torch.float64).reshape(1, CHANNELS, 1, 1, 1)
GAUSS_STD = torch.tensor([0.3, 0.6, 1.0, 1.5], dtype=torch.float64).reshape(1, CHANNELS, 1, 1, 1)


def gauss_apply(params, x, t, cond):
    """The exact velocity for Gaussian data ``N(mean, std^2)`` per channel: ``(x - E[x0 | x_t]) / sigma``."""
    s = (t.to(x.dtype) / 1000).reshape(-1, 1, 1, 1, 1)
    a = 1 - s
    x0 = GAUSS_MEAN + a * GAUSS_STD ** 2 / (a ** 2 * GAUSS_STD ** 2 + s ** 2) * (x - a * GAUSS_MEAN)
    return (x - x0) / s


def gauss_trajectory(x, start, end):
    """The ODE's exact solution at level ``end`` from ``x`` at ``start``: the standardised latents are constant."""
    z = (x - (1 - start) * GAUSS_MEAN) / ((1 - start) ** 2 * GAUSS_STD ** 2 + start ** 2) ** 0.5
    return (1 - end) * GAUSS_MEAN + ((1 - end) ** 2 * GAUSS_STD ** 2 + end ** 2) ** 0.5 * z


def test_second_order_beats_euler_on_the_exact_gaussian_flow():
    """Every sampler's last step returns the x0 prediction at the last level, so the reference is that prediction on
    the exact trajectory; at 8 Wan levels (shift 3) UniPC-2 is 5x closer to it than Euler, and closer than UniPC-1."""
    noise = random.normal(random.key(4), SHAPE).to(torch.float64)
    sigmas = unipc.unipc_sigmas(8, 3.0)
    first, last = sigmas[0].double(), sigmas[-1].double()
    exact = gauss_trajectory(noise, first, last)
    exact = exact - last * gauss_apply(None, exact, (sigmas[-1:] * 1000).expand(SHAPE[0]), None)
    error = {name: (run() - exact).abs().max().item() for name, run in {
        "euler": lambda: flow.euler_sample(gauss_apply, None, noise, sigmas),
        "unipc1": lambda: unipc.unipc_sample(gauss_apply, None, noise, sigmas, order=1),
        "unipc2": lambda: unipc.unipc_sample(gauss_apply, None, noise, sigmas, order=2)}.items()}
    assert error["unipc2"] < 0.25 * error["euler"] and error["unipc2"] < error["unipc1"], error


def test_terminal_zero_may_be_given():
    params, noise = _toy_params(), random.normal(random.key(5), SHAPE)
    sigmas = unipc.unipc_sigmas(5, 5.0)
    with_zero = torch.cat([sigmas, torch.zeros(1)])
    assert torch.equal(unipc.unipc_sample(toy_apply, params, noise, sigmas),
                       unipc.unipc_sample(toy_apply, params, noise, with_zero))


@pytest.mark.parametrize("call, match", [
    (lambda: unipc.unipc_sigmas(0, 3.0), "positive int number of steps, got 0"),
    (lambda: unipc.unipc_sigmas(2.0, 3.0), "positive int number of steps, got 2.0"),
    (lambda: unipc.unipc_timesteps(-1, 3.0), "positive int number of steps, got -1"),
    (lambda: unipc.unipc_sigmas(4, 0.0), "shift must be a number > 0, got 0.0"),
    (lambda: unipc.unipc_sigmas(4, -2), "shift must be a number > 0, got -2"),
    (lambda: unipc.unipc_sample(toy_apply, _toy_params(), torch.zeros(SHAPE), [0.5], order=4), "order must be one"),
    (lambda: unipc.unipc_sample(toy_apply, _toy_params(), torch.zeros(SHAPE), [0.5], order=0), "order must be one"),
    (lambda: unipc.unipc_sample(toy_apply, _toy_params(), torch.zeros(SHAPE), [1.0, 0.5]), r"lie in \(0, 1\)"),
    (lambda: unipc.unipc_sample(toy_apply, _toy_params(), torch.zeros(SHAPE), [0.5, 0.7]), "strictly descending"),
    (lambda: unipc.unipc_sample(toy_apply, _toy_params(), torch.zeros(SHAPE), []), "non-empty 1-D"),
    (lambda: unipc.unipc_sample(toy_apply, _toy_params(), torch.zeros(SHAPE), [0.5, 0.2], timesteps=[500.0]),
     "one timestep per level"),
    (lambda: unipc.unipc_sample(toy_apply, _toy_params(), {"video": torch.zeros(SHAPE)}, [0.5]), "one latent tensor"),
])
def test_bad_input_raises_one_line(call, match):
    with pytest.raises(ValueError, match=match) as raised:
        call()
    assert "\n" not in str(raised.value)


def test_tiny_wan_against_its_exported_or_released_scheduler(tmp_path):
    """The tiny Wan's ``apply`` through the scheduler its export writes if that is UniPC, else through Wan's released
    UniPC config at the exported flow shift (fvx's Wan export writes a FlowMatchEulerDiscreteScheduler)."""
    from fvx_models.wan import WanConfig

    model = WanConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    model.export.folder(params, str(tmp_path / "out"))
    exported = json.loads((tmp_path / "out" / "scheduler" / "scheduler_config.json").read_text())
    if exported["_class_name"] == "UniPCMultistepScheduler":
        folder, shift = tmp_path / "out", exported["flow_shift"]
    else:
        folder, shift = tmp_path / "released", exported["shift"]
        UniPCMultistepScheduler(**{**WAN_UNIPC, "flow_shift": shift}).save_config(folder / "scheduler")
    scheduler = UniPCMultistepScheduler.from_pretrained(folder, subfolder="scheduler")
    assert (scheduler.config.use_flow_sigmas, scheduler.config.solver_order, scheduler.config.flow_shift) == \
        (True, 2, shift)
    scheduler.set_timesteps(4)
    k = random.split(random.key(1), 2)
    noise = random.normal(k[0], (1, 16, 2, 4, 4))
    cond = {"text": random.normal(k[1], (1, 5, 32)), "text_mask": torch.ones(1, 5)}
    want = diffusers_loop(scheduler, model.apply, params, noise, cond)
    got = unipc.unipc_sample(model.apply, params, noise, unipc.unipc_sigmas(4, shift), cond=cond,
                             timesteps=unipc.unipc_timesteps(4, shift))
    assert torch.equal(got, want), (got - want).abs().max().item()
    assert not torch.equal(got, noise)


@pytest.mark.parametrize("num_steps", [1, 2, 4, 9, 35])
def test_karras_levels_are_the_schedulers(num_steps):
    """``karras=(0.01, 200)``: the levels and timesteps of Cosmos 2.5's released UniPC (Karras flow sigmas)."""
    scheduler = UniPCMultistepScheduler(use_karras_sigmas=True, use_flow_sigmas=True, prediction_type="flow_prediction",
                                        sigma_min=0.01, sigma_max=200.0, flow_shift=1.0)
    scheduler.set_timesteps(num_steps)
    assert torch.equal(unipc.unipc_sigmas(num_steps, 1.0, (0.01, 200.0)), scheduler.sigmas[:-1])
    assert torch.equal(unipc.unipc_timesteps(num_steps, 1.0, (0.01, 200.0)), scheduler.timesteps.float())
    with pytest.raises(ValueError, match="sigma_min < sigma_max"):
        unipc.unipc_sigmas(num_steps, 1.0, (200.0, 0.01))
