"""fvx_methods.dmd2: the per-sample rollout, the step against the role library's hand sequence, gradient
accumulation, cadence, EMA, validation, determinism, the roles' models and bad input (spec §2.4)."""
import dataclasses
import math
import pathlib

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from fvx import config as fconfig
from fvx.core import flow, grad, optim, random, role, tree
from fvx.core.optim_config import AdamWConfig
from fvx.core.state import copy
from fvx.training import dry_run, validation
from fvx_methods import dmd2
from fvx_methods.library import distribution_matching as dm
from fvx_models.wan import WanConfig

from run_state import final_state  # noqa: E402

SHIFT = 3.0  # the models' training-grid shift (DMD2.flow_shift default)
SHAPE = (16, 1, 4, 4)


@pytest.fixture(scope="module")
def models(model):
    """Every role on the tiny Wan."""
    return {"student": model, "critic": model, "teacher": model}


@pytest.fixture(scope="module")
def roles(model):
    """Distinct random params for student, critic and teacher."""
    seeds = (("student", 1), ("critic", 2), ("teacher", 3))
    return {name: model.weights.init(random.key(seed)) for name, seed in seeds}


def make_batch(size: int = 2, seed: int = 0, latents: bool = True):
    g = torch.Generator().manual_seed(seed)
    cond = {"text": torch.randn(size, 8, 32, generator=g), "text_mask": torch.ones(size, 8)}
    cond["text_mask"][0, 6:] = 0
    batch = {"cond": cond, "sample_index": torch.arange(5, 5 + 3 * size, 3)}
    if latents:
        batch["latents"] = torch.randn(size, *SHAPE, generator=g)
    return batch


def rows(batch, b):
    """Sample ``b`` of ``batch`` as a batch of one."""
    return {n: rows(v, b) if isinstance(v, dict) else v[b:b + 1] for n, v in batch.items()}


def hand_k(key, index: int, num_steps: int = 4) -> int:
    """A sample's exit index: randint of fold_in(split(key)[0], index)."""
    return int(random.randint(random.fold_in(random.split(key)[0], index), (), 0, num_steps))


def key_with_exits(ks, batch, num_steps: int = 4):
    """A rollout key whose per-sample exit indices are ``ks``."""
    for seed in range(5000):
        key = random.key(seed)
        if [hand_k(key, int(i), num_steps) for i in batch["sample_index"]] == list(ks):
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


def hand_noise(key, index, draw):
    return random.normal(random.fold_in(random.fold_in(key, draw), int(index)), SHAPE)[None]


def hand_rollout(model, params, batch, key, steps, mode="simulate", grad_last=True):
    """(x0_gen, ks): spec §2.4's rollout sample by sample (batches of one), each at its own exit index."""
    noise_key = random.split(key)[1]
    out, ks = [], []
    for b, index in enumerate(batch["sample_index"].tolist()):
        k, one = hand_k(key, index, len(steps)), rows(batch, b)
        with torch.no_grad():
            if mode == "data_latent":
                s = hand_sigma(steps[k])
                x = (1 - s) * one["latents"] + s * hand_noise(noise_key, index, 0)
            else:
                x = hand_noise(noise_key, index, 0)
                for j in range(k):
                    s = hand_sigma(steps[j + 1])
                    x = (1 - s) * hand_x0(model, params, x, steps[j], one["cond"]) + s * hand_noise(noise_key, index,
                                                                                                 j + 1)
        with torch.set_grad_enabled(grad_last):
            out.append(hand_x0(model, params, x, steps[k], one["cond"]))
        ks.append(k)
    return torch.cat(out), ks


def counting(model, calls):
    """``model`` whose apply records, per call, whether it builds a graph through its params, and its batch size."""
    def apply(params, x, t, cond):
        calls.append((torch.is_grad_enabled() and any(p.requires_grad for p in params.values()), x.shape[0]))
        return model.apply(params, x, t, cond)
    return dataclasses.replace(model, apply=apply)


# ---------------------------------------------------------------------------------------------------- the rollout


@pytest.mark.parametrize("ks", [(0, 0, 0), (0, 2, 1), (3, 1, 3)])
def test_simulate_rollout_exits_each_sample_at_its_own_step(model, roles, ks):
    batch = make_batch(size=3, latents=False)
    key = key_with_exits(ks, batch)
    config = dmd2.DMD2(latent_shape=SHAPE)
    calls, probe = [], random.normal(random.key(5), (3, *SHAPE))

    def loss(params):
        x0, t = dmd2.rollout(params, batch, key, True, model=counting(model, calls), config=config)
        assert t.tolist() == [config.denoising_steps[k] for k in ks]
        return (x0 * probe).sum()

    value, grads = grad.value_and_grad(loss)(roles["student"])
    hops = [(False, sum(k > j for k in ks)) for j in range(max(ks))]  # hop j on the samples with k > j, no graph
    assert calls == hops + [(True, 3)]  # then one graded call on the whole batch
    student = tree.map_tensors(lambda p: p.detach().requires_grad_(True), roles["student"])
    x0, hand_ks = hand_rollout(model, student, batch, key, config.denoising_steps)
    assert hand_ks == list(ks)
    torch.testing.assert_close(value, (x0 * probe).sum().detach(), rtol=1e-5, atol=1e-4)
    expected = torch.autograd.grad((x0 * probe).sum(), list(student.values()))
    for (name, g), e in zip(grads.items(), expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    assert all(g.abs().sum() > 0 for g in grads.values())  # every student param gets gradient


def test_the_rollout_of_a_sample_does_not_depend_on_its_batch(model, roles):
    """One process equals two: a sample's x0_gen alone equals its row of the whole batch."""
    batch = make_batch(size=3, latents=False)
    key = key_with_exits((0, 3, 1), batch)
    config = dmd2.DMD2(latent_shape=SHAPE)
    whole, _ = dmd2.rollout(roles["student"], batch, key, False, model=model, config=config)
    for b in range(3):
        alone, _ = dmd2.rollout(roles["student"], rows(batch, b), key, False, model=model, config=config)
        torch.testing.assert_close(alone, whole[b:b + 1], rtol=1e-5, atol=1e-5)


def test_data_latent_rollout_noises_the_data_to_each_samples_step(model, roles):
    config = dmd2.DMD2(rollout_mode="data_latent", denoising_steps=(1000, 757, 522))
    batch = make_batch(size=3, seed=2)
    key = key_with_exits((1, 0, 2), batch, num_steps=3)
    calls = []
    x0, _ = dmd2.rollout(roles["student"], batch, key, False, model=counting(model, calls), config=config)
    expected, ks = hand_rollout(model, roles["student"], batch, key, config.denoising_steps, mode="data_latent",
                                grad_last=False)
    assert ks == [1, 0, 2] and calls == [(False, 3)]
    torch.testing.assert_close(x0, expected, rtol=1e-5, atol=1e-5)


def test_generator_loss_through_the_real_rollout_against_hand(model, models, roles):
    """Per-sample k, t, noise and normaliser, all by hand sample by sample."""
    config = dmd2.DMD2(guidance_scale=4.5, cfg_uncond="zero", timestep_shift=8.0, min_timestep_ratio=0.02,
                       max_timestep_ratio=0.98)
    batch = make_batch(size=3)
    key = random.key(7)
    rollout_key, score_key = random.split(key)

    def rollout(params, micro, k, with_grad):
        return dmd2.rollout(params, micro, k, with_grad, model=model, config=config)

    (loss, aux), grads = grad.value_and_grad(dm.generator_loss, has_aux=True)(
        roles["student"], batch, roles["critic"], roles["teacher"], key, rollout=rollout, critic=model,
        teacher=model, score=config.score())
    student = tree.map_tensors(lambda p: p.detach().requires_grad_(True), roles["student"])
    x0_gen, ks = hand_rollout(model, student, batch, rollout_key, config.denoising_steps)
    assert len(set(ks)) > 1
    t_key, noise_key = random.split(score_key)
    directions, normalizers = [], []
    for b, index in enumerate(batch["sample_index"].tolist()):
        t0 = int(random.randint(random.fold_in(t_key, index), (), 0, 1000))
        t = min(max(1000 * (8 * t0 / 1000) / (1 + 7 * t0 / 1000), 20), 980)
        s, one = hand_sigma(t), rows(batch, b)
        with torch.no_grad():
            x_t = (1 - s) * x0_gen[b:b + 1] + s * hand_noise(noise_key, index, 0)
            fake = hand_x0(model, roles["critic"], x_t, t, one["cond"])
            c = hand_x0(model, roles["teacher"], x_t, t, one["cond"])
            u = hand_x0(model, roles["teacher"], x_t, t, {n: torch.zeros_like(v) for n, v in one["cond"].items()})
            real = u + 4.5 * (c - u)
            normalizers.append((x0_gen[b:b + 1] - real).abs().mean())
            directions.append((fake - real) / normalizers[-1])
    direction = torch.cat(directions)
    torch.testing.assert_close(aux["dmd_normalizer"], torch.stack(normalizers).mean(), rtol=1e-4, atol=0)
    torch.testing.assert_close(loss, 0.5 * (direction ** 2).mean(), rtol=1e-4, atol=0)
    expected = torch.autograd.grad(x0_gen, list(student.values()), grad_outputs=direction / x0_gen.numel())
    for (name, g), e in zip(grads.items(), expected):  # batched vs one by one: float rounding only
        assert (g - e).norm() <= 1e-3 * e.norm() + 1e-9, name


# --------------------------------------------------------------------------------------------- steps and state


def setup(models, roles, total_steps=10, **knobs):
    knobs = {"optim": AdamWConfig(lr=1e-3), "critic_optim": AdamWConfig(lr=1e-3), **knobs}
    config = dmd2.DMD2(cfg_uncond="zero", guidance_scale=2.0, **knobs)
    program = config.build(models, total_steps=total_steps)
    return config, program, program.init(random.key(4)), {"teacher": roles["teacher"]}


def test_the_step_equals_the_hand_written_sequence_bitwise(model, models, roles):
    """Both losses from the params before the step, then per role: global norm, clip
    (``torch.nn.utils.clip_grad_norm_``'s scaling), ``optim.step_`` of AdamW, and the student's EMA."""
    config, program, state, frozen = setup(models, roles, ema_decay=0.5,
                                           optim=AdamWConfig(lr=1e-3, max_grad_norm=0.01, weight_decay=0.01),
                                           critic_optim=AdamWConfig(lr=2e-3, max_grad_norm=0.01))
    before, batch = copy(state), make_batch(size=2)
    state, metrics = program.step_(state, frozen, batch)
    student, critic = (tree.map_tensors(torch.clone, before.roles[n].params) for n in ("student", "critic"))
    generator_key, critic_key = random.split(random.fold_in(before.key, 0))

    def rollout(params, micro, k, with_grad):
        return dmd2.rollout(params, micro, k, with_grad, model=model, config=config)

    common = dict(rollout=rollout, critic=model, score=config.score())
    (g_loss, _), g_grads = grad.value_and_grad(dm.generator_loss, has_aux=True)(
        student, batch, critic, roles["teacher"], generator_key, teacher=model, **common)
    (c_loss, _), c_grads = grad.value_and_grad(dm.critic_loss, has_aux=True)(critic, batch, student, critic_key,
                                                                             **common)
    assert torch.equal(metrics["generator_loss"], g_loss) and torch.equal(metrics["critic_loss"], c_loss)
    assert torch.equal(metrics["grad_norm/student"], tree.global_norm(g_grads))
    for name, params, grads, adamw in (("student", student, g_grads, config.optim),
                                       ("critic", critic, c_grads, config.critic_optim)):
        tx = adamw.build(10)
        grads = role.clip_(grads, tree.global_norm(grads), 0.01)
        params, opt_state = optim.step_(tx, params, grads, tx.init(params))
        assert all(torch.equal(state.roles[name].params[n], params[n]) for n in params), name
        assert all(torch.equal(state.roles[name].opt_state[0].nu[n], opt_state[0].nu[n]) for n in params), name
    assert all(torch.equal(state.roles["student"].ema[n], p) for n, p in state.roles["student"].params.items())


def test_grad_accumulation_equals_the_whole_batch(model, models, roles):
    """grad_accum=2 over a batch of 4 equals one micro-batch of 4, to float rounding: the metrics of a step, and
    each role's accumulated gradients."""
    results = []
    for accum in (1, 2):
        config, program, state, frozen = setup(models, roles, grad_accum=accum)
        results.append(program.step_(state, frozen, make_batch(size=4))[1])
    for name in ("generator_loss", "critic_loss", "dmd_normalizer", "grad_norm/student", "grad_norm/critic"):
        torch.testing.assert_close(results[0][name], results[1][name], rtol=1e-5, atol=0, msg=name)

    def rollout(params, micro, k, with_grad):
        return dmd2.rollout(params, micro, k, with_grad, model=model, config=config)

    common = dict(rollout=rollout, critic=model, teacher=model, score=config.score())
    one, two = (role.grads(dm.generator_loss, roles["student"], roles["student"], make_batch(size=4), n,
                           roles["critic"], roles["teacher"], random.key(3), **common)[1] for n in (1, 2))
    for n, g in one.items():
        assert (g - two[n]).norm() <= 1e-5 * g.norm() + 1e-12, n


def test_cadence_over_ten_steps_with_interval_five(models, roles):
    _, program, state, frozen = setup(models, roles, generator_update_interval=5)
    teacher_before = tree.map_tensors(torch.clone, roles["teacher"])
    batch, updated = make_batch(size=1), []
    for s in range(10):
        before = tree.map_tensors(torch.clone, state.roles["student"].params)
        critic_before = tree.map_tensors(torch.clone, state.roles["critic"].params)
        state, metrics = program.step_(state, frozen, batch)
        changed = not all(torch.equal(before[n], p) for n, p in state.roles["student"].params.items())
        assert changed == bool(metrics["update_student"]) == ("generator_loss" in metrics)
        assert not all(torch.equal(critic_before[n], p) for n, p in state.roles["critic"].params.items())
        if changed:
            updated.append(s)
    assert updated == [4, 9]  # FastVideo iterations 5 and 10
    assert int(optim.get_count(state.roles["critic"].opt_state)) == 10
    assert int(optim.get_count(state.roles["student"].opt_state)) == 2
    assert int(state.step) == 10
    assert all(torch.equal(teacher_before[n], p) and not p.requires_grad for n, p in roles["teacher"].items())
    assert set(metrics) == {"generator_loss", "dmd_normalizer", "grad_norm/student", "lr/student", "critic_loss",
                            "grad_norm/critic", "lr/critic", "update_student"}
    assert dm.update_student(0, 0) and dm.update_student(3, -1) and dm.update_student(7, 1)


def test_ema_follows_its_formula_from_its_start_step(models, roles):
    decay, start = 0.5, 3
    _, program, state, frozen = setup(models, roles, generator_update_interval=2, ema_decay=decay,
                                      ema_start_step=start)
    initial = tree.map_tensors(torch.clone, state.roles["student"].params)
    assert state.roles["critic"].ema is None
    expected, batch = initial, make_batch(size=1)
    for s in range(6):
        state, _ = program.step_(state, frozen, batch)
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
    _, program, state, frozen = setup(models, roles, ema_decay=0.9, validate_teacher=True)
    vconfig = validation.ValidationConfig(num_steps=3)
    student, teacher = program.validate(state, frozen, vconfig)
    assert (student.tag, student.sampler, student.guided) == ("student_ema", "sde", False)
    assert student.params is state.roles["student"].ema
    torch.testing.assert_close(student.sigmas, torch.tensor([1.0, 0.75, 0.5, 0.25]))  # the shift-3 grid's levels
    assert (teacher.tag, teacher.sampler, len(teacher.sigmas), teacher.guided) == ("teacher", "ode", 3, False)
    batch = make_batch(size=1)
    x, t, cond = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(3)), torch.tensor([500.0]), batch["cond"]
    uncond = {name: torch.zeros_like(c) for name, c in cond.items()}
    expected = flow.cfg(model.apply(roles["teacher"], x, t, cond), model.apply(roles["teacher"], x, t, uncond), 2.0)
    torch.testing.assert_close(teacher.apply(roles["teacher"], x, t, cond), expected)


def test_validation_calls_the_student_at_its_steps_and_converts_with_the_nearest_grid_sigma(model, models, roles):
    """The model at t = 1000, 750, 500, 250; x0 = x - sigma v and the re-noising with the level nearest t of the grid
    at ``sampling_shift``: by default the rollout's (flow_shift 3: exactly t / 1000 for these t), with 8 FastVideo's
    DmdDenoisingStage's (up to 2.8e-4 from t / 1000). The export's record says the same."""
    steps = (1000, 750, 500, 250)
    _, program, state, frozen = setup(models, roles)
    (trained,) = program.validate(state, frozen, validation.ValidationConfig())
    torch.testing.assert_close(trained.sigmas, torch.tensor([1.0, 0.75, 0.5, 0.25]), rtol=0, atol=0)
    _, program, state, frozen = setup(models, roles, sampling_shift=8.0)
    (student,) = program.validate(state, frozen, validation.ValidationConfig())
    shift8 = [8 * u / (1 + 7 * u) for u in (1.0, 0.273, 0.111, 0.04)]  # nearest of 1000 shift8(i / 1000) to t
    torch.testing.assert_close(student.sigmas, torch.tensor(shift8), rtol=0, atol=1e-7)
    torch.testing.assert_close(student.sigmas, torch.stack([hand_sigma(t, 8.0) for t in steps]), rtol=0, atol=0)
    assert 2.7e-4 < (student.sigmas - torch.tensor([1.0, 0.75, 0.5, 0.25])).abs().max() <= 2.9e-4
    config = dmd2.DMD2(cfg_uncond="zero", sampling_shift=8.0)
    assert config.sampling("student") == {"timesteps": [1000.0, 750.0, 500.0, 250.0],
                                          "sigmas": student.sigmas.tolist(), "sampler": "sde (x0, re-noised)"}
    ts, batch, key = [], make_batch(size=1), random.key(11)

    def recording(params, x, t, cond):
        ts.append(t.tolist())
        return model.apply(params, x, t, cond)

    noise = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(5))
    params = state.roles["student"].params
    out = dmd2.few_step_draw(recording, *dmd2.student_schedule(config))(params, noise, batch["cond"], key)
    assert ts == [[1000.0], [750.0], [500.0], [250.0]]
    x, sigmas = noise, student.sigmas
    for i, t in enumerate(steps):
        x0 = x - sigmas[i] * model.apply(params, x, torch.tensor([float(t)]), batch["cond"])
        if i < 3:
            x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * random.normal(random.fold_in(key, i), (1, *SHAPE))
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)


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
    # the state is a plain pytree of tensors (checkpointable as it is): only the critic's EMA slot and the carry (DMD2
    # carries nothing across steps) are None
    import optree
    leaves = optree.tree_leaves(a, none_is_leaf=True)
    assert sum(x is None for x in leaves) == 2 and all(x is None or isinstance(x, torch.Tensor) for x in leaves)


def test_each_role_starts_from_its_models_folder(model, roles, tmp_path):
    model.export.folder(roles["teacher"], str(tmp_path / "teacher"))
    model.export.folder(roles["student"], str(tmp_path / "student"))
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
    teacher = model.weights.base(random.key(3), whole_model=True)
    fp32 = model.weights.init(random.key(3))
    for name, p in teacher.items():
        kept = bool(KEPT_FP32 & set(name.split(".")))
        assert p.dtype == (torch.float32 if kept else torch.bfloat16), name
        assert torch.equal(p, fp32[name].to(p.dtype)) and not p.requires_grad, name
    assert 0 < sum(p.dtype == torch.float32 for p in teacher.values()) < len(teacher) // 2

    batch, key = make_batch(), random.key(5)
    x0_gen = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(1))
    common = dict(critic=model, teacher=model, score=config.score())
    _, real_bf16, _ = dm.real_and_fake_x0(roles["critic"], teacher, x0_gen, batch, key, **common)
    _, real_fp32, _ = dm.real_and_fake_x0(roles["critic"], fp32, x0_gen, batch, key, **common)
    assert real_bf16.dtype == torch.float32 and not torch.equal(real_bf16, real_fp32)
    assert (real_bf16 - real_fp32).norm() < 0.02 * real_fp32.norm()


def test_the_dry_run_counts_the_teacher_at_its_frozen_dtype(model):
    from fvx.distributed import memory

    half = model.memory_spec()
    full = WanConfig(frozen_dtype="fp32").build().memory_spec()
    bf16 = {r.name: memory.role_bytes(r, 2) for r in dry_run.plan_of(dmd2.DMD2().held_roles(),
        {"student": half, "critic": half, "teacher": half}).roles}
    fp32 = {r.name: memory.role_bytes(r, 2) for r in dry_run.plan_of(dmd2.DMD2().held_roles(),
        {"student": half, "critic": half, "teacher": full}).roles}
    assert 2 * bf16["teacher"].params == fp32["teacher"].params == fp32["critic"].params > 0
    assert bf16["teacher"].total == bf16["teacher"].params
    assert bf16["student"] == fp32["student"] and bf16["critic"] == fp32["critic"]


def test_a_lora_student_and_critic_share_one_frozen_base_with_the_teacher():
    """Three roles, one base: the student's and the critic's frozen params are the teacher's tensors (same
    storage); the state holds the adapters only, the base never changes, and the dry run counts it once."""
    from fvx.distributed import memory
    from fvx_models.lora import LoRAConfig

    student = WanConfig(preset="tiny", lora=LoRAConfig(rank=2, target_modules=("to_q", "to_v"))).build()
    teacher = WanConfig(preset="tiny").build()
    models = {"student": student, "critic": student, "teacher": teacher}
    config = dmd2.DMD2(cfg_uncond="zero", guidance_scale=2.0, generator_update_interval=1,
                       optim=AdamWConfig(lr=1e-2), critic_optim=AdamWConfig(lr=1e-2))
    program = config.build(models, total_steps=3)
    state, frozen = program.init(random.key(4)), program.frozen(random.key(4))
    assert frozen["student"] is frozen["critic"] is frozen["teacher"]
    assert {n: p.data_ptr() for n, p in frozen["student"].items()} == {
        n: p.data_ptr() for n, p in frozen["teacher"].items()}
    for name in ("student", "critic"):
        assert sorted(state.roles[name].params) == sorted(student.weights.trained_names)
    kept = {n: p.clone() for n, p in frozen["teacher"].items()}
    for seed in range(3):
        state, metrics = program.step_(state, frozen, make_batch(seed=seed))
        assert torch.isfinite(metrics["generator_loss"]) and torch.isfinite(metrics["critic_loss"])
    assert all(torch.equal(frozen["teacher"][n], kept[n]) for n in kept)

    spec, teacher_spec = student.memory_spec(), teacher.memory_spec()
    plan = dry_run.plan_of(config.held_roles(), {"student": spec, "critic": spec, "teacher": teacher_spec})
    est = memory.estimate(plan.roles, shard_size=1, tokens=16, batch_per_rank=1)
    rows = dict(est.roles)
    assert rows["  base of student+critic = teacher"].total == 0
    adapters = sum(math.prod(s) for n, s in spec.shapes.items() if n in student.weights.trained_names)
    assert rows["student"].params == 4 * adapters and rows["student"].optimizer == 8 * adapters
    assert rows["teacher"].params == 2 * sum(math.prod(s) for n, s in teacher_spec.shapes.items())
    table = memory.format_table(est)
    assert "base of student+critic = teacher" in table


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("knobs, match", [
    (dict(denoising_steps=()), "strictly descending"),
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
        dm.check_batch(text_only, model, dmd2.DMD2(rollout_mode="data_latent"))
    with pytest.raises(ValueError, match="latent_shape"):
        dm.check_batch(text_only, model, dmd2.DMD2())
    dm.check_batch(text_only, model, dmd2.DMD2(latent_shape=SHAPE))
    with pytest.raises(ValueError, match="negative_prompt_path"):
        dm.check_batch(make_batch(), model, dmd2.DMD2(guidance_scale=4.5))
    with pytest.raises(ValueError, match="latent_shape"):
        dm.check_batch(text_only, model, dmd2.DMD2(latent_shape=(16, 1, 3, 3)))
    with pytest.raises(ValueError, match="method.grad_accum = 3 does not divide a rank's batch of 2"):
        dm.check_batch(make_batch(), model, dmd2.DMD2(grad_accum=3))


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
    _, program, state, frozen = setup(models, roles, generator_update_interval=interval, ema_decay=0.5)
    state.roles["critic"].params["proj_out.bias"][0] = float("nan")
    before = tree.map_tensors(torch.clone, state)
    state, metrics = program.step_(state, frozen, make_batch(size=1))
    assert metrics["nonfinite"] == 1 and int(state.step) == 1
    leaves, expected = tree.tensor_leaves(state.roles), tree.tensor_leaves(before.roles)
    assert all(torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num())
               for a, b in zip(leaves, expected))


# --------------------------------------------------------------------------------------------- resume, end to end


@pytest.mark.parametrize("recipe", ["", ":world_lora"])
def test_resume_is_the_uninterrupted_run_bit_for_bit(tmp_path, world_teacher, recipe):
    """6 DMD2 steps (student on every 2nd, EMA) equal 3 steps resumed to 6: logged metrics and final state; also
    with a LoRA student and critic on the teacher's base."""
    from fvx import run
    from fvx.training import tracking

    experiment = str(pathlib.Path(__file__).resolve().parents[2] / "experiments" / "dmd2.py") + recipe
    quick = ["run.progress=false", "data.batch_size=2", "validation.every=0", "method.generator_update_interval=2",
             "run.checkpoint.every=3", "run.checkpoint.async_save=false", f"models.student.path={world_teacher}",
             f"models.teacher.path={world_teacher}"]

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
