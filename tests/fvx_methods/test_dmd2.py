"""fvx_methods.dmd2: the losses against hand computations of spec §2.4, the rollout's graph, cadence, EMA,
guidance convention, determinism and config errors."""
import dataclasses
import pathlib

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from fvx import config as fconfig
from fvx import flow, grad, random, tree, validation
from fvx.optim_config import AdamWConfig
from fvx_methods import dmd2
from fvx_models.wan import WanConfig

SHIFT = 3.0  # the models' training-grid shift (DMD2.flow_shift default)
SHAPE = (16, 1, 4, 4)


@pytest.fixture(scope="module")
def model():
    return WanConfig(preset="tiny").build()


@pytest.fixture(scope="module")
def models(model):
    """Every role on the tiny Wan."""
    return {"student": model, "critic": model, "teacher": model}


@pytest.fixture(scope="module")
def roles(model):
    """Distinct random params for student, critic and teacher."""
    return {name: model.init(random.key(seed)) for name, seed in (("student", 1), ("critic", 2), ("teacher", 3))}


def make_batch(size: int = 2, seed: int = 0, latents: bool = True):
    g = torch.Generator().manual_seed(seed)
    cond = {"text": torch.randn(size, 8, 32, generator=g), "text_mask": torch.ones(size, 8)}
    cond["text_mask"][0, 6:] = 0
    batch = {"cond": cond, "sample_index": torch.arange(5, 5 + 3 * size, 3)}
    if latents:
        batch["latents"] = torch.randn(size, *SHAPE, generator=g)
    return batch


def key_with_rollout_index(k: int, num_steps: int = 4, *, split_first: bool = True) -> torch.Tensor:
    """A key whose rollout index (randint of split(split(key)[0])[0], or of split(key)[0]) is k."""
    for seed in range(1000):
        key = random.key(seed)
        rollout_key = random.split(key)[0] if split_first else key
        if int(random.randint(random.split(rollout_key)[0], (), 0, num_steps)) == k:
            return key
    raise AssertionError("no key found")


# ------------------------------------------------------------------------------------------- hand computations


def hand_sigma(t: float, shift: float = SHIFT) -> torch.Tensor:
    """FastVideo's nearest-grid lookup on S_fm(shift) (float32 grid, argmin, first on ties)."""
    u = torch.arange(1000, 0, -1, dtype=torch.float32) / 1000
    grid = shift * u / (1 + (shift - 1) * u)
    return grid[(grid * 1000 - float(t)).abs().argmin()]


def hand_x0(model, params, x, t, cond):
    v = model.apply(params, x, torch.full((x.shape[0],), float(t)), cond)
    return x - hand_sigma(t) * v


def hand_noise(key, batch, draw):
    return torch.stack([random.normal(random.fold_in(random.fold_in(key, draw), int(i)), SHAPE)
                        for i in batch["sample_index"]])


def hand_rollout(model, params, batch, key, steps, mode="simulate", grad_last=True):
    """(x0_gen, k): spec §2.4's rollout from the documented key layout; only the last call under grad."""
    index_key, noise_key = random.split(key)
    k = int(random.randint(index_key, (), 0, len(steps)))
    cond = batch["cond"]
    with torch.no_grad():
        if mode == "data_latent":
            s = hand_sigma(steps[k])
            x = (1 - s) * batch["latents"] + s * hand_noise(noise_key, batch, 0)
        else:
            x = hand_noise(noise_key, batch, 0)
            for j in range(k):
                s = hand_sigma(steps[j + 1])
                x = (1 - s) * hand_x0(model, params, x, steps[j], cond) + s * hand_noise(noise_key, batch, j + 1)
    with torch.set_grad_enabled(grad_last):
        return hand_x0(model, params, x, steps[k], cond), k


def hand_score_timestep(key, config):
    t0 = int(random.randint(key, (), 0, 1000))
    s = config.timestep_shift
    t = min(max(1000 * (s * t0 / 1000) / (1 + (s - 1) * t0 / 1000), 0.0), 1000.0)
    return min(max(t, int(config.min_timestep_ratio * 1000)), int(config.max_timestep_ratio * 1000))


# ---------------------------------------------------------------------------------------------------- the losses


def test_dmd_loss_gradient_is_the_normalised_direction(key):
    k1, k2, k3 = random.split(key, 3)
    x0_gen = random.normal(k1, (2, *SHAPE)).requires_grad_(True)
    x0_fake, x0_real = random.normal(k2, (2, *SHAPE)), random.normal(k3, (2, *SHAPE))
    loss, normalizer = dmd2.dmd_loss(x0_gen, x0_fake, x0_real)
    (g,) = torch.autograd.grad(loss, x0_gen)
    expected_norm = (x0_gen.detach() - x0_real).abs().mean()
    torch.testing.assert_close(normalizer, expected_norm)
    # x0_gen - (x0_gen - grad) cancels to grad up to rounding of x0_gen (spec form): ~1e-7 of the typical entry
    torch.testing.assert_close(g, (x0_fake - x0_real) / expected_norm / x0_gen.numel(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(loss, 0.5 * (((x0_fake - x0_real) / expected_norm) ** 2).mean())
    # x0_gen == x0_real: the normaliser is 0 and nan_to_num keeps the loss finite (0/0 -> 0)
    same = x0_real.clone().requires_grad_(True)
    loss, normalizer = dmd2.dmd_loss(same, x0_real, x0_real)
    assert normalizer == 0 and torch.isfinite(loss) and loss == 0


@pytest.fixture
def negative_file(tmp_path):
    path = tmp_path / "negative.safetensors"
    save_file({"text": random.normal(random.key(99), (1, 5, 32)), "text_mask": torch.tensor([[1, 1, 1, 1, 0.]])},
              str(path))
    return str(path)


def test_generator_loss_matches_hand_computation(model, models, roles, negative_file):
    config = dmd2.DMD2(guidance_scale=4.5, timestep_shift=8.0, min_timestep_ratio=0.02, max_timestep_ratio=0.98,
                       negative_prompt_path=negative_file)
    negative, _ = model.load_cond(negative_file)
    batch, key = make_batch(), key_with_rollout_index(2)
    steps = config.denoising_steps
    value_and_grad = grad.value_and_grad(dmd2.generator_loss, has_aux=True)
    (loss, aux), grads = value_and_grad(roles["student"], roles["critic"], roles["teacher"], batch, key,
                                        models=models, config=config, negative=negative)

    rollout_key, score_key = random.split(key)
    student = tree.map_tensors(lambda p: p.detach().requires_grad_(True), roles["student"])
    x0_gen, k = hand_rollout(model, student, batch, rollout_key, steps)
    assert k == 2
    t_key, noise_key = random.split(score_key)
    t = hand_score_timestep(t_key, config)
    s = hand_sigma(t)
    with torch.no_grad():
        x_t = (1 - s) * x0_gen + s * hand_noise(noise_key, batch, 0)
        fake = hand_x0(model, roles["critic"], x_t, t, batch["cond"])
        cond = hand_x0(model, roles["teacher"], x_t, t, batch["cond"])
        uncond = hand_x0(model, roles["teacher"], x_t, t, {"text": negative["text"].expand(2, -1, -1),
                                                           "text_mask": negative["text_mask"].expand(2, -1)})
        real = uncond + 4.5 * (cond - uncond)
        normalizer = (x0_gen - real).abs().mean()
        direction = (fake - real) / normalizer
    torch.testing.assert_close(aux["dmd_normalizer"], normalizer, rtol=1e-5, atol=0)
    torch.testing.assert_close(loss, 0.5 * (direction ** 2).mean(), rtol=1e-5, atol=0)
    torch.testing.assert_close(aux["score_timestep"], torch.tensor(t, dtype=torch.float32))
    assert float(aux["generator_timestep"]) == steps[2]
    # d L / d student = (d x0_gen / d student)^T (direction / numel): the gradient flows through x0_gen only
    names = list(student)
    expected = torch.autograd.grad(x0_gen, [student[n] for n in names], grad_outputs=direction / x0_gen.numel())
    for name, g in zip(names, expected):
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-9)


def test_critic_loss_is_flow_matching_on_a_fresh_rollout(model, models, roles):
    config = dmd2.DMD2(timestep_shift=5.0)
    batch, key = make_batch(seed=1), key_with_rollout_index(3)
    loss, aux = dmd2.critic_loss(roles["critic"], roles["student"], batch, key, models=models, config=config)
    rollout_key, score_key = random.split(key)
    x0_gen, k = hand_rollout(model, roles["student"], batch, rollout_key, config.denoising_steps, grad_last=False)
    t_key, noise_key = random.split(score_key)
    t = hand_score_timestep(t_key, config)
    noise = hand_noise(noise_key, batch, 0)
    s = hand_sigma(t)
    x_t = (1 - s) * x0_gen + s * noise
    with torch.no_grad():
        v = model.apply(roles["critic"], x_t, torch.full((2,), float(t)), batch["cond"])
    torch.testing.assert_close(loss, ((v - (noise - x0_gen)) ** 2).mean(), rtol=1e-5, atol=0)
    assert k == 3 and float(aux["generator_timestep"]) == 250


def counting(model, calls):
    """``model`` whose apply records, per call, whether it builds a graph through its params."""
    def apply(params, x, t, cond):
        calls.append(torch.is_grad_enabled() and any(p.requires_grad for p in params.values()))
        return model.apply(params, x, t, cond)
    return dataclasses.replace(model, apply=apply)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_simulate_rollout_grads_flow_through_one_student_call(model, roles, k):
    batch, key = make_batch(latents=False), key_with_rollout_index(k, split_first=False)
    config = dmd2.DMD2(latent_shape=SHAPE)
    calls = []
    probe = random.normal(random.key(5), (2, *SHAPE))

    def loss(params):
        x0 = dmd2.student_rollout(params, batch, key, model=counting(model, calls), config=config)
        return (x0 * probe).sum()

    value, grads = grad.value_and_grad(loss)(roles["student"])
    assert calls == [False] * k + [True]  # k transitions without a graph, then the one graded call
    student = tree.map_tensors(lambda p: p.detach().requires_grad_(True), roles["student"])
    x0, hand_k = hand_rollout(model, student, batch, key, config.denoising_steps)
    assert hand_k == k
    torch.testing.assert_close(value, (x0 * probe).sum().detach(), rtol=1e-5, atol=1e-5)
    expected = torch.autograd.grad((x0 * probe).sum(), list(student.values()))
    for (name, g), e in zip(grads.items(), expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-8)
    nonzero = [name for name, g in grads.items() if g.abs().sum() > 0]
    assert len(nonzero) == len(grads), sorted(set(grads) - set(nonzero))  # every student param gets gradient
    with torch.no_grad():
        again = dmd2.student_rollout(roles["student"], batch, key, model=model, config=config, with_grad=False)
    torch.testing.assert_close(again, x0.detach(), rtol=1e-5, atol=1e-5)


def test_data_latent_rollout_noises_the_data(model, roles):
    config = dmd2.DMD2(rollout_mode="data_latent", denoising_steps=(1000, 757, 522), warp_denoising_step=False)
    batch, key = make_batch(seed=2), key_with_rollout_index(1, num_steps=3, split_first=False)
    calls = []
    x0 = dmd2.student_rollout(roles["student"], batch, key, model=counting(model, calls), config=config,
                              with_grad=False)
    expected, k = hand_rollout(model, roles["student"], batch, key, config.denoising_steps, mode="data_latent",
                               grad_last=False)
    assert k == 1 and calls == [False]
    torch.testing.assert_close(x0, expected, rtol=1e-5, atol=1e-5)


def test_guidance_convention_is_uncond_plus_g_times_difference(model, roles):
    """fvx: uncond + g (cond - uncond); FastVideo's legacy trainer, Self-Forcing and CausVid: cond + w (cond - uncond),
    so w = g - 1."""
    batch, key = make_batch(), random.key(3)
    common = dict(critic=model, teacher=model, negative=None)
    fake, real, t = dmd2.real_and_fake_x0(roles["critic"], roles["teacher"], torch.zeros(2, *SHAPE), batch, key,
                                          config=dmd2.DMD2(guidance_scale=4.5, cfg_uncond="zero"), **common)
    grid = flow.training_sigmas(SHIFT)
    x_t = dmd2._noised(torch.zeros(2, *SHAPE), batch, key, dmd2.DMD2(), grid)[0]
    zero = {"text": torch.zeros_like(batch["cond"]["text"]), "text_mask": torch.zeros_like(batch["cond"]["text_mask"])}
    with torch.no_grad():
        cond_x0 = dmd2.predict_x0(model, roles["teacher"], x_t, t, batch["cond"], grid)
        uncond_x0 = dmd2.predict_x0(model, roles["teacher"], x_t, t, zero, grid)
    torch.testing.assert_close(real, uncond_x0 + 4.5 * (cond_x0 - uncond_x0))
    torch.testing.assert_close(real, cond_x0 + 3.5 * (cond_x0 - uncond_x0), rtol=1e-5, atol=1e-5)  # w = g - 1
    calls = []
    probe = counting(model, calls)
    _, real_g1, _ = dmd2.real_and_fake_x0(roles["critic"], roles["teacher"], torch.zeros(2, *SHAPE), batch, key,
                                          critic=probe, teacher=probe, config=dmd2.DMD2(guidance_scale=1.0))
    assert torch.equal(real_g1, cond_x0) and len(calls) == 2  # g = 1: critic + conditional teacher only


def test_uncond_policies(model, negative_file):
    batch = make_batch()
    kept = dmd2.uncond(model, batch, dmd2.DMD2(cfg_uncond="keep"))
    assert kept["text"] is batch["cond"]["text"]
    zero = dmd2.uncond(model, batch, dmd2.DMD2(cfg_uncond="zero"))
    assert not zero["text"].any() and not zero["text_mask"].any()
    negative, _ = model.load_cond(negative_file)
    from_file = dmd2.uncond(model, batch, dmd2.DMD2(), negative)
    assert from_file["text"].shape == (2, 5, 32) and torch.equal(from_file["text"][1], negative["text"][0])
    assert from_file["text_mask"].tolist() == [[1, 1, 1, 1, 0]] * 2
    with pytest.raises(ValueError, match="negative_prompt_path"):
        dmd2.uncond(model, batch, dmd2.DMD2())


# ------------------------------------------------------------------------------------------------ timesteps


def test_score_timesteps_follow_shift_and_window():
    config = dmd2.DMD2(timestep_shift=8.0, min_timestep_ratio=0.02, max_timestep_ratio=0.98)
    assert dmd2.score_timestep_bounds(config) == (20, 980)
    assert dmd2.score_timestep_bounds(dmd2.DMD2()) == (0, 1000)
    values = []
    for seed in range(200):
        t = dmd2.sample_score_timestep(random.key(seed), config)
        torch.testing.assert_close(t, torch.tensor(hand_score_timestep(random.key(seed), config), dtype=torch.float32))
        values.append(float(t))
    assert min(values) >= 20 and max(values) == 980  # shift 8 pushes many draws above the window


def test_warped_steps_are_training_grid_values():
    config = dmd2.DMD2(denoising_steps=(1000, 750, 500, 250, 0), warp_denoising_step=True, flow_shift=5.0)
    warped = dmd2.denoising_timesteps(config)
    grid = flow.training_sigmas(5.0) * 1000
    assert warped.tolist() == [grid[0].item(), grid[250].item(), grid[500].item(), grid[750].item(), 0.0]
    assert dmd2.denoising_timesteps(dmd2.DMD2()).tolist() == [1000, 750, 500, 250]


def test_nearest_grid_sigma():
    grid = flow.training_sigmas(SHIFT)
    t = torch.tensor([1000.0, 750.0, 0.0, 333.3])
    got = flow.nearest_grid_sigma(grid, t)
    assert got.tolist() == [hand_sigma(float(v)).item() for v in t]
    assert got[0] == 1.0 and got[2] == grid[-1]
    assert flow.nearest_grid_sigma(grid, torch.tensor(500.0)).shape == ()


# --------------------------------------------------------------------------------------------- steps and state


def setup(models, roles, **knobs):
    config = dmd2.DMD2(cfg_uncond="zero", guidance_scale=2.0,
                       optim=AdamWConfig(lr=1e-3), critic_optim=AdamWConfig(lr=1e-3), **knobs)
    txs = dmd2.optimizers(config, total_steps=10)
    state = dmd2.init(random.key(4), models, config, txs)
    kwargs = dict(models=models, config=config, teacher=roles["teacher"], txs=txs)
    return config, state, kwargs


def test_cadence_over_ten_steps_with_interval_five(models, roles):
    config, state, kwargs = setup(models, roles, generator_update_interval=5)
    teacher_before = tree.map_tensors(torch.clone, roles["teacher"])
    batch, updated = make_batch(size=1), []
    for s in range(10):
        before = tree.map_tensors(torch.clone, state.roles["student"].params)
        critic_before = tree.map_tensors(torch.clone, state.roles["critic"].params)
        state, metrics = dmd2.step_(state, batch, **kwargs)
        changed = not all(torch.equal(before[n], p) for n, p in state.roles["student"].params.items())
        assert changed == bool(metrics["update_student"]) == ("generator_loss" in metrics)
        assert not all(torch.equal(critic_before[n], p) for n, p in state.roles["critic"].params.items())
        if changed:
            updated.append(s)
    assert updated == [4, 9]  # FastVideo iterations 5 and 10
    assert int(dmd2._update_count(state.roles["critic"].opt_state)) == 10
    assert int(dmd2._update_count(state.roles["student"].opt_state)) == 2
    assert int(state.step) == 10
    assert all(torch.equal(teacher_before[n], p) and not p.requires_grad for n, p in roles["teacher"].items())
    assert set(metrics) == {"generator_loss", "dmd_normalizer", "grad_norm/student", "lr/student", "critic_loss",
                            "grad_norm/critic", "lr/critic", "update_student"}
    assert dmd2.update_student(0, 0) and dmd2.update_student(3, -1) and dmd2.update_student(7, 1)


def test_ema_follows_its_formula_from_its_start_step(models, roles):
    decay, start = 0.5, 3
    config, state, kwargs = setup(models, roles, generator_update_interval=2, ema_decay=decay, ema_start_step=start)
    initial = tree.map_tensors(torch.clone, state.roles["student"].params)
    assert state.roles["critic"].ema is None
    expected, batch = initial, make_batch(size=1)
    for s in range(6):
        state, _ = dmd2.step_(state, batch, **kwargs)
        student = state.roles["student"]
        iteration = s + 1
        if iteration == start:
            expected = tree.map_tensors(torch.clone, student.params)
        elif iteration > start:
            expected = {n: decay * expected[n] + (1 - decay) * p for n, p in student.params.items()}
        for n in expected:
            torch.testing.assert_close(student.ema[n], expected[n], rtol=0, atol=1e-6)
        if iteration < start:
            assert all(torch.equal(student.ema[n], initial[n]) for n in initial)


def test_validation_samples_the_few_step_student_and_optionally_the_guided_teacher(model, models, roles):
    config, state, kwargs = setup(models, roles, ema_decay=0.9, validate_teacher=True)
    vconfig = validation.ValidationConfig(num_steps=3)
    samplers = dmd2.validate(state, vconfig, models=models, config=config, teacher=roles["teacher"])
    student, teacher = samplers
    assert (student.tag, student.sampler) == ("student_ema", "sde") and student.params is state.roles["student"].ema
    torch.testing.assert_close(student.sigmas, torch.tensor([1.0, 0.75, 0.5, 0.25]))
    assert (teacher.tag, teacher.sampler, len(teacher.sigmas)) == ("teacher", "ode", 3)
    batch = make_batch(size=1)
    x, t, cond = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(3)), torch.tensor([500.0]), batch["cond"]
    uncond = {name: torch.zeros_like(c) for name, c in cond.items()}
    expected = flow.cfg(model.apply(roles["teacher"], x, t, cond), model.apply(roles["teacher"], x, t, uncond), 2.0)
    torch.testing.assert_close(teacher.apply(roles["teacher"], x, t, cond), expected)


def test_same_seed_bit_identical_runs(models):
    config = dmd2.DMD2(cfg_uncond="zero", guidance_scale=3.0, generator_update_interval=2, ema_decay=0.9,
                       optim=AdamWConfig(lr=1e-3), critic_optim=AdamWConfig(lr=1e-3))

    def run(seed):
        program = config.build(models, total_steps=3)
        state, history = program.init(random.key(seed)), []
        frozen = program.frozen(random.key(seed))
        for s in range(3):
            state, metrics = program.step_(state, frozen, make_batch(size=2, seed=s))
            history.append(metrics)
        return state, history

    (a, ha), (b, hb), (c, _) = run(0), run(0), run(1)
    leaves_a, leaves_b = tree.tensor_leaves(a), tree.tensor_leaves(b)
    assert len(leaves_a) == len(leaves_b) and all(torch.equal(x, y) for x, y in zip(leaves_a, leaves_b))
    assert all(torch.equal(ma[n], mb[n]) for ma, mb in zip(ha, hb) for n in ma)
    assert not torch.equal(a.roles["student"].params["proj_out.weight"], c.roles["student"].params["proj_out.weight"])
    # the state is a plain pytree of tensors (checkpointable as it is): only the critic's EMA slot is None
    import optree
    leaves = optree.tree_leaves(a, none_is_leaf=True)
    assert sum(x is None for x in leaves) == 1 and all(x is None or isinstance(x, torch.Tensor) for x in leaves)


def test_each_role_starts_from_its_models_folder(model, roles, tmp_path):
    model.export(roles["teacher"], str(tmp_path / "teacher"))
    model.export(roles["student"], str(tmp_path / "student"))
    student = WanConfig(path=str(tmp_path / "student")).build()
    teacher = WanConfig(path=str(tmp_path / "teacher"), frozen_dtype="fp32").build()
    config = dmd2.DMD2(cfg_uncond="keep", guidance_scale=1.5)
    program = config.build({"student": student, "critic": student, "teacher": teacher}, total_steps=2)
    batch = make_batch(size=1)
    program.check(batch)
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    assert torch.equal(state.roles["critic"].params["proj_out.weight"], roles["student"]["proj_out.weight"])
    assert all(torch.equal(p, roles["teacher"][n]) for n, p in frozen["teacher"].items())
    state, metrics = program.step_(state, frozen, batch)
    assert set(state.roles) == {"student", "critic"} and torch.isfinite(metrics["generator_loss"])


def test_a_teacher_of_another_size_trains_the_student(model):
    deep = WanConfig(preset="tiny-deep").build()
    program = dmd2.DMD2(cfg_uncond="zero", guidance_scale=2.0, generator_update_interval=1).build(
        {"student": model, "critic": model, "teacher": deep}, total_steps=2)
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    assert frozen["teacher"]["blocks.2.ffn.net.0.proj.weight"].shape == (288, 144)  # 3 heads, 3 layers, FFN 288
    before = tree.map_tensors(torch.clone, state.roles["student"].params)
    state, metrics = program.step_(state, frozen, make_batch())
    assert torch.isfinite(metrics["generator_loss"])
    assert not torch.equal(before["proj_out.weight"], state.roles["student"].params["proj_out.weight"])


def test_roles_must_share_the_latent_space_and_conditioning(model):
    ti2v = WanConfig(preset="tiny-ti2v").build()
    with pytest.raises(ValueError, match=r"roles 'student' \(wan:tiny\) and 'teacher' \(wan:tiny-ti2v\) denoise "
                                         r"different latent spaces: 16 channels.* vs 48 channels"):
        dmd2.DMD2().build({"student": model, "critic": model, "teacher": ti2v}, total_steps=1)
    from fvx_models.hunyuan_video import HunyuanVideoConfig
    hunyuan = HunyuanVideoConfig().build()
    with pytest.raises(ValueError, match="different latent spaces"):
        dmd2.DMD2().build({"student": model, "critic": hunyuan, "teacher": model}, total_steps=1)


KEPT_FP32 = {"time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"}  # diffusers' Wan list, by hand


def test_bf16_teacher_is_bf16_but_the_fp32_kept_modules_and_guides_like_the_fp32_teacher(model, roles):
    """The teacher is stored in its model's frozen dtype (bf16 but Wan's fp32-kept modules), holding the fp32
    teacher's values rounded; its guided x0 is close to the fp32 teacher's, and a step with it runs."""
    config = dmd2.DMD2(cfg_uncond="zero", guidance_scale=3.0)
    teacher = model.initial_params(random.key(3), frozen=True)
    fp32 = model.init(random.key(3))
    for name, p in teacher.items():
        kept = bool(KEPT_FP32 & set(name.split(".")))
        assert p.dtype == (torch.float32 if kept else torch.bfloat16), name
        assert torch.equal(p, fp32[name].to(p.dtype)) and not p.requires_grad, name
    assert 0 < sum(p.dtype == torch.float32 for p in teacher.values()) < len(teacher) // 2

    batch, key = make_batch(), random.key(5)
    x0_gen = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(1))
    common = dict(critic=model, teacher=model, config=config)
    _, real_bf16, _ = dmd2.real_and_fake_x0(roles["critic"], teacher, x0_gen, batch, key, **common)
    _, real_fp32, _ = dmd2.real_and_fake_x0(roles["critic"], fp32, x0_gen, batch, key, **common)
    assert real_bf16.dtype == torch.float32 and not torch.equal(real_bf16, real_fp32)
    assert (real_bf16 - real_fp32).norm() < 0.02 * real_fp32.norm()


def test_the_dry_run_counts_the_teacher_at_its_frozen_dtype(model):
    from fvx import memory

    half = model.memory_spec()
    full = WanConfig(frozen_dtype="fp32").build().memory_spec()
    bf16 = {r.name: memory.role_bytes(r, 2) for r in dmd2.DMD2().memory_plan(
        {"student": half, "critic": half, "teacher": half}).roles}
    fp32 = {r.name: memory.role_bytes(r, 2) for r in dmd2.DMD2().memory_plan(
        {"student": half, "critic": half, "teacher": full}).roles}
    assert 2 * bf16["teacher"].params == fp32["teacher"].params == fp32["critic"].params > 0
    assert bf16["teacher"].total == bf16["teacher"].params
    assert bf16["student"] == fp32["student"] and bf16["critic"] == fp32["critic"]


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("knobs, match", [
    (dict(denoising_steps=()), "non-empty"),
    (dict(denoising_steps=(1000, 1000, 500)), "strictly descending"),
    (dict(denoising_steps=(500, 750)), "strictly descending"),
    (dict(denoising_steps=(1200, 500)), r"\[0, 1000\]"),
    (dict(min_timestep_ratio=0.6, max_timestep_ratio=0.4), "0 <= min_timestep_ratio"),
    (dict(min_timestep_ratio=-0.1), "0 <= min_timestep_ratio"),
    (dict(max_timestep_ratio=1.5), "0 <= min_timestep_ratio"),
    (dict(critic_optim=AdamWConfig(lr=0.0)), "critic_optim.lr"),
    (dict(ema_decay=1.5), "decay"),
])
def test_config_errors(knobs, match):
    with pytest.raises(ValueError, match=match):
        dmd2.DMD2(**knobs)
    builtins = msgspec.to_builtins(dmd2.DMD2())
    builtins.update(msgspec.to_builtins(knobs))
    with pytest.raises(msgspec.ValidationError, match=match):  # the override path (fvx.config) checks it too
        msgspec.convert(builtins, dmd2.DMD2)


def test_override_errors_name_the_field():
    with pytest.raises(fconfig.ConfigError, match="rollout_mode"):
        fconfig.validate(dmd2.DMD2(rollout_mode="sim"))


def test_batch_errors(model):
    text_only = make_batch(latents=False)
    with pytest.raises(ValueError, match="data_latent.*text_only"):
        dmd2.check_batch(text_only, model, dmd2.DMD2(rollout_mode="data_latent"))
    with pytest.raises(ValueError, match="latent_shape"):
        dmd2.check_batch(text_only, model, dmd2.DMD2())
    dmd2.check_batch(text_only, model, dmd2.DMD2(latent_shape=SHAPE))
    with pytest.raises(ValueError, match="negative_prompt_path"):
        dmd2.check_batch(make_batch(), model, dmd2.DMD2(guidance_scale=4.5))
    with pytest.raises(ValueError, match="latent_shape"):
        dmd2.check_batch(text_only, model, dmd2.DMD2(latent_shape=(16, 1, 3, 3)))


def test_negative_prompt_file_errors_come_before_weights_load(model, tmp_path):
    missing_teacher = WanConfig(path=str(tmp_path / "no_such_teacher")).build()
    models = {"student": model, "critic": model, "teacher": missing_teacher}
    narrow = tmp_path / "narrow.safetensors"
    save_file({"text": torch.zeros(5, 16)}, str(narrow))
    with pytest.raises(ValueError, match=r"must be \[B, L, 32\], got \[1, 5, 16\]"):
        dmd2.DMD2(negative_prompt_path=str(narrow)).build(models, total_steps=1)
    unnamed = tmp_path / "unnamed.safetensors"
    save_file({"embeds": torch.zeros(5, 32)}, str(unnamed))
    with pytest.raises(ValueError, match=r"missing \['text', 'text_mask'\]"):
        dmd2.DMD2(negative_prompt_path=str(unnamed)).build(models, total_steps=1)
    with pytest.raises(ValueError, match="does not exist"):
        dmd2.DMD2(negative_prompt_path=str(tmp_path / "missing.safetensors")).build(models, total_steps=1)
    two = tmp_path / "two.safetensors"
    save_file({"text": torch.zeros(2, 5, 32)}, str(two))
    with pytest.raises(ValueError, match="holds 2 prompts; a negative prompt is one"):
        dmd2.DMD2(negative_prompt_path=str(two)).build(models, total_steps=1)


def test_bad_batches_fail_before_the_teacher_loads(model, tmp_path):
    missing_teacher = WanConfig(path=str(tmp_path / "no_such_teacher")).build()
    program = dmd2.DMD2(rollout_mode="data_latent").build(
        {"student": model, "critic": model, "teacher": missing_teacher}, total_steps=1)  # nothing loads yet
    with pytest.raises(ValueError, match="data_latent"):
        program.check(make_batch(latents=False))
    with pytest.raises(ValueError, match="no_such_teacher"):  # the teacher loads when the loop asks for it
        program.frozen(random.key(0))


@pytest.mark.parametrize("interval", [1, 1000], ids=["student_and_critic", "critic_only"])
def test_nonfinite_step_applies_nothing(models, roles, interval):
    config, state, kwargs = setup(models, roles, generator_update_interval=interval, ema_decay=0.5)
    state.roles["critic"].params["proj_out.bias"][0] = float("nan")
    before = tree.map_tensors(torch.clone, state)
    state, metrics = dmd2.step_(state, make_batch(size=1), **kwargs)
    assert metrics["nonfinite"] == 1 and int(state.step) == 1
    leaves, expected = tree.tensor_leaves(state.roles), tree.tensor_leaves(before.roles)
    assert all(torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num())
               for a, b in zip(leaves, expected))


# --------------------------------------------------------------------------------------------- resume, end to end


def test_resume_is_the_uninterrupted_run_bit_for_bit(tmp_path):
    """6 DMD2 steps (student on every 2nd, EMA) equal 3 steps resumed to 6: logged metrics and final state."""
    from fvx import checkpoint, loop, run, tracking

    experiment = str(pathlib.Path(__file__).resolve().parents[2] / "experiments" / "dmd2.py")
    quick = ["run.progress=false", "data.batch_size=2", "data.synthetic.latent_shape=[16,1,4,4]", "validation.every=0",
             "method.generator_update_interval=2", "run.checkpoint.every=3", "run.checkpoint.async_save=false"]

    def final_state(out):
        with checkpoint.Checkpoints(out / loop.CHECKPOINTS) as checkpoints:
            return checkpoint.leaves_by_name(checkpoints.read(checkpoints.latest(), ()))

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run.main([experiment, "--out", str(whole), "--steps", "6", *quick]) == 0
    assert run.main([experiment, "--out", str(resumed), "--steps", "3", *quick]) == 0
    assert run.main([experiment, "--out", str(resumed), "--steps", "6", "--resume", *quick]) == 0
    logged, expected = tracking.read_scalars(resumed / "tb"), tracking.read_scalars(whole / "tb")
    for name in ("critic_loss", "generator_loss", "dmd_normalizer", "grad_norm/critic", "update_student"):
        assert logged[name] == expected[name], name
    assert [step for step, _ in logged["critic_loss"]] == list(range(6))
    state, expected_state = final_state(resumed), final_state(whole)
    assert state.keys() == expected_state.keys() and any(".ema." in name for name in state)
    for name, tensor in state.items():
        assert torch.equal(tensor, expected_state[name]), name
