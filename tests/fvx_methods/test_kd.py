"""fvx_methods.kd: the KD and causal KD losses against hand computations of spec §2.9, per-sample and per-block
draws, the build's checks, and the experiment end to end on its trajectory cache: a fixed-key eval loss falls, a
resumed run is the uninterrupted one bit for bit, and a missing, incomplete or mismatched cache is refused."""
import dataclasses
import pathlib
import types

import pytest
import torch

from fvx import run
from fvx.core import random, role
from fvx.core.optim_config import AdamWConfig
from fvx.storage import checkpoint
from fvx.training import experiment, run_folder, tracking
from fvx_methods import kd, trajectory_cache as tc
from fvx_models.model import Causal

from cli_args import merged  # noqa: E402
from run_state import final_state  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENT = str(ROOT / "experiments" / "kd_t2v.py")
T_LIST = (999, 937, 624, 0)


def make_batch(seed=0, size=3, k=len(T_LIST) - 1, frames=1):
    g = torch.Generator().manual_seed(seed)
    return {"trajectory": torch.randn(size, k, 16, frames, 4, 4, generator=g),
            "latents": torch.randn(size, 16, frames, 4, 4, generator=g), "sample_index": torch.arange(4, 4 + 3 * size, 3),
            "cond": {"text": torch.randn(size, 8, 32, generator=g), "text_mask": torch.ones(size, 8)}}


# ---------------------------------------------------------------------------------------------------- the losses


def test_kd_loss_equals_hand_computation(model, params):
    """Per sample b: i ~ randint(fold_in(key, index_b), [0, K)), t = t_list[i], x_t = trajectory[b, i],
    x0_hat = x_t - (t / 1000) student(x_t, t), loss = 0.5 mean((x0_hat - x0*)^2)."""
    batch, key = make_batch(), random.key(11)
    loss, aux = kd.loss_fn(params, batch, key, model=model, t_list=T_LIST)
    terms, drawn = [], []
    for b in range(3):
        i = int(random.randint(random.fold_in(key, int(batch["sample_index"][b])), (), 0, len(T_LIST) - 1))
        t = T_LIST[i]
        x_t = batch["trajectory"][b, i][None]
        cond = {name: c[b:b + 1] for name, c in batch["cond"].items()}
        v = model.apply(params, x_t, torch.tensor([float(t)]), cond)
        terms.append(((x_t - t / 1000 * v)[0] - batch["latents"][b]).pow(2).mean())
        drawn.append(i)
    torch.testing.assert_close(loss, 0.5 * torch.stack(terms).mean(), rtol=2e-6, atol=0)
    assert aux["step_idx"].item() == pytest.approx(sum(drawn) / 3)


def frame_stub(weight=0.5):
    """A model whose velocity reads one timestep per frame, ``v = w x + t / 1000`` (t ``[B, T]``): the causal
    loss's bookkeeping (gathers, per-frame sigma) checked without a causal family."""
    def apply(params, x_t, t, cond):
        assert t.shape == (x_t.shape[0], x_t.shape[2]), t.shape
        return params["w"] * x_t + (t / 1000)[:, None, :, None, None]

    return types.SimpleNamespace(apply=apply), {"w": torch.tensor(weight)}


def test_causal_kd_loss_equals_hand_computation():
    """One index per block of 2 frames from randint(fold_in(key, index_b), [blocks]); frame f of x_t is frame f of
    the state at t_list[idx[b, f]], sigma and t per frame."""
    stub, params = frame_stub()
    batch, key, per_block = make_batch(frames=6), random.key(5), 2
    loss, aux = kd.loss_fn(params, batch, key, model=stub, t_list=T_LIST, frames_per_block=per_block)
    expected, indices = torch.zeros(()), []
    for b in range(3):
        blocks = random.randint(random.fold_in(key, int(batch["sample_index"][b])), (3,), 0, len(T_LIST) - 1)
        for f in range(6):
            i = int(blocks[f // per_block])
            t = T_LIST[i]
            x_t = batch["trajectory"][b, i, :, f]
            v = 0.5 * x_t + t / 1000
            expected = expected + ((x_t - t / 1000 * v) - batch["latents"][b, :, f]).pow(2).sum()
        indices += blocks.tolist()
    torch.testing.assert_close(loss, 0.5 * expected / batch["latents"].numel(), rtol=2e-6, atol=0)
    assert aux["step_idx"].item() == pytest.approx(sum(indices) / len(indices))


def test_draws_are_per_sample_and_per_block():
    key, index = random.key(2), torch.tensor([3, 9, 4])
    per_sample = kd.step_indices(key, index, 4, None)
    assert per_sample.shape == (3,) and torch.equal(per_sample[1:2], kd.step_indices(key, index[1:2], 4, None))
    per_block = kd.step_indices(key, index, 4, 3)
    assert per_block.shape == (3, 3) and int(per_block.max()) < 4
    assert torch.equal(kd.frame_indices(per_block, 6), per_block.repeat_interleave(2, dim=1))
    assert torch.equal(kd.frame_indices(per_sample, 2), per_sample[:, None].expand(3, 2))


def test_loss_is_a_function_of_the_key(model, params):
    batch = make_batch()
    a, b, c = (kd.loss_fn(params, batch, random.key(s), model=model, t_list=T_LIST)[0] for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ----------------------------------------------------------------------------------------------------- the build


def build(model, method=None, **knobs):
    config = (method or kd.KD)(t_list=T_LIST, cache="unused", optim=AdamWConfig(lr=1e-3), **knobs)
    return config, config.build({"student": model, "teacher": model}, total_steps=4)


def test_a_step_updates_the_student_and_logs_its_metrics(model):
    config, program = build(model)
    state = program.init(random.key(0))
    before = {k: v.clone() for k, v in state.roles["student"].params.items()}
    state, metrics = program.step_(state, {}, make_batch())
    assert set(metrics) == {"kd_loss", "kd_step_idx", "grad_norm", "lr"} and int(state.step) == 1
    assert any(not torch.equal(state.roles["student"].params[k], before[k]) for k in before)
    (sampler,) = program.validate(state, {}, None)
    assert sampler.tag == "student" and sampler.sampler == "sde" and sampler.draw is None
    assert sampler.sigmas.tolist() == (torch.tensor(T_LIST, dtype=torch.float32) / 1000).tolist()


@pytest.mark.parametrize("knobs, message", [
    (dict(t_list=(999, 500)), "ending in 0"),
    (dict(t_list=(500, 999, 0)), "strictly descending"),
    (dict(t_list=(0,)), "strictly descending"),
    (dict(t_list=(1001, 0)), "[0, 1000]"),
    (dict(teacher_guidance_scale=3.0), "needs method.negative_prompt_path"),
    (dict(teacher_guidance_scale=float("inf"), cfg_uncond="zero"), "must be finite"),
    (dict(optim=AdamWConfig(lr=0.0)), "optim.lr > 0"),
])
def test_bad_knobs_are_named(knobs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        kd.KD(**{"t_list": T_LIST, "cache": "x", **knobs})


def test_causal_kd_needs_a_causal_student_of_its_block_size(model):
    with pytest.raises(ValueError, match="needs a block-causal student, but model wan:tiny is not one"):
        build(model, kd.KDCausal, num_frames_per_block=2)
    causal = dataclasses.replace(model, causal=Causal(frames_per_block=3, window=-1, sink=0, empty_cache=None,
                                                      apply_cached=None, apply_teacher_forced=None))
    with pytest.raises(ValueError, match="num_frames_per_block = 2, but the student wan:tiny attends in blocks of 3"):
        build(causal, kd.KDCausal, num_frames_per_block=2)
    config, program = build(causal, kd.KDCausal, num_frames_per_block=3)
    with pytest.raises(ValueError, match="latents of 4 frames do not split into blocks of"):
        program.check({**make_batch(frames=4), "sample_index": torch.arange(3)})


def test_causal_kd_trains_a_real_block_causal_student(model):
    """A block-causal Wan (blocks of 1 frame) takes the per-frame t [B, T]: the loss is one forward over the
    gathered states, and validation samples it block by block (a streaming draw)."""
    from fvx_models.wan_causal import WanCausalConfig

    causal = WanCausalConfig(preset="tiny", num_frames_per_block=1).build()
    params = causal.weights.init(random.key(3))
    batch, key = make_batch(frames=2), random.key(8)
    loss, _ = kd.loss_fn(params, batch, key, model=causal, t_list=T_LIST, frames_per_block=1)
    idx = torch.stack([random.randint(random.fold_in(key, int(i)), (2,), 0, 3) for i in batch["sample_index"]])
    x_t = torch.stack([torch.stack([batch["trajectory"][b, idx[b, f], :, f] for f in range(2)], dim=1)
                       for b in range(3)])
    t = torch.tensor(T_LIST, dtype=torch.float32)[idx]
    v = causal.apply(params, x_t, t, batch["cond"])
    expected = 0.5 * ((x_t - (t / 1000)[:, None, :, None, None] * v) - batch["latents"]).pow(2).mean()
    torch.testing.assert_close(loss, expected, rtol=2e-6, atol=0)
    _, program = build(causal, kd.KDCausal, num_frames_per_block=1)
    state, metrics = program.step_(program.init(random.key(0)), {}, batch)
    assert set(metrics) == {"kd_loss", "kd_mean_step_idx", "grad_norm", "lr"}
    (sampler,) = program.validate(state, {}, None)
    assert sampler.draw is not None


def test_bad_batches_are_named(model):
    _, program = build(model, grad_accum=2)
    with pytest.raises(ValueError, match="does not divide a rank's batch of 3"):
        program.check(make_batch())
    with pytest.raises(ValueError, match=r"expected \(3, 3, 16, 1, 4, 4\)"):
        build(model)[1].check(make_batch(k=2))


# ---------------------------------------------------------------------------------------------- end to end, cache


def tiny(teacher, cache, *extra):
    return merged(f"models.teacher.path={teacher}", f"models.student.path={teacher}", "data.world.num_samples=8",
                  "method.teacher_steps=3", "method.t_list=[999,624,0]", f"method.cache={cache}", "run.progress=false",
                  "data.batch_size=2", "data.prefetch=1", *extra)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, world_teacher):
    folder = tmp_path_factory.mktemp("kd") / "cache"
    assert tc.build(experiment.load_config(EXPERIMENT, tiny(world_teacher, folder)), batch=4).complete
    return folder


def test_the_experiment_lowers_a_fixed_key_eval_loss_and_validates(tmp_path, world_teacher, cache):
    out = tmp_path / "run"
    args = [EXPERIMENT, *tiny(world_teacher, cache), "--out", str(out), "--steps", "30", "method.optim.lr=1e-3",
            "validation.every=30", "validation.num_prompts=2", "run.checkpoint.async_save=false"]
    config = run.resolve_config(run.parse_args(args))
    built = experiment.setup(config)
    student = built.models["student"]
    batch = built.program.model.batch({**built.dataset.read(list(range(8))), "sample_index": torch.arange(8)})

    def eval_loss(params):
        with torch.no_grad():
            return kd.loss_fn(params, batch, random.key(123), model=student, t_list=config.method.t_list)[0].item()

    start = eval_loss(experiment.initial_state(built, batch).roles["student"].params)
    assert run.main(args) == 0
    with checkpoint.Checkpoints(out / run_folder.CHECKPOINTS) as saved:
        final = saved.restore(saved.latest(), experiment.initial_state(built, batch))
    assert eval_loss(final.roles["student"].params) < 0.7 * start
    scalars = tracking.read_scalars(out / "tb")
    assert {"kd_loss", "kd_step_idx", "grad_norm", "lr"} <= set(scalars)
    assert [s for s, _ in scalars["validation/student/nearest_mse"]] == [0, 30]  # the toy world's score, forwarded


def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit(tmp_path, world_teacher, cache):
    quick = [*tiny(world_teacher, cache), "validation.every=0", "run.checkpoint.every=3",
             "run.checkpoint.async_save=false"]

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run.main([EXPERIMENT, "--out", str(whole), "--steps", "6", *quick]) == 0
    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "3", *quick]) == 0
    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "6", "--resume", *quick]) == 0
    logged, expected = tracking.read_scalars(resumed / "tb"), tracking.read_scalars(whole / "tb")
    for name in ("kd_loss", "kd_step_idx", "grad_norm"):
        assert logged[name] == expected[name], name
    assert [step for step, _ in logged["kd_loss"]] == list(range(6))
    state, expected_state = final_state(resumed), final_state(whole)
    assert state.keys() == expected_state.keys()
    assert all(torch.equal(tensor, expected_state[name]) for name, tensor in state.items())


def copy_cache(cache, folder):
    for path in cache.rglob("*"):
        if path.is_file():
            (folder / path.relative_to(cache)).parent.mkdir(parents=True, exist_ok=True)
            (folder / path.relative_to(cache)).write_bytes(path.read_bytes())
    return folder


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist; build it first with: python -m fvx_methods.trajectory_cache EXPERIMENT.py"),
    ("incomplete", "is incomplete (7 of 8 samples); finish it with: python -m fvx_methods.trajectory_cache"),
    ("method.t_list=[999,500,0]", "holds states at t = [999, 624], but method.t_list needs t = [500] too"),
    ("method.teacher_steps=4", "was built for another run: teacher_steps: the cache has 3, this run 4"),
    ("data.world.speed=1", "was built for another run: data.rows_sha256"),
    ("other_teacher", "was built for another run: teacher.id"),
])
def test_training_refuses_a_cache_it_cannot_use_in_one_line(tmp_path, world_teacher, cache, capsys, case, message):
    folder, extra, teacher = copy_cache(cache, tmp_path / "cache"), [], world_teacher
    if case == "missing":
        folder = tmp_path / "nothing"
    elif case == "incomplete":
        (folder / tc.COMPLETE).unlink()
        tc.sample_path(folder, 3).unlink()
    elif case == "other_teacher":
        teacher = tmp_path / "same_weights_elsewhere"
        teacher.symlink_to(world_teacher)
    else:
        extra = [case]
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, *tiny(teacher, folder, *extra), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fvx.run: error:") and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_a_subset_of_the_cached_times_trains(tmp_path, world_teacher, cache):
    """A one-step run (t_list [999, 0]) reads the 999 states of a cache built for [999, 624, 0]."""
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, *tiny(world_teacher, cache, "method.t_list=[999,0]"), "--out", str(out),
                     "--steps", "1", "validation.every=0"]) == 0
    assert tracking.read_scalars(out / "tb")["kd_step_idx"] == [(0, 0.0)]


def test_the_teacher_is_never_loaded_for_training(model):
    """The teacher's model only identifies the cache: no frozen role holds its params."""
    _, program = build(model)
    assert program.frozen(random.key(0)) == {}
    assert role.frozen_params(random.key(0), {"student": (model, False)}) == {}
