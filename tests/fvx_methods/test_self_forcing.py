"""fvx_methods.self_forcing: the streaming rollout's calls and its equality to an independent full-prefix loop, where
its gradients go, block-at-a-time gradients, the step, validation, bad input, and runs from the CLI (spec §2.5)."""
import dataclasses
import math
import pathlib

import pytest
import torch

from fvx import run
from fvx.core import flow, random, tree
from fvx.core.optim_config import AdamWConfig
from fvx.training import tracking, validation
from fvx_methods import self_forcing as sf
from fvx_methods.library import distribution_matching as dm
from fvx_models.wan import WanConfig
from fvx_models.wan_causal import WanCausalConfig

from run_state import final_state  # noqa: E402

SHAPE = (16, 3, 4, 4)  # 3 blocks of 1 latent frame
EXPERIMENT = str(pathlib.Path(__file__).resolve().parents[2] / "experiments" / "self_forcing_causal_t2v.py")


@pytest.fixture(scope="module")
def student():
    return WanCausalConfig(preset="tiny", num_frames_per_block=1).build()


@pytest.fixture(scope="module")
def bidirectional():
    return WanConfig(preset="tiny").build()


@pytest.fixture(scope="module")
def params(student, bidirectional):
    """Distinct random params per role (the causal student's names are Wan's)."""
    return {"student": student.weights.init(random.key(1)), "critic": bidirectional.weights.init(random.key(2)),
            "teacher": bidirectional.weights.init(random.key(3))}


def make_batch(size: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cond = {"text": torch.randn(size, 8, 32, generator=g), "text_mask": torch.ones(size, 8)}
    return {"cond": cond, "sample_index": torch.arange(5, 5 + 3 * size, 3),
            "latents": torch.randn(size, *SHAPE, generator=g)}


def config(**knobs):
    knobs = {"chunk_size": 1, "guidance_scale": 2.0, "cfg_uncond": "zero", "optim": AdamWConfig(lr=1e-3),
             "critic_optim": AdamWConfig(lr=1e-3), **knobs}
    return sf.SelfForcing(**knobs)


def recording(model, calls):
    """``model`` whose cached calls append (grad enabled, the model's timestep, the chunk's first frame, whether the
    output records a graph, whether any cache tensor does) to ``calls``."""
    def apply_cached(params, x, t, cond, cache):
        v, after = model.causal.apply_cached(params, x, t, cond, cache)
        cached = any(c.requires_grad for c in cache.keys)
        calls.append((torch.is_grad_enabled(), float(t[0]), cache.next_frame, v.requires_grad, cached))
        return v, after
    return dataclasses.replace(model, causal=dataclasses.replace(model.causal, apply_cached=apply_cached))


def trainable(params):
    return {name: p.detach().clone().requires_grad_(True) for name, p in params.items()}


@pytest.mark.parametrize("knobs", [{}, {"same_step_across_blocks": True, "warp_denoising_step": True},
                                   {"last_step_only": True, "context_noise": 250.5, "start_gradient_frame": 1}],
                         ids=["per_block", "same_step_warped", "last_step_context_noise"])
def test_the_rollout_makes_the_calls_of_the_spec(student, params, knobs):
    """Per block: ``exit_b`` no-grad hops at the steps' floors, one graded call at its exit (graded only from
    start_gradient_frame), then a no-grad context write at floor(context_noise), none after the last block; no cache
    tensor ever records a graph."""
    cfg, calls, key = config(**knobs), [], random.key(11)
    rolled = sf.rollout(trainable(params["student"]), make_batch(), key, True, model=recording(student, calls),
                        config=cfg)
    exits = sf.exit_steps(random.split(key, 4)[0], 3, cfg)
    steps = dm.denoising_timesteps(cfg.denoising_steps, cfg.warp_denoising_step, cfg.score().grid())
    if knobs.get("last_step_only"):
        assert exits == [3, 3, 3]
    if knobs.get("same_step_across_blocks"):
        assert len(set(exits)) == 1
    expected = []
    for b, k in enumerate(exits):
        expected += [(False, math.floor(steps[j]), b, False, False) for j in range(k)]
        graded = b >= cfg.start_gradient_frame
        expected.append((graded, math.floor(steps[k]), b, graded, False))
        if b < 2:
            expected.append((False, math.floor(cfg.context_noise), b, False, False))
    assert calls == expected
    assert [e.frames for e in rolled.exits] == [(b, b + 1) for b in range(3)]
    assert [e.graded for e in rolled.exits] == [b >= cfg.start_gradient_frame for b in range(3)]
    assert torch.equal(rolled.timesteps, steps[exits].mean().expand(2))


@pytest.mark.parametrize("knobs", [{}, {"student_sample_type": "ode", "context_noise": 300.0}], ids=["sde", "ode"])
def test_the_rollout_equals_an_independent_loop_over_the_full_prefix(student, params, knobs):
    """Each block denoised by the plain block-causal forward over [its clean (re-noised) history | the block], with
    the rollout's draws: equal to the cached rollout."""
    cfg, key, batch = config(**knobs), random.key(12), make_batch()
    got = sf.rollout(params["student"], batch, key, False, model=student, config=cfg).x0
    exit_key, noise_key, hop_key, context_key = random.split(key, 4)
    exits = sf.exit_steps(exit_key, 3, cfg)
    steps = dm.denoising_timesteps(cfg.denoising_steps, False, None)
    grid = flow.shift_sigma(torch.linspace(1, 0, 1001)[:-1], cfg.flow_shift)  # FastVideo's S_sf(shift, 1000)
    sigma = [float(flow.nearest_grid_sigma(grid, s.view(1))[0]) for s in steps]
    index, cond = batch["sample_index"], batch["cond"]
    noise = torch.stack([random.normal(random.fold_in(random.fold_in(noise_key, 0), int(i)), SHAPE) for i in index])
    history, history_t, blocks = noise[:, :, :0], torch.zeros(2, 0), []
    for b, k in enumerate(exits):
        x = noise[:, :, b:b + 1]
        for j in range(k + 1):
            t = torch.cat([history_t, torch.full((2, 1), float(math.floor(steps[j])))], dim=1)
            x0 = x - sigma[j] * student.apply(params["student"], torch.cat([history, x], dim=2), t, cond)[:, :, b:]
            if j == k:
                break
            eps = torch.stack([random.normal(random.fold_in(random.fold_in(random.fold_in(hop_key, b), j), int(i)),
                                             (16, 1, 4, 4)) for i in index])
            if cfg.student_sample_type == "ode":
                eps = (x - (1 - sigma[j]) * x0) / sigma[j]
            x = (1 - sigma[j + 1]) * x0 + sigma[j + 1] * eps
        blocks.append(x0)
        context = x0
        if cfg.context_noise:
            level = float(flow.nearest_grid_sigma(grid, torch.tensor([cfg.context_noise]))[0])
            eps = torch.stack([random.normal(random.fold_in(random.fold_in(random.fold_in(context_key, b), 0),
                                                            int(i)), (16, 1, 4, 4)) for i in index])
            context = (1 - level) * x0 + level * eps
        history = torch.cat([history, context], dim=2)
        history_t = torch.cat([history_t, torch.full((2, 1), float(math.floor(cfg.context_noise)))], dim=1)
    torch.testing.assert_close(got, torch.cat(blocks, dim=2), rtol=0, atol=2e-5)


def test_gradients_reach_only_the_exit_calls_from_start_gradient_frame(student, params):
    """With start_gradient_frame 1 the first block's output is a constant; the gradient of the clip equals the one
    recomputed block by block on the rollout's record (:func:`exit_grads`: the cache rebuilt, the exits re-run)."""
    cfg, key, batch, p = config(start_gradient_frame=1), random.key(13), make_batch(), trainable(params["student"])
    rolled = sf.rollout(p, batch, key, True, model=student, config=cfg)
    first = torch.autograd.grad(rolled.x0[:, :, :1].sum(), list(p.values()), retain_graph=True, allow_unused=True)
    assert all(g is None or not g.any() for g in first)
    weights = torch.randn(rolled.x0.shape, generator=torch.Generator().manual_seed(0))
    whole = torch.autograd.grad((rolled.x0 * weights).sum(), list(p.values()))
    with torch.no_grad():
        record = sf.rollout(params["student"], batch, key, False, model=student, config=cfg)
    assert torch.equal(record.x0, rolled.x0.detach())
    by_block = sf.exit_grads(params["student"], None, record, batch, weights, model=student, config=cfg)
    for (name, _), g in zip(p.items(), whole):
        assert torch.allclose(by_block[name], g, rtol=1e-5, atol=1e-7), name


def test_the_teacher_and_critic_get_no_gradient_from_the_generator_loss(student, bidirectional, params):
    cfg = config()
    critic, teacher = trainable(params["critic"]), trainable(params["teacher"])

    def rollout(p, micro, k, with_grad):
        return sf.rollout(p, micro, k, with_grad, model=student, config=cfg)[:2]

    loss, _ = dm.generator_loss(trainable(params["student"]), make_batch(), critic, teacher, random.key(14),
                                rollout=rollout, critic=bidirectional, teacher=bidirectional, score=cfg.score())
    assert loss.requires_grad
    assert all(g is None for g in torch.autograd.grad(loss, [*critic.values(), *teacher.values()],
                                                      allow_unused=True))


@pytest.mark.parametrize("knobs", [{}, {"start_gradient_frame": 1, "student_sample_type": "ode", "grad_accum": 2}],
                         ids=["all_blocks", "from_frame_1_accumulated"])
def test_block_at_a_time_gradients_equal_the_single_graph(student, bidirectional, params, knobs):
    cfg = config(**knobs)
    roles = dm.Roles(student, bidirectional, bidirectional, cfg.optim.role(1), cfg.critic_optim.role(1))
    one = sf.student_grads(roles, cfg, block_at_a_time=False)
    by_block = sf.student_grads(roles, cfg, block_at_a_time=True)
    args = ({}, params["student"], make_batch(size=4), cfg.grad_accum, params["critic"], params["teacher"],
            random.key(15))
    (loss, aux), want = one(*args)
    (loss_b, aux_b), got = by_block(*args)
    torch.testing.assert_close(loss_b, loss, rtol=1e-6, atol=0)
    assert all(torch.equal(aux[name], aux_b[name]) for name in aux)
    assert tree.global_norm(tree.map_tensors(torch.sub, got, want)) <= 1e-6 * tree.global_norm(want)


def test_auto_takes_gradients_block_at_a_time_from_four_blocks():
    cfg = config(chunk_size=3)
    assert [sf.block_at_a_time(cfg, frames) for frames in (3, 9, 12, 21)] == [False, False, True, True]
    assert sf.block_at_a_time(config(block_gradients="on"), 1) and not sf.block_at_a_time(
        config(block_gradients="off"), 100)


def test_the_step_trains_the_student_on_its_cadence_and_the_critic_every_step(student, bidirectional, params):
    cfg = config(generator_update_interval=2, ema_decay=0.5, block_gradients="on")
    program = cfg.build({"student": student, "critic": bidirectional, "teacher": bidirectional}, total_steps=4)
    state, frozen, batch = program.init(random.key(4)), {"teacher": params["teacher"]}, make_batch()
    program.check(batch)
    for s in range(2):
        before = tree.map_tensors(torch.clone, state.roles)
        state, metrics = program.step_(state, frozen, batch)
        moved = {name: not all(torch.equal(before[name].params[n], p) for n, p in state.roles[name].params.items())
                 for name in ("student", "critic")}
        assert moved == {"student": s == 1, "critic": True}
        assert ("generator_loss" in metrics) == (s == 1) and all(torch.isfinite(v).all() for v in metrics.values())


def test_validation_streams_what_the_rollout_trains(student, bidirectional, params):
    """With every block exiting at the last step, ODE hops and no context noise, the validation sampler (the
    streaming sampler on the student's schedule) draws the rollout's clip from the same noise."""
    cfg = config(last_step_only=True, student_sample_type="ode", validate_teacher=True)
    program = cfg.build({"student": student, "critic": bidirectional, "teacher": bidirectional}, total_steps=1)
    state = program.init(random.key(4))
    state.roles["student"].params.update(params["student"])
    samplers = program.validate(state, {"teacher": params["teacher"]}, validation.ValidationConfig(num_steps=4))
    assert [s.tag for s in samplers] == ["student", "teacher"]
    batch, key = make_batch(), random.key(16)
    rolled = sf.rollout(params["student"], batch, key, False, model=student, config=cfg)
    noise_key = random.split(key, 4)[1]
    noise = torch.stack([random.normal(random.fold_in(random.fold_in(noise_key, 0), int(i)), SHAPE)
                         for i in batch["sample_index"]])
    drawn = samplers[0].draw(samplers[0].params, noise, batch["cond"], random.split(random.key(0), 2))
    torch.testing.assert_close(drawn, rolled.x0, rtol=0, atol=2e-5)


@pytest.mark.parametrize("knobs, match", [
    ({"rollout_mode": "data_latent"}, "rollout_mode must be simulate"),
    ({"enable_gradient_in_rollout": False}, "no gradient"),
    ({"context_noise": 1000.0}, "context_noise"),
    ({"denoising_steps": (250, 500)}, "strictly descending"),
    ({"critic_optim": AdamWConfig(lr=0.0)}, "critic"),
])
def test_config_errors(knobs, match):
    with pytest.raises(ValueError, match=match):
        config(**knobs)


def test_bad_students_and_clips_are_refused_before_weights_load(student, bidirectional, tmp_path):
    unloaded = WanCausalConfig(preset="tiny", num_frames_per_block=1, path=str(tmp_path / "none")).build()
    roles = {"critic": bidirectional, "teacher": bidirectional}
    with pytest.raises(ValueError, match="needs a block-causal student"):
        config().build({"student": bidirectional, **roles}, total_steps=1)
    with pytest.raises(ValueError, match="chunk_size = 2, but the student"):
        config(chunk_size=2).build({"student": unloaded, **roles}, total_steps=1)
    with pytest.raises(ValueError, match="past the last block"):
        config(latent_shape=(16, 5, 4, 4), start_gradient_frame=5).build({"student": unloaded, **roles},
                                                                         total_steps=1)
    program = config(start_gradient_frame=3).build({"student": unloaded, **roles}, total_steps=1)
    with pytest.raises(ValueError, match="start_gradient_frame = 3 is past the last block"):
        program.check(make_batch())
    program = config().build({"student": unloaded, **roles}, total_steps=1)
    batch = make_batch()
    del batch["latents"]
    with pytest.raises(ValueError, match="latent_shape"):
        program.check(batch)


def test_a_window_shorter_than_a_block_is_one_line_from_the_cli(tmp_path, capsys):
    code = run.main([EXPERIMENT, "--out", str(tmp_path / "out"), "models.student.local_attn_size=1"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "local_attn_size" in err[0], err


# --------------------------------------------------------------------------------------------- end to end


def quick(world_teacher):
    return ["run.progress=false", "data.batch_size=2", "validation.every=0", "method.generator_update_interval=2",
            "run.checkpoint.every=2", "run.checkpoint.async_save=false", f"models.student.path={world_teacher}",
            f"models.teacher.path={world_teacher}"]


@pytest.mark.slow  # three short runs of the toy world's models
def test_same_seed_is_bitwise_and_resume_is_the_uninterrupted_run(tmp_path, world_teacher):
    """4 steps twice from the CLI (student every 2nd step, EMA) are identical, and 2 steps resumed to 4 equal them:
    logged metrics and final state."""
    whole, again, resumed = tmp_path / "whole", tmp_path / "again", tmp_path / "resumed"
    for out in (whole, again):
        assert run.main([EXPERIMENT, "--out", str(out), "--steps", "4", *quick(world_teacher)]) == 0
    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "2", *quick(world_teacher)]) == 0
    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "4", "--resume", *quick(world_teacher)]) == 0
    expected, expected_state = tracking.read_scalars(whole / "tb"), final_state(whole)
    for out in (again, resumed):
        logged = tracking.read_scalars(out / "tb")
        for name in ("critic_loss", "generator_loss", "dmd_normalizer", "grad_norm/student", "update_student"):
            assert logged[name] == expected[name], (out.name, name)
        state = final_state(out)
        assert state.keys() == expected_state.keys() and any(".ema." in name for name in state)
        assert all(torch.equal(tensor, expected_state[name]) for name, tensor in state.items()), out.name


@pytest.mark.slow  # compiles the tiny student's blocks (aot_eager)
def test_a_compiled_rollout_of_seven_blocks_makes_no_new_graph_at_its_second_step(params):
    """The ring cache keeps one shape for the stream and the exits change nothing a graph depends on: the second
    rollout (other exits, other noise) reuses the first one's graphs, and both equal eager."""
    knobs = dict(preset="tiny", num_frames_per_block=1, local_attn_size=3, sink_size=1)
    eager = WanCausalConfig(**knobs).build()
    compiled = WanCausalConfig(**knobs, compile="blocks", compile_backend="aot_eager").build()
    cfg, batch = config(context_noise=100.0), make_batch()
    batch["latents"] = torch.zeros(2, 16, 7, 4, 4)
    p = trainable(params["student"])
    for attempt, key in enumerate((random.key(21), random.key(22))):
        got = sf.rollout(p, batch, key, True, model=compiled, config=cfg).x0
        want = sf.rollout(p, batch, key, True, model=eager, config=cfg).x0
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        if attempt == 0:
            graphs = compiled.kernels.compile_stats.graphs_of("blocks")
    stats = compiled.kernels.compile_stats
    assert graphs <= 2 and stats.graphs_of("blocks") == graphs and stats.recompiles == 0, stats
