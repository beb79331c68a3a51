"""fvx_methods.dfsft: the DFSFT and TFSFT losses against hand computations of spec §2.2 and §2.3, the build's and
the batch check's errors, streaming validation, and both experiments end to end (learning, bitwise resume)."""
import dataclasses
import math
import pathlib

import pytest
import torch

from fvx import run
from fvx.core import random, role
from fvx.core.optim_config import AdamWConfig
from fvx.training import experiment, tracking, validation
from fvx_methods import dfsft
from fvx_models import streaming
from fvx_models.model import Causal
from fvx_models.wan import WanConfig
from fvx_models.wan_causal import WanCausalConfig

from run_state import final_state  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]

SHIFT = 3.0
CHUNK = 2


# ------------------------------------------------------------------------------------------------ a stand-in model


@pytest.fixture(scope="module")
def bidirectional():
    return WanConfig(preset="tiny").build()


@pytest.fixture(scope="module")
def params(bidirectional):
    return bidirectional.weights.init(random.key(7))


def stand_in(base, *, frames_per_block=CHUNK, window=-1):
    """A block-causal stand-in on the tiny Wan: its velocity at each sample's mean timestep, scaled frame by frame by
    that frame's own timestep (so per-frame timesteps matter); teacher forcing adds half the clean latents to the
    input (so the clean history matters). The loss must not care what the model is; the real one is tested below."""
    def scale(t):
        return (1 + t / 1000)[:, None, :, None, None]

    def apply(p, x_t, t, cond):
        return base.apply(p, x_t, t.mean(1), cond) * scale(t)

    def forced(p, x_t, t, cond, clean):
        return base.apply(p, x_t + 0.5 * clean, t.mean(1), cond) * scale(t)

    return dataclasses.replace(base, apply=apply,
                               causal=Causal(frames_per_block, window, 0, lambda batch: None, None, forced))


@pytest.fixture(scope="module")
def model(bidirectional):
    return stand_in(bidirectional)


def make_batch(seed=0, size=2, frames=4):
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(size, 16, frames, 4, 4, generator=g),
            "sample_index": torch.arange(3, 3 + 5 * size, 5),
            "cond": {"text": torch.randn(size, 8, 32, generator=g), "text_mask": torch.ones(size, 8)}}


# -------------------------------------------------------------------------------------------- the hand computation


def hand_range(min_ratio, max_ratio):
    """Spec §2.2's index range, written out."""
    lo, hi = int(min_ratio * 1000), int(max_ratio * 1000)
    lo, hi = min(max(lo, 0), 999), min(max(hi, 0), 999)
    if hi <= lo:
        hi = min(999, lo + 1)
    return lo, hi


def hand_weight(index):
    """Spec §2.2's weight table at one index, in float64."""
    y = [math.exp(-2 * ((x - 500) / 1000) ** 2) for x in range(1000)]
    low = min(y)
    return (y[index] - low) * 1000 / sum(v - low for v in y)


def hand_sigma(index):
    u = (1000 - index) / 1000
    return SHIFT * u / (1 + (SHIFT - 1) * u)


def hand_loss(model, params, batch, key, config):
    """Sample by sample and frame by frame: the keys of fold_in(key, sample index), one index per chunk repeated
    over its frames, the noising, one forward of the sample, the weighted per-frame losses, their mean."""
    x0 = batch["latents"]
    frames = x0.shape[2]
    lo, hi = hand_range(config.min_timestep_ratio, config.max_timestep_ratio)
    terms = []
    for b in range(x0.shape[0]):
        noise_key, t_key = random.split(random.fold_in(key, int(batch["sample_index"][b])))
        noise = random.normal(noise_key, x0.shape[1:])
        chunks = random.randint(t_key, (frames // config.chunk_size,), lo, hi + 1).tolist()
        index = [chunks[f // config.chunk_size] for f in range(frames)]
        sigma = [hand_sigma(i) for i in index]
        s = torch.tensor(sigma, dtype=torch.float32).view(1, frames, 1, 1)
        x_t = (1 - s) * x0[b] + s * noise
        t = torch.tensor([[1000 * v for v in sigma]], dtype=torch.float32)
        cond = {name: c[b:b + 1] for name, c in batch["cond"].items()}
        if config.teacher_forcing:
            v = model.causal.apply_teacher_forced(params, x_t[None], t, cond, clean=x0[b:b + 1])[0]
        else:
            v = model.apply(params, x_t[None], t, cond)[0]
        for f in range(frames):
            if config.precondition_outputs:
                residual = x_t[:, f] - sigma[f] * v[:, f] - x0[b, :, f]
            else:
                residual = v[:, f] - (noise[:, f] - x0[b, :, f])
            terms.append(residual.pow(2).mean() * hand_weight(index[f]))
    return torch.stack(terms).mean()


@pytest.mark.parametrize("lo, hi, expected", [
    (0.0, 1.0, (0, 999)), (0.5, 0.5, (500, 501)), (1.0, 1.0, (999, 999)), (0.0, 0.0005, (0, 1)),
    (0.0295, 0.0299, (29, 30)), (0.02, 0.98, (20, 980)), (0.999, 1.0, (999, 999)), (0.3, 0.9999, (300, 999)),
])
def test_index_range_follows_the_spec_at_its_edges(lo, hi, expected):
    assert dfsft.index_range(lo, hi) == expected == hand_range(lo, hi)


def test_weight_table_is_the_flat_gaussian_over_indices():
    w = dfsft.index_weights()
    assert w.shape == (1000,) and w.dtype == torch.float32
    expected = torch.tensor([hand_weight(i) for i in range(1000)], dtype=torch.float64)
    torch.testing.assert_close(w.double(), expected, rtol=1e-5, atol=1e-6)
    assert w[0] == 0 and int(w.argmax()) == 500 and w.mean().item() == pytest.approx(1.0, rel=1e-6)


def test_chunk_indices_repeat_one_draw_per_chunk_and_cover_the_inclusive_range():
    keys = random.fold_in(random.key(1), torch.arange(64))
    idx = dfsft.chunk_indices(keys, 6, 3, 500, 501)
    assert idx.shape == (64, 6) and set(idx.unique().tolist()) == {500, 501}
    assert torch.equal(idx[:, :3], idx[:, :1].expand(64, 3)) and torch.equal(idx[:, 3:], idx[:, 3:4].expand(64, 3))
    assert torch.equal(idx[5, ::3], random.randint(keys[5], (2,), 500, 502))
    assert not torch.equal(idx[:, 0], idx[:, 3])  # chunks draw independently


@pytest.mark.parametrize("precondition", [False, True], ids=["velocity", "precondition"])
@pytest.mark.parametrize("teacher_forcing", [False, True], ids=["dfsft", "tfsft"])
@pytest.mark.parametrize("ratios", [(0.0, 1.0), (0.3, 0.7), (0.5, 0.5)], ids=["full", "window", "two"])
def test_loss_equals_hand_computation(model, params, precondition, teacher_forcing, ratios):
    config = dfsft.DFSFT(chunk_size=CHUNK, min_timestep_ratio=ratios[0], max_timestep_ratio=ratios[1],
                         precondition_outputs=precondition, teacher_forcing=teacher_forcing, flow_shift=SHIFT)
    batch, key = make_batch(), random.key(11)
    loss, aux = dfsft.loss_fn(params, batch, key, model=model, config=config)
    torch.testing.assert_close(loss, hand_loss(model, params, batch, key, config), rtol=1e-5, atol=0)
    assert aux["sigma"].shape == ()


def test_teacher_forcing_changes_the_loss_and_the_loss_is_a_function_of_the_key(model, params):
    batch = make_batch()
    dfs, tfs = dfsft.DFSFT(chunk_size=CHUNK), dfsft.DFSFT(chunk_size=CHUNK, teacher_forcing=True)
    a = dfsft.loss_fn(params, batch, random.key(1), model=model, config=dfs)[0]
    assert torch.equal(a, dfsft.loss_fn(params, batch, random.key(1), model=model, config=dfs)[0])
    assert not torch.equal(a, dfsft.loss_fn(params, batch, random.key(2), model=model, config=dfs)[0])
    assert not torch.equal(a, dfsft.loss_fn(params, batch, random.key(1), model=model, config=tfs)[0])


def test_per_sample_draws_do_not_depend_on_batch_composition(model, params):
    config, batch, key = dfsft.DFSFT(chunk_size=CHUNK), make_batch(size=4), random.key(3)
    whole = dfsft.loss_fn(params, batch, key, model=model, config=config)[0]
    halves = [dfsft.loss_fn(params, mb, key, model=model, config=config)[0] for mb in role.micro_batches(batch, 2)]
    torch.testing.assert_close(whole, torch.stack(halves).mean(), rtol=1e-6, atol=0)


def test_step_trains_the_student_and_reports_its_metrics(model):
    program = dfsft.DFSFT(chunk_size=CHUNK, optim=AdamWConfig(lr=1e-3)).build({"student": model}, total_steps=4)
    state = program.init(random.key(0))
    before = {k: v.clone() for k, v in state.roles["student"].params.items()}
    state, metrics = program.step_(state, {}, make_batch())
    assert int(state.step) == 1 and set(metrics) == {"loss", "grad_norm", "lr"} and metrics["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in state.roles["student"].params.items())


# ------------------------------------------------------------------------------------------------- build and check


def test_build_refuses_a_student_that_is_not_causal(bidirectional):
    with pytest.raises(ValueError, match=r"DFSFT trains a block-causal model, but models.student \(wan:tiny\) is "
                                         r"not causal") as error:
        dfsft.DFSFT(chunk_size=CHUNK).build({"student": bidirectional}, total_steps=1)
    assert "\n" not in str(error.value)


def test_build_refuses_a_chunk_that_is_not_the_students_block(bidirectional):
    with pytest.raises(ValueError, match=r"method.chunk_size = 3 must equal the block size of models.student "
                                         r"\(wan:tiny\), frames_per_block = 2") as error:
        dfsft.DFSFT(chunk_size=3).build({"student": stand_in(bidirectional)}, total_steps=1)
    assert "\n" not in str(error.value)


def test_teacher_forcing_refuses_a_windowed_student_and_diffusion_forcing_takes_it(bidirectional):
    windowed = stand_in(bidirectional, window=4)
    with pytest.raises(ValueError, match=r"method.teacher_forcing needs a model attending to all earlier blocks, "
                                         r"but models.student \(wan:tiny\) attends to a window of 4 frames"):
        dfsft.DFSFT(chunk_size=CHUNK, teacher_forcing=True).build({"student": windowed}, total_steps=1)
    dfsft.DFSFT(chunk_size=CHUNK).build({"student": windowed}, total_steps=1)


def test_check_refuses_latents_that_are_not_whole_chunks(model):
    check = dfsft.DFSFT(chunk_size=CHUNK).build({"student": model}, total_steps=1).check
    check(make_batch(frames=4))
    with pytest.raises(ValueError, match=r"batch latents have 5 latent frames, not a whole number of "
                                         r"method.chunk_size = 2 frames: FastVideo's training mask would end on a "
                                         r"short block, frames \[4, 5\) \(its Self-Forcing rollout puts the "
                                         r"remainder first, its causal sampler refuses it\), fvx requires "
                                         r"frames % chunk_size == 0 "
                                         r"\(e.g. data.num_latent_t = 4\)") as error:
        check(make_batch(frames=5))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="fine-tuning needs latents"):
        check({k: v for k, v in make_batch().items() if k != "latents"})
    with pytest.raises(ValueError, match="method.grad_accum = 3 does not divide a rank's batch of 2"):
        dfsft.DFSFT(chunk_size=CHUNK, grad_accum=3).build({"student": model}, total_steps=1).check(make_batch())


@pytest.mark.parametrize("knobs, message", [
    ({"min_timestep_ratio": 0.6, "max_timestep_ratio": 0.4},
     "method.max_timestep_ratio = 0.4 is below method.min_timestep_ratio = 0.6"),
    ({"max_timestep_ratio": 1.5}, "method.max_timestep_ratio = 1.5 must lie in [0, 1]"),
    ({"chunk_size": 0}, "method.chunk_size must be an int >= 1, got 0"),
    ({"chunk_size": True}, "method.chunk_size must be an int >= 1, got True"),
    ({"optim": AdamWConfig(lr=0.0)}, "DFSFT needs optim.lr > 0"),
    ({"optim": AdamWConfig(lr=0.0), "teacher_forcing": True}, "TFSFT (teacher_forcing) needs optim.lr > 0"),
])
def test_bad_knobs_are_one_line_naming_them(knobs, message):
    with pytest.raises(ValueError) as error:
        dfsft.DFSFT(**knobs)
    assert message in str(error.value) and "\n" not in str(error.value)


# -------------------------------------------------------------------------------------------- the real causal model


@pytest.fixture(scope="module")
def causal():
    return WanCausalConfig(preset="tiny", num_frames_per_block=CHUNK).build()


@pytest.mark.parametrize("teacher_forcing", [False, True], ids=["dfsft", "tfsft"])
def test_loss_of_the_causal_wan_equals_hand_computation(causal, teacher_forcing):
    params = causal.weights.init(random.key(5))
    config = dfsft.DFSFT(chunk_size=CHUNK, teacher_forcing=teacher_forcing, min_timestep_ratio=0.2)
    batch, key = make_batch(frames=6), random.key(4)
    loss, _ = dfsft.loss_fn(params, batch, key, model=causal, config=config)
    torch.testing.assert_close(loss, hand_loss(causal, params, batch, key, config), rtol=1e-5, atol=0)


def test_validation_streams_the_student_block_by_block(causal):
    program = dfsft.DFSFT(chunk_size=CHUNK, ema_decay=0.9).build({"student": causal}, total_steps=2)
    state = program.init(random.key(0))
    config = validation.ValidationConfig(num_steps=3, flow_shift=5.0)
    (sampler,) = program.validate(state, {}, config)
    assert sampler.tag == "model_ema" and sampler.params is state.roles["student"].ema and sampler.guided
    sigmas = validation.many_step_sigmas(3, 5.0)
    assert torch.equal(torch.as_tensor(sampler.sigmas), sigmas)
    noise, cond = torch.randn(1, 16, 4, 4, 4), {k: v[:1] for k, v in make_batch()["cond"].items()}
    with torch.no_grad():
        drawn = sampler.draw(sampler.params, noise, cond, random.key(1))
        expected = streaming.sample(causal.causal, sampler.params, noise, sigmas, cond, random.key(1))
    assert torch.equal(drawn, expected)


# ------------------------------------------------------------------------------------------------- the experiments


EXPERIMENTS = ["dfsft_causal_t2v.py", "tfsft_causal_t2v.py"]
QUICK = ["run.progress=false", "data.batch_size=4", "data.prefetch=0", "method.optim.warmup_steps=1",
         "validation.every=0"]


def experiment_config(name, *overrides):
    path = ROOT / "experiments" / name
    return str(path), run.resolve_config(run.parse_args([str(path), *QUICK, *overrides]))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_lowers_a_fixed_key_eval_loss(name):
    """The experiment's own model, method and data: 30 steps lower the loss of a later batch at a fixed key."""
    _, config = experiment_config(name, "--steps", "30")
    built = experiment.setup(config)
    model, program = built.program.model, built.program
    held_out = experiment.batch_fn(config, built)(1000)

    def eval_loss(state):
        params = state.roles["student"].params
        return dfsft.loss_fn(params, held_out, random.key(123), model=model, config=config.method)[0].item()

    batches = experiment.batch_fn(config, built)
    state = experiment.initial_state(built, batches(0))
    start = eval_loss(state)
    for step in range(30):
        state, _ = program.step_(state, {}, batches(step))
    assert eval_loss(state) <= 0.7 * start  # measured: 0.55 of it


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_resumes_bit_for_bit(tmp_path, name):
    """2 steps, then --resume to 4, log and save what 4 steps in one go do, bit for bit."""
    path = str(ROOT / "experiments" / name)

    def train(out, steps, *extra):
        assert run.main([path, "--out", str(out), "--steps", str(steps), *QUICK, *extra]) == 0

    train(tmp_path / "whole", 4)
    train(tmp_path / "resumed", 2)
    train(tmp_path / "resumed", 4, "--resume")
    whole, resumed = (tracking.read_scalars(tmp_path / run_dir / "tb") for run_dir in ("whole", "resumed"))
    for metric in ("loss", "grad_norm", "lr"):
        assert [s for s, _ in resumed[metric]] == [0, 1, 2, 3] and resumed[metric] == whole[metric], metric
    a, b = final_state(tmp_path / "whole"), final_state(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
