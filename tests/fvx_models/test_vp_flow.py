"""fvx_models.vp_flow against hand computation: a VP point divided by ``s = a + b`` is the flow's ``x_t``, and v- and
epsilon predictions read back as the velocity ``noise - x0``, their losses as weighted velocity losses."""
import torch
from diffusers import DDPMScheduler

from fvx.core import random
from fvx_models import vp_flow

ABAR = DDPMScheduler().alphas_cumprod.double()  # linear betas: abar_999 = 4e-5


def draws():
    x0, noise = random.normal(random.key(0), (3, 4, 2, 2, 2)), random.normal(random.key(1), (3, 4, 2, 2, 2))
    return x0, noise, torch.tensor([0.05, 0.5, 0.97])


def test_the_vp_point_over_s_is_the_flows_point_and_v_and_epsilon_read_back_as_the_velocity():
    x0, noise, sigma = draws()
    a, b = (c.view(-1, 1, 1, 1, 1) for c in vp_flow.coefficients(sigma))
    x_t = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * noise
    torch.testing.assert_close(a ** 2 + b ** 2, torch.ones_like(a))
    torch.testing.assert_close(vp_flow.model_input(x_t, sigma), a * x0 + b * noise)
    torch.testing.assert_close(vp_flow.velocity_of_v(a * noise - b * x0, x_t, sigma), noise - x0, rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(vp_flow.velocity_of_epsilon(noise, x_t, sigma, ABAR), noise - x0, rtol=1e-4,
                               atol=1e-4)


def test_the_epsilon_and_x0_losses_are_weighted_velocity_losses():
    x0, noise, sigma = draws()
    a, b = (c.view(-1, 1, 1, 1, 1) for c in vp_flow.coefficients(sigma))
    x_t = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * noise
    eps_pred = noise + 0.1 * random.normal(random.key(2), noise.shape)
    v_error = ((vp_flow.velocity_of_epsilon(eps_pred, x_t, sigma, ABAR) - (noise - x0)) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(vp_flow.epsilon_loss_weight(sigma) * v_error,
                               ((eps_pred - noise) ** 2).flatten(1).mean(1), rtol=1e-4, atol=1e-6)
    x0_pred = x0 + 0.1 * random.normal(random.key(3), x0.shape)  # its velocity: x_t = x0_pred + sigma v
    v_pred = (x_t - x0_pred) / sigma.view(-1, 1, 1, 1, 1)
    abar = a.flatten() ** 2
    torch.testing.assert_close(vp_flow.x0_loss_weight(sigma) * ((v_pred - (noise - x0)) ** 2).flatten(1).mean(1),
                               (1 / (1 - abar)) * ((x0_pred - x0) ** 2).flatten(1).mean(1), rtol=1e-4, atol=1e-6)


def test_integer_timesteps_come_back_as_themselves_and_the_top_stays_finite():
    taus = torch.tensor([0, 1, 500, 998, 999])
    torch.testing.assert_close(vp_flow.timestep_of(ABAR, vp_flow.level_of(ABAR[taus])), taus.float(), rtol=0,
                               atol=2e-3)
    assert vp_flow.timestep_of(ABAR, torch.tensor([1.0])).item() == 999  # above the top: its last timestep
    x = random.normal(random.key(4), (1, 4, 1, 2, 2))
    assert torch.isfinite(vp_flow.velocity_of_epsilon(x, x, torch.tensor([1.0]), ABAR)).all()


def test_integer_levels_are_the_schedules_own_drawn_per_sample():
    keys = torch.stack([random.fold_in(random.key(0), i) for i in range(2000)])
    sigma, t = vp_flow.integer_levels(ABAR, keys, torch.device("cpu"))
    taus = vp_flow.timestep_of(ABAR, sigma)
    assert torch.allclose(taus, taus.round(), atol=2e-3) and torch.equal(t, 1000 * sigma)
    counts = torch.bincount(taus.round().long() // 250, minlength=4)
    assert counts.min() > 400  # 500 each expected
