"""fvx_methods.library.distribution_matching: the DMD loss with its per-sample normaliser, per-sample score timesteps,
the guided real score and the critic's loss, against hand computations (spec §2.4, the DMD2 paper)."""
import dataclasses

import pytest
import torch

from fvx.core import flow, random
from fvx_methods.library import distribution_matching as dm

SHIFT = 3.0
SHAPE = (16, 1, 4, 4)
SCORE = dm.Score(flow_shift=SHIFT, timestep_shift=8.0, min_timestep_ratio=0.02, max_timestep_ratio=0.98,
                 guidance_scale=4.5, cfg_uncond="zero")


@pytest.fixture(scope="module")
def params(model):
    seeds = (("student", 1), ("critic", 2), ("teacher", 3))
    return {name: model.weights.init(random.key(seed)) for name, seed in seeds}


def make_batch(size: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cond = {"text": torch.randn(size, 8, 32, generator=g), "text_mask": torch.ones(size, 8)}
    return {"cond": cond, "sample_index": torch.arange(5, 5 + 3 * size, 3)}


def hand_sigma(t: float, shift: float = SHIFT) -> torch.Tensor:
    """FastVideo's nearest-grid lookup on S_fm(shift) (float32 grid, argmin, first on ties)."""
    u = torch.arange(1000, 0, -1, dtype=torch.float32) / 1000
    grid = shift * u / (1 + (shift - 1) * u)
    return grid[(grid * 1000 - float(t)).abs().argmin()]


def hand_score_timestep(key, index: int, score=SCORE) -> float:
    """One sample's score timestep: randint of fold_in(key, index), shifted, clamped to [0, 1000] and the window."""
    t0 = int(random.randint(random.fold_in(key, index), (), 0, 1000))
    s = score.timestep_shift
    t = min(max(1000 * (s * t0 / 1000) / (1 + (s - 1) * t0 / 1000), 0.0), 1000.0)
    return min(max(t, int(score.min_timestep_ratio * 1000)), int(score.max_timestep_ratio * 1000))


def hand_noise(key, index: int, draw: int = 0):
    return random.normal(random.fold_in(random.fold_in(key, draw), index), SHAPE)


def one(cond, b):
    return {name: c[b:b + 1] for name, c in cond.items()}


def hand_x0(model, params, x, t, cond):
    v = model.apply(params, x, torch.full((x.shape[0],), float(t)), cond)
    return x - hand_sigma(t) * v


# ---------------------------------------------------------------------------------------------------- the DMD loss


def test_dmd_loss_normalises_each_sample_by_its_own_mean_distance(key):
    k1, k2, k3 = random.split(key, 3)
    x0_gen = random.normal(k1, (3, *SHAPE)).requires_grad_(True)
    x0_fake, x0_real = random.normal(k2, (3, *SHAPE)), random.normal(k3, (3, *SHAPE)) * torch.tensor(
        [0.1, 1.0, 10.0]).view(3, 1, 1, 1, 1)  # samples of very different distance: per-sample != batch mean
    loss, normalizer = dm.dmd_loss(x0_gen, x0_fake, x0_real)
    (g,) = torch.autograd.grad(loss, x0_gen)
    per_sample = torch.stack([(x0_gen[b].detach() - x0_real[b]).abs().mean() for b in range(3)])
    torch.testing.assert_close(normalizer, per_sample)
    assert not torch.allclose(per_sample, per_sample.mean().expand(3))
    direction = torch.stack([(x0_fake[b] - x0_real[b]) / per_sample[b] for b in range(3)])
    torch.testing.assert_close(g, direction / x0_gen.numel(), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(loss, 0.5 * (direction ** 2).mean())
    # x0_gen == x0_fake == x0_real for one sample: its normaliser is 0 and nan_to_num makes its 0/0 term 0
    same, fake = x0_gen.detach().clone(), x0_fake.clone()
    same[1] = fake[1] = x0_real[1]
    loss, normalizer = dm.dmd_loss(same, fake, x0_real)
    kept = [0, 2]
    assert normalizer[1] == 0
    torch.testing.assert_close(loss, 0.5 * (direction[kept] ** 2).sum() / direction.numel())


# ------------------------------------------------------------------------------------------------ score timesteps


def test_score_timesteps_are_drawn_per_sample_in_their_window():
    assert dm.score_window(SCORE) == (20, 980)
    index = torch.arange(40) * 7
    for seed in range(5):
        t = dm.score_timesteps(random.key(seed), index, SCORE)
        assert t.shape == (40,) and t.dtype == torch.float32
        expected = [hand_score_timestep(random.key(seed), int(i)) for i in index]
        torch.testing.assert_close(t, torch.tensor(expected, dtype=torch.float32))
        assert len(set(t.tolist())) > 5  # not one t for the whole batch
        assert t.min() >= 20 and t.max() <= 980


def test_an_upside_down_score_window_is_refused_and_an_equal_one_is_one_level():
    with pytest.raises(ValueError, match=r"^method.min_timestep_ratio = 0.7 is above method.max_timestep_ratio = 0.3: "
                                         r"the score timesteps' window \[min, max\] is empty"):
        dm.check_score_window(0.7, 0.3)
    dm.check_score_window(0.5, 0.5)  # FastVideo's DMD2 rule, 0 <= min <= max <= 1, allows it
    one_level = SCORE._replace(min_timestep_ratio=0.5, max_timestep_ratio=0.5)
    t = dm.score_timesteps(random.key(0), torch.arange(16), one_level)
    assert dm.score_window(one_level) == (500, 500) and set(t.tolist()) == {500.0}


def test_denoising_timesteps_warp_to_training_grid_values():
    warped = dm.denoising_timesteps((1000, 750, 500, 250, 0), True, flow.training_sigmas(5.0))
    grid = flow.training_sigmas(5.0) * 1000
    assert warped.tolist() == [grid[0].item(), grid[250].item(), grid[500].item(), grid[750].item(), 0.0]
    unwarped = dm.denoising_timesteps((1000, 750, 500, 250), False, flow.training_sigmas(5.0))
    assert unwarped.tolist() == [1000, 750, 500, 250]


def test_nearest_grid_sigma():
    grid = flow.training_sigmas(SHIFT)
    t = torch.tensor([1000.0, 750.0, 0.0, 333.3])
    got = flow.nearest_grid_sigma(grid, t)
    assert got.tolist() == [hand_sigma(float(v)).item() for v in t]
    assert got[0] == 1.0 and got[2] == grid[-1]
    assert flow.nearest_grid_sigma(grid, torch.tensor(500.0)).shape == ()


# ------------------------------------------------------------------------------------------------ real and fake


def hand_real_and_fake(model, params, x0_gen, batch, key, score=SCORE, negative=None):
    """Sample by sample (batches of one): its own t and noise, the critic's x0, the teacher's guided x0."""
    t_key, noise_key = random.split(key)
    fakes, reals, ts = [], [], []
    for b, index in enumerate(batch["sample_index"].tolist()):
        t = hand_score_timestep(t_key, index, score)
        s = hand_sigma(t)
        x_t = (1 - s) * x0_gen[b:b + 1] + s * hand_noise(noise_key, index)
        cond = one(batch["cond"], b)
        uncond = {n: torch.zeros_like(c) for n, c in cond.items()} if negative is None else negative
        with torch.no_grad():
            fakes.append(hand_x0(model, params["critic"], x_t, t, cond))
            c, u = hand_x0(model, params["teacher"], x_t, t, cond), hand_x0(model, params["teacher"], x_t, t, uncond)
        reals.append(u + score.guidance_scale * (c - u))
        ts.append(t)
    return torch.cat(fakes), torch.cat(reals), torch.tensor(ts)


def test_real_and_fake_x0_per_sample_against_hand(model, params):
    batch, key = make_batch(), random.key(3)
    x0_gen = torch.randn(3, *SHAPE, generator=torch.Generator().manual_seed(1))
    fake, real, t = dm.real_and_fake_x0(params["critic"], params["teacher"], x0_gen, batch, key, critic=model,
                                        teacher=model, score=SCORE)
    hand_fake, hand_real, hand_t = hand_real_and_fake(model, params, x0_gen, batch, key)
    torch.testing.assert_close(t, hand_t.float())
    assert len(set(t.tolist())) == 3
    torch.testing.assert_close(fake, hand_fake, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(real, hand_real, rtol=1e-5, atol=1e-4)


def counting(model, calls):
    """``model`` whose apply records the timesteps of each call."""
    def apply(p, x, t, cond):
        calls.append(t.clone())
        return model.apply(p, x, t, cond)
    return dataclasses.replace(model, apply=apply)


def test_guidance_convention_and_g1_skips_the_unconditional_call(model, params):
    """fvx: uncond + g (cond - uncond); FastVideo's legacy trainer: cond + w (cond - uncond), so w = g - 1."""
    batch, key = make_batch(2), random.key(3)
    x0_gen = torch.zeros(2, *SHAPE)
    one_scale = SCORE._replace(guidance_scale=1.0)
    _, cond_x0, t = dm.real_and_fake_x0(params["critic"], params["teacher"], x0_gen, batch, key, critic=model,
                                        teacher=model, score=one_scale)
    _, real, _ = dm.real_and_fake_x0(params["critic"], params["teacher"], x0_gen, batch, key, critic=model,
                                     teacher=model, score=SCORE)
    zero = {n: torch.zeros_like(c) for n, c in batch["cond"].items()}
    x_t = dm.noised(x0_gen, batch["sample_index"], key, SCORE, SCORE.grid(x0_gen.device))[0]
    with torch.no_grad():
        uncond_x0 = dm.predict_x0(model, params["teacher"], x_t, t, zero, SCORE.grid(x_t.device))
    torch.testing.assert_close(real, uncond_x0 + 4.5 * (cond_x0 - uncond_x0))
    torch.testing.assert_close(real, cond_x0 + 3.5 * (cond_x0 - uncond_x0), rtol=1e-5, atol=1e-5)
    calls = []
    probe = counting(model, calls)
    dm.real_and_fake_x0(params["critic"], params["teacher"], x0_gen, batch, key, critic=probe, teacher=probe,
                        score=one_scale)
    assert len(calls) == 2 and all(torch.equal(c, t) for c in calls)  # critic + conditional teacher, per-sample t


def test_negative_prompt_is_the_teachers_unconditional_cond(model, params):
    batch, key = make_batch(2), random.key(4)
    negative = {"text": random.normal(random.key(99), (1, 5, 32)), "text_mask": torch.tensor([[1, 1, 1, 1, 0.]])}
    x0_gen = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(2))
    score = SCORE._replace(cfg_uncond="negative_prompt")
    _, real, _ = dm.real_and_fake_x0(params["critic"], params["teacher"], x0_gen, batch, key, critic=model,
                                     teacher=model, score=score, negative=negative)
    _, hand_real, _ = hand_real_and_fake(model, params, x0_gen, batch, key, score, negative=negative)
    torch.testing.assert_close(real, hand_real, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="negative_prompt_path"):
        dm.real_and_fake_x0(params["critic"], params["teacher"], x0_gen, batch, key, critic=model, teacher=model,
                            score=score)


# ---------------------------------------------------------------------------------------------------- the losses


def test_generator_and_critic_losses_against_hand(model, params):
    """With a rollout that returns a differentiable function of the params, the generator loss is the DMD loss of
    the hand real/fake x0s and its gradient flows through x0_gen only; the critic's is flow matching at each
    sample's own t and noise."""
    batch, key = make_batch(), random.key(6)
    base = torch.randn(3, *SHAPE, generator=torch.Generator().manual_seed(3))

    def rollout(p, micro, k, with_grad):
        with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
            return base * p["proj_out.bias"].mean(), torch.full((len(micro["sample_index"]),), 750.0)

    student = {"proj_out.bias": torch.full((16,), 2.0, requires_grad=True)}
    loss, aux = dm.generator_loss(student, batch, params["critic"], params["teacher"], key, rollout=rollout,
                                  critic=model, teacher=model, score=SCORE)
    rollout_key, score_key = random.split(key)
    x0_gen = base * 2.0
    fake, real, t = hand_real_and_fake(model, params, x0_gen, batch, score_key)
    normalizer = (x0_gen - real).abs().mean(dim=(1, 2, 3, 4))
    direction = (fake - real) / normalizer.view(3, 1, 1, 1, 1)
    torch.testing.assert_close(loss, 0.5 * (direction ** 2).mean(), rtol=1e-4, atol=0)
    torch.testing.assert_close(aux["dmd_normalizer"], normalizer.mean(), rtol=1e-5, atol=0)
    torch.testing.assert_close(aux["score_timestep"], t.float().mean())
    (g,) = torch.autograd.grad(loss, student["proj_out.bias"])
    torch.testing.assert_close(g, torch.full((16,), float((direction * base).sum() / direction.numel() / 16)),
                               rtol=1e-4, atol=1e-9)

    loss, _ = dm.critic_loss(params["critic"], batch, student, key, rollout=rollout, critic=model, score=SCORE)
    t_key, noise_key = random.split(score_key)
    terms = []
    for b, index in enumerate(batch["sample_index"].tolist()):
        t_b = hand_score_timestep(t_key, index)
        noise = hand_noise(noise_key, index)
        x_t = (1 - hand_sigma(t_b)) * x0_gen[b:b + 1] + hand_sigma(t_b) * noise
        v = model.apply(params["critic"], x_t, torch.tensor([t_b]), one(batch["cond"], b))
        terms.append(((v - (noise - x0_gen[b:b + 1])) ** 2).mean())
    torch.testing.assert_close(loss, torch.stack(terms).mean(), rtol=1e-4, atol=0)
