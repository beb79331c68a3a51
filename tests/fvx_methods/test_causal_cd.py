"""fvx_methods.causal_cd: the loss against a hand computation of spec §2.10 (a causal and a bidirectional teacher),
gradients reaching only the student, the EMA target's blend from the initial weights, one-line refusals of bad
input before any weight loads, and the experiment end to end (runs from the CLI, same seed bit for bit, a resumed run
equal to the uninterrupted one, 2 processes logging what one does)."""
import dataclasses
import math
import pathlib

import pytest
import torch

from fvx import run
from fvx.core import random
from fvx.core.optim_config import AdamWConfig
from fvx.training import tracking
from fvx_methods import causal_cd
from fvx_models import streaming
from fvx_models.wan import WanConfig
from fvx_models.wan_causal import WanCausalConfig

from cli_args import merged  # noqa: E402
from run_state import final_state  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENT = str(ROOT / "experiments" / "causal_cd_t2v.py")
N, SHIFT, GUIDANCE = 6, 5.0, 2.5


@pytest.fixture(scope="module")
def causal():
    return WanCausalConfig(preset="tiny", num_frames_per_block=1).build()


@pytest.fixture(scope="module")
def bidirectional():
    return WanConfig(preset="tiny").build()


def make_batch(seed=0, size=3, frames=2):
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(size, 16, frames, 4, 4, generator=g),
            "sample_index": torch.arange(5, 5 + 2 * size, 2),
            "cond": {"text": torch.randn(size, 8, 32, generator=g), "text_mask": torch.ones(size, 8)}}


def method(**knobs):
    defaults = dict(discrete_steps=N, flow_shift=SHIFT, guidance_scale=GUIDANCE, cfg_uncond="zero", ema_start_step=0,
                    optim=AdamWConfig(lr=1e-3))
    return causal_cd.CausalCD(**{**defaults, **knobs})


# ---------------------------------------------------------------------------------------------------------- the loss


def hand_loss(student, teacher, params, ema_params, teacher_params, batch, key, config):
    """Spec §2.10 written out sample by sample: FastVideo's grid in float64, draws from fold_in(key, index)."""
    n, shift, g = config.discrete_steps, config.flow_shift, config.guidance_scale
    u = [1.0 - i / n for i in range(n)]
    sigma = [shift * x / (1 + (shift - 1) * x) for x in u]
    total = 0.0
    for b in range(len(batch["sample_index"])):
        noise_key, index_key = random.split(random.fold_in(key, int(batch["sample_index"][b])))
        x0 = batch["latents"][b:b + 1]
        eps = random.normal(noise_key, x0.shape[1:])[None]
        j = int(random.randint(index_key, (), 0, n - 1))
        s, s_next = sigma[j], sigma[j + 1]
        t = torch.full((1, x0.shape[2]), 1000 * s)
        t_next = torch.full((1, x0.shape[2]), 1000 * s_next)
        cond = {k: c[b:b + 1] for k, c in batch["cond"].items()}
        zero = {"text": torch.zeros_like(cond["text"]), "text_mask": cond["text_mask"]}
        x_t = (1 - s) * x0 + s * eps

        def forced(model, p, x, at, c):
            if model.causal is None:
                return model.apply(p, x, at[:, 0], c)
            return model.causal.apply_teacher_forced(p, x, at, c, clean=x0)

        with torch.no_grad():
            v_c, v_u = forced(teacher, teacher_params, x_t, t, cond), forced(teacher, teacher_params, x_t, t, zero)
            x_next = x_t - (1000 * s - 1000 * s_next) / 1000 * (v_u + g * (v_c - v_u))
            x0_ema = x_next - s_next * forced(student, ema_params, x_next, t_next, cond)
        x0_student = x_t - s * forced(student, params, x_t, t, cond)
        total = total + ((x0_student - x0_ema) ** 2).sum()
    return total / batch["latents"].numel()


@pytest.mark.parametrize("teacher_kind", ["causal", "bidirectional"])
def test_loss_equals_hand_computation(causal, bidirectional, teacher_kind):
    teacher = causal if teacher_kind == "causal" else bidirectional
    models = ((causal, 1), (causal, 2), (teacher, 3))
    params, ema_params, teacher_params = (m.weights.init(random.key(s)) for m, s in models)
    config, batch, key = method(), make_batch(), random.key(4)
    loss, aux = causal_cd.loss_fn(params, batch, key, ema_params=ema_params, teacher_params=teacher_params,
                                  student=causal, teacher=teacher, config=config)
    want = hand_loss(causal, teacher, params, ema_params, teacher_params, batch, key, config)
    torch.testing.assert_close(loss, want.float(), rtol=2e-5, atol=0)
    assert 0 < float(aux["sigma"]) <= 1


def test_guidance_one_skips_the_unconditional_call(causal):
    calls = []

    def counting(p, x_t, t, cond, clean):
        calls.append(cond["text"].abs().sum().item())
        return causal.causal.apply_teacher_forced(p, x_t, t, cond, clean=clean)

    teacher = dataclasses.replace(causal, causal=dataclasses.replace(causal.causal, apply_teacher_forced=counting))
    params = causal.weights.init(random.key(1))
    causal_cd.loss_fn(params, make_batch(), random.key(0), ema_params=params, teacher_params=params, student=causal,
                      teacher=teacher, config=method(guidance_scale=1.0))
    assert len(calls) == 1 and calls[0] > 0


def test_gradients_reach_only_the_student(causal):
    params, ema_params, teacher_params = (causal.weights.init(random.key(s)) for s in (1, 2, 3))
    leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in (params, ema_params, teacher_params)]
    loss, _ = causal_cd.loss_fn(leaves[0], make_batch(), random.key(4), ema_params=leaves[1],
                                teacher_params=leaves[2], student=causal, teacher=causal, config=method())
    grads = torch.autograd.grad(loss, [t for p in leaves for t in p.values()], allow_unused=True)
    count = len(params)
    assert all(g is not None for g in grads[:count]) and sum(float(g.abs().sum()) for g in grads[:count]) > 0
    assert all(g is None for g in grads[count:])


def test_the_draws_are_per_sample():
    """A sample's level and noise come from its global index, whatever batch it is in."""
    key, index = random.key(3), torch.tensor([4, 9, 2])
    noise, j = causal_cd.draws(key, index, (2, 1, 1), N, torch.device("cpu"))
    alone, j_alone = causal_cd.draws(key, index[1:2], (2, 1, 1), N, torch.device("cpu"))
    assert torch.equal(noise[1:2], alone) and torch.equal(j[1:2], j_alone) and 0 <= int(j.min()) <= int(j.max()) < N - 1


# -------------------------------------------------------------------------------------------------------- the step


def build(student, teacher, ema_model=None, **knobs):
    models = {"student": student, "teacher": teacher, "ema": student if ema_model is None else ema_model}
    return method(**knobs).build(models, total_steps=5)


def snapshot(tree_):
    return {k: v.clone() for k, v in tree_.items()}


def test_a_step_trains_the_student_blends_its_ema_and_leaves_the_teacher(causal):
    """Three steps with ``ema_start_step`` 2: the EMA is the initial weights after update 1, then ``d ema + (1 - d)
    params`` after updates 2 and 3 (FastVideo's ``it >= ema_start_step``, ``it = step + 1``)."""
    decay = 0.75
    program = build(causal, causal, ema_decay=decay, ema_start_step=2)
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    teacher = snapshot(frozen["teacher"])
    expected = snapshot(state.roles["student"].params)
    assert set(frozen) == {"teacher"}
    assert all(torch.equal(state.roles["student"].ema[k], v) for k, v in expected.items())
    for step in range(3):
        state, metrics = program.step_(state, frozen, make_batch(step))
        assert set(metrics) == {"causal_cd_loss", "grad_norm", "lr"} and float(metrics["grad_norm"]) > 0
        if step + 1 >= 2:
            expected = {k: torch.lerp(v, state.roles["student"].params[k], 1 - decay) for k, v in expected.items()}
        assert all(torch.equal(state.roles["student"].ema[k], v) for k, v in expected.items()), step
    assert all(torch.equal(frozen["teacher"][k], v) for k, v in teacher.items())
    student = state.roles["student"]
    assert not torch.equal(student.ema["proj_out.weight"], student.params["proj_out.weight"])


def test_the_loss_reads_the_ema_and_teacher_the_step_is_given(causal):
    """The program's step is the pure loss with the EMA from the state and the teacher from the frozen params."""
    program = build(causal, causal)
    state, frozen, batch = program.init(random.key(0)), program.frozen(random.key(0)), make_batch()
    student = state.roles["student"]
    want, _ = causal_cd.loss_fn(student.params, batch, random.fold_in(state.key, 0), ema_params=student.ema,
                                teacher_params=frozen["teacher"], student=causal, teacher=causal, config=method())
    _, metrics = program.step_(state, frozen, batch)
    assert torch.equal(metrics["causal_cd_loss"], want)


def test_same_seed_same_steps_bit_for_bit(causal):
    def three_steps():
        program = build(causal, causal)
        state, frozen, logged = program.init(random.key(9)), program.frozen(random.key(9)), []
        for step in range(3):
            state, metrics = program.step_(state, frozen, make_batch(step))
            logged.append({k: v.clone() for k, v in metrics.items()})
        return state, logged

    (a, la), (b, lb) = three_steps(), three_steps()
    assert all(torch.equal(x[k], y[k]) for x, y in zip(la, lb) for k in x)
    for part in ("params", "ema"):
        x, y = getattr(a.roles["student"], part), getattr(b.roles["student"], part)
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_an_ema_model_of_the_students_architecture_starts_the_ema(causal):
    other = WanCausalConfig(preset="tiny", num_frames_per_block=2).build()
    program = build(causal, causal, ema_model=other)
    state = program.init(random.key(0))
    assert state.roles["student"].ema is not state.roles["student"].params
    assert all(torch.equal(state.roles["student"].ema[k], v) for k, v in state.roles["student"].params.items())


def test_validation_streams_the_ema_few_step_and_the_dry_run_rows(causal):
    program = build(causal, causal, sampling_steps=3, sampler="sde")
    state = program.init(random.key(0))
    (sampler,) = program.validate(state, {}, None)
    sigmas = causal_cd.flow.self_forcing_sigmas(SHIFT, 3)
    assert sampler.tag == "student_ema" and sampler.params is state.roles["student"].ema and not sampler.guided
    assert torch.equal(torch.as_tensor(sampler.sigmas), sigmas) and sampler.sampler == "sde"
    noise, cond = torch.randn(1, 16, 2, 4, 4), {k: v[:1] for k, v in make_batch()["cond"].items()}
    with torch.no_grad():
        drawn = sampler.draw(sampler.params, noise, cond, random.key(1))
        expected = streaming.sample(causal.causal, sampler.params, noise, sigmas, cond, random.key(1), sampler="sde")
    assert torch.equal(drawn, expected)
    assert [(r.name, r.trainable, r.ema) for r in method().held_roles()] == [("student", True, True),
                                                                            ("teacher", False, False)]
    record = method(sampling_steps=3).sampling("student")
    assert record["sigmas"] == sigmas.tolist() and record["sampler"].startswith("sde")


# ------------------------------------------------------------------------------------------------------ bad input


def one_line(error):
    assert "\n" not in str(error.value)
    return str(error.value)


def test_the_build_refuses_a_student_that_is_not_causal_or_not_global(causal, bidirectional):
    with pytest.raises(ValueError, match=r"causal CD trains a block-causal student, but models.student "
                                         r"\(wan:tiny\) is not causal") as error:
        build(bidirectional, causal)
    one_line(error)
    windowed = WanCausalConfig(preset="tiny", num_frames_per_block=1, local_attn_size=2).build()
    for student, teacher, name in ((windowed, causal, "student"), (causal, windowed, "teacher")):
        with pytest.raises(ValueError, match=rf"needs global attention, but models.{name} \(wan_causal:tiny\) "
                                             r"attends to a window of 2 frames") as error:
            build(student, teacher)
        one_line(error)


def test_the_build_refuses_an_ema_model_of_another_architecture(causal, bidirectional):
    with pytest.raises(ValueError, match=r"method.roles.ema = 'student' is a wan:tiny model, but the EMA lives in "
                                         r"the student's state") as error:
        build(causal, causal, ema_model=bidirectional)
    one_line(error)
    deeper = WanCausalConfig(preset="tiny-deep", num_frames_per_block=1).build()
    with pytest.raises(ValueError, match=r"\(wan_causal:tiny-deep\) trains other params than the student "
                                         r"\(wan_causal:tiny\): blocks.0.attn1.norm_k.weight is \(144,\) there and "
                                         r"\(96,\) in the student") as error:
        build(causal, causal, ema_model=deeper)
    one_line(error)


def test_the_batch_check_refuses_latents_that_are_not_whole_blocks(causal):
    two = WanCausalConfig(preset="tiny", num_frames_per_block=2).build()
    check = build(two, causal).check
    check(make_batch(frames=4))
    with pytest.raises(ValueError, match=r"batch latents have 3 latent frames, not whole blocks of models.student's "
                                         r"num_frames_per_block = 2") as error:
        check(make_batch(frames=3))
    one_line(error)
    with pytest.raises(ValueError, match="method.grad_accum = 2 does not divide a rank's batch of 3"):
        build(two, causal, grad_accum=2).check(make_batch(frames=2))


@pytest.mark.parametrize("knobs, message", [
    (dict(discrete_steps=1), "method.discrete_steps (FastVideo's discrete_cd_N) must be an int >= 2, got 1"),
    (dict(ema_decay=None), "method.ema_decay must lie in (0, 1]"),
    (dict(ema_decay=0.0), "method.ema_decay must lie in (0, 1]"),
    (dict(ema_decay=1.5), "EMA decay must lie in [0, 1]"),
    (dict(guidance_scale=3.0, cfg_uncond="negative_prompt"), "needs method.negative_prompt_path"),
    (dict(guidance_scale=math.inf), "method.guidance_scale must be finite"),
    (dict(optim=AdamWConfig(lr=0.0)), "causal CD needs optim.lr > 0"),
])
def test_bad_knobs_are_one_line_naming_them(knobs, message):
    with pytest.raises(ValueError) as error:
        method(**knobs)
    assert message in one_line(error)


# -------------------------------------------------------------------------------------------- the experiment, CLI


def tiny(teacher, *extra):
    """The toy experiment cut to seconds: the session's random world teacher (student, teacher and EMA from it),
    in blocks of 2 frames (2 per clip: teacher forcing reads a clean block), 2 samples."""
    return merged(f"models.student.path={teacher}", "models.student.num_frames_per_block=2", "data.batch_size=2",
                  "data.prefetch=0", "run.progress=false", "validation.every=0", "run.checkpoint.async_save=false",
                  "method.ema_start_step=2", *extra)


def test_the_experiment_runs_from_the_cli_and_validates(tmp_path, world_teacher):
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, *tiny(world_teacher, "validation.every=2", "validation.num_prompts=2"), "--out",
                     str(out), "run.steps=2"]) == 0
    scalars = tracking.read_scalars(out / "tb")
    assert {"causal_cd_loss", "grad_norm", "lr"} <= set(scalars) and len(scalars["causal_cd_loss"]) == 2
    assert [s for s, _ in scalars["validation/student_ema/nearest_mse"]] == [0, 2]
    state = final_state(out)
    assert any(name.startswith("roles.student.ema") or ".ema." in name for name in state), list(state)[:5]


def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit(tmp_path, world_teacher):
    """4 steps in one go against 2, then --resume to 4; the EMA starts blending at update 2, before the checkpoint."""
    quick = tiny(world_teacher, "run.checkpoint.every=2")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run.main([EXPERIMENT, "--out", str(whole), "--steps", "4", *quick]) == 0
    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "2", *quick]) == 0
    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "4", "--resume", *quick]) == 0
    logged, expected = tracking.read_scalars(resumed / "tb"), tracking.read_scalars(whole / "tb")
    for name in ("causal_cd_loss", "grad_norm", "lr"):
        assert [s for s, _ in logged[name]] == [0, 1, 2, 3] and logged[name] == expected[name], name
    state, expected_state = final_state(resumed), final_state(whole)
    assert state.keys() == expected_state.keys()
    assert all(torch.equal(tensor, expected_state[name]) for name, tensor in state.items())


@pytest.mark.parametrize("case, message", [
    (("models.student=wan", "models.student.preset=world"),
     "causal CD trains a block-causal student, but models.student (wan:world) is not causal"),
    (("models.student.local_attn_size=2",), "needs global attention, but models.student (wan_causal:world) attends"),
    (("models.teacher=wan", "models.teacher.preset=world", "method.roles.teacher=teacher", "method.roles.ema=teacher"),
     "method.roles.ema = 'teacher' is a wan:world model, but the EMA lives in"),
    (("method.discrete_steps=1",), "override 'method.discrete_steps=1': Expected `int` >= 2"),
    (("data.world.frames=3",), "batch latents have 3 latent frames, not whole blocks of models.student's"),
], ids=["bidirectional_student", "windowed_student", "ema_of_another_family", "one_level", "part_of_a_block"])
def test_bad_input_is_one_line_before_any_weight_loads(tmp_path, capsys, case, message):
    """Exit 2 with one line, before the models' folders are read (they do not exist) and before anything is
    written."""
    missing = tmp_path / "no_such_folder"
    out = tmp_path / "run"
    args = merged(*tiny(missing, *case), f"models.student.path={missing}")  # a tag switch resets the path
    assert run.main([EXPERIMENT, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fvx.run: error:") and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.slow  # 2 + 1 processes
def test_two_processes_log_what_one_process_logs(tmp_path, world_teacher):
    from gloo import launch1, launch2

    paths = (f"models.student.path={world_teacher}", "models.student.num_frames_per_block=2", "method.ema_start_step=2")
    launch2(tmp_path / "two", *paths, experiment=EXPERIMENT)
    launch1(tmp_path / "one", *paths, experiment=EXPERIMENT)
    two, one = (tracking.read_scalars(tmp_path / name / "tb") for name in ("two", "one"))
    for name in ("causal_cd_loss", "grad_norm"):
        assert [s for s, _ in two[name]] == [s for s, _ in one[name]] == [0, 1, 2], name
        for (_, got), (_, want) in zip(two[name], one[name]):
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-8), (name, two[name], one[name])
