"""fvx_methods.scm: TrigFlow over a flow-matching model, zero loss at an exact flow's consistency function, a 2-D
consistency model trained to sample in one step, the carried weighting, the run resuming bitwise, and its checks."""
import pathlib
import types

import pytest
import torch
from torch import nn

from fvx.core import random
from fvx.training import tracking
from fvx_methods import scm
from fvx_models.model import LatentSpace

from gloo import assert_two_processes_log_as_one  # noqa: E402
from run_state import assert_one_line_errors, assert_resumes_bitwise  # noqa: E402

EXPERIMENT = str(pathlib.Path(__file__).resolve().parents[2] / "experiments" / "scm.py")
MU, STD = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 0.3])


def gaussian_velocity(x, t):
    """The flow-matching velocity of x0 ~ N(MU, STD^2) (x_s = (1 - s) x0 + s noise) at level s = t / 1000."""
    s = (t / 1000)[:, None]
    m2 = (1 - s) ** 2 * STD ** 2 + s ** 2
    return -MU + ((s - 1) * STD ** 2 + s) / m2 * (x - (1 - s) * MU)


def toy_model(apply):
    return types.SimpleNamespace(normalize=LatentSpace(2).normalize, apply=apply)


def test_trig_velocity_is_the_flow_models_and_its_consistency_function_its_x0():
    model = toy_model(lambda params, x, t, cond: gaussian_velocity(x, t))
    x_t, t = random.normal(random.key(0), (64, 2)), torch.rand(64) * 1.5 + 0.03
    s = (torch.sin(t) / (torch.sin(t) + torch.cos(t)))[:, None]
    x_s = x_t / (torch.sin(t) + torch.cos(t))[:, None]
    f = torch.cos(t)[:, None] * x_t - torch.sin(t)[:, None] * scm.trig_velocity(model, {}, x_t, t, {})
    assert torch.allclose(f, x_s - s * gaussian_velocity(x_s, 1000 * s[:, 0]), atol=1e-5)


def gaussian_endpoint_model(params, x, t, cond):
    """A flow-matching model whose x0 prediction is the ODE's endpoint: v = (x_s - Phi(x_s)) / s, Phi the exact
    transport of level s to the data, x0 = MU + STD / m(s) (x_s - (1 - s) MU), m(s)^2 = (1 - s)^2 STD^2 + s^2."""
    s = (t / 1000)[:, None]
    m = torch.sqrt((1 - s) ** 2 * STD ** 2 + s ** 2)
    return (x - (MU + STD / m * (x - (1 - s) * MU))) / s


@pytest.mark.parametrize("derivative", ["ad", "dual"])
def test_the_exact_consistency_function_distilled_from_the_exact_flow_has_zero_error(derivative):
    """The student's f the ODE's endpoint map and the teacher's F the ODE's velocity: f is constant along the ODE, so
    the tangent g vanishes (with the warm-up done); consistency training's dx/dt (the sample's) does not."""
    model, teacher = toy_model(gaussian_endpoint_model), toy_model(lambda params, x, t, cond: gaussian_velocity(x, t))
    config = scm.SCM(derivative=derivative, warmup_steps=0)
    x0 = MU + STD * random.normal(random.key(1), (256, 2))
    batch = {"latents": x0, "sample_index": torch.arange(256), "cond": {}}
    velocity = lambda x_t, t, cond: scm.trig_velocity(teacher, {}, x_t, t, cond)
    _, aux = scm.loss_fn({}, batch, random.key(2), model=model, config=config, step=torch.tensor(0),
                         weights=torch.ones(config.weight_bins), velocity=velocity)
    assert aux["error"] < 1e-10
    _, data_aux = scm.loss_fn({}, batch, random.key(2), model=model, config=config, step=torch.tensor(0),
                              weights=torch.ones(config.weight_bins))
    assert data_aux["error"] > 1e-4


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 2))

    def forward(self, x, t):
        return self.net(torch.cat([x, (t / 1000)[:, None]], dim=1))


def test_a_2d_consistency_model_trained_on_data_samples_the_data_in_one_step():
    torch.manual_seed(0)  # the MLP's init only
    mlp = MLP()
    model = toy_model(lambda params, x, t, cond: torch.func.functional_call(mlp, params, (x, t)))
    params = {name: p.detach().clone().requires_grad_() for name, p in mlp.named_parameters()}
    config = scm.SCM(warmup_steps=100)
    carry = scm.weights_carry(config)
    weights = carry.init(None)
    optimizer = torch.optim.Adam(params.values(), lr=3e-3)

    def one_step_samples(n=2000):
        noise = random.normal(random.key(7), (n, 2))
        with torch.no_grad():
            return noise - model.apply(params, noise, torch.full((n,), 1000.0), {})

    before = one_step_samples()
    for step in range(600):
        x0 = MU + STD * random.normal(random.fold_in(random.key(2), step), (128, 2))
        batch = {"latents": x0, "sample_index": torch.arange(128), "cond": {}}
        loss, aux = scm.loss_fn(params, batch, random.fold_in(random.key(3), step), model=model, config=config,
                                step=torch.tensor(step), weights=weights["error_ema"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        weights = carry.update(weights, {name: aux[name] for name in carry.metrics})
    after = one_step_samples()
    assert (before.mean(0) - MU).abs().max() > 1.0
    assert (after.mean(0) - MU).abs().max() < 0.1 and (after.std(0) / STD - 1).abs().max() < 0.25


def test_the_weighting_carry_sets_then_blends_the_bins_drawn():
    config = scm.SCM(weight_bins=3, weight_decay=0.5)
    carry = scm.weights_carry(config)
    state = carry.init(None)
    stats = lambda sums, counts: {"scm/error_sum": torch.tensor(sums), "scm/count": torch.tensor(counts)}
    state = carry.update(state, stats([4.0, 0.0, 1.0], [2.0, 0.0, 1.0]))
    assert state["error_ema"].tolist() == [2.0, 1.0, 1.0] and state["seen"].tolist() == [True, False, True]
    state = carry.update(state, stats([0.0, 3.0, 0.0], [1.0, 1.0, 0.0]))
    assert state["error_ema"].tolist() == [1.0, 3.0, 1.0]


def quick(world_teacher, *more):
    return ["run.progress=false", "validation.every=0", "run.checkpoint.every=2", "run.checkpoint.async_save=false",
            f"models.student.path={world_teacher}", "data.batch_size=4", *more]


@pytest.mark.parametrize("recipe", ["", ":world_distill"])
def test_a_run_resumes_bitwise_with_its_carried_weights(tmp_path, world_teacher, recipe):
    args = [*quick(world_teacher), *([f"models.teacher.path={world_teacher}"] if recipe else [])]
    state = assert_resumes_bitwise(EXPERIMENT + recipe, tmp_path, args, ("loss", "error", "grad_norm"))
    assert any(name.startswith("carry") for name in state)
    assert "scm/count" not in tracking.read_scalars(tmp_path / "whole" / "tb")


@pytest.mark.slow  # 2 + 1 processes
def test_two_processes_train_as_one(tmp_path, world_teacher):
    """2 gloo processes (the student sharded, the weighting's bin statistics averaged over ranks) log what 1 does."""
    assert_two_processes_log_as_one(tmp_path, EXPERIMENT, (f"models.student.path={world_teacher}",
                                                           "data.batch_size=4"), ("loss", "error", "grad_norm"),
                                    abs_tol=1e-9)


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, world_teacher):
    assert_one_line_errors(EXPERIMENT, tmp_path, capsys, quick(world_teacher), [
        (["models.student.compile=blocks"], "method.derivative=dual runs forward-mode AD eagerly")])
