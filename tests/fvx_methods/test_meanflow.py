"""MeanFlow: zero loss at the exact average velocity of a Gaussian flow, a 2-D flow map trained to sample in one step,
the run on the toy world (on data and distilled) resuming bitwise, 2 processes = 1, and the method's checks."""
import pathlib
import types

import pytest
import torch
from torch import nn

from fvx.core import random
from fvx_methods import meanflow
from fvx_models.model import LatentSpace, Rules

from gloo import assert_two_processes_log_as_one, launch2  # noqa: E402
from run_state import assert_one_line_errors, assert_resumes_bitwise  # noqa: E402

EXPERIMENT = str(pathlib.Path(__file__).resolve().parents[2] / "experiments" / "meanflow.py")

MU, STD = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 0.3])


def gaussian_flow(x, t, r):
    """The exact flow map of x0 ~ N(MU, STD^2) to N(0, 1) on x_s = (1 - s) x0 + s noise: each coordinate's level-s
    marginal is N((1 - s) MU, m(s)^2), m(s)^2 = (1 - s)^2 STD^2 + s^2, transported linearly; u is the average velocity
    from sigma_t to sigma_r, the instantaneous one on the diagonal."""
    s, q = (t / 1000)[:, None], (r / 1000)[:, None]
    m = lambda s: torch.sqrt((1 - s) ** 2 * STD ** 2 + s ** 2)
    velocity = -MU + ((s - 1) * STD ** 2 + s) / m(s) ** 2 * (x - (1 - s) * MU)
    x_r = (1 - q) * MU + m(q) / m(s) * (x - (1 - s) * MU)
    jump = torch.where((s - q).abs() > 0, s - q, torch.ones_like(s))
    return torch.where((s - q).abs() > 0, (x - x_r) / jump, velocity)


def toy_model(apply):
    """A stand-in for fvx_models.model.Model on 2-D points: ``apply(params, x, t, cond, r=)``."""
    return types.SimpleNamespace(normalize=LatentSpace(2).normalize, apply=apply, rules=Rules(two_time=True))


def batch_of(x0):
    return {"latents": x0, "sample_index": torch.arange(len(x0)), "cond": {}}


@pytest.mark.parametrize("derivative", ["ad", "finite_difference"])
def test_the_loss_is_zero_at_the_exact_mean_velocity(derivative):
    model = toy_model(lambda params, x, t, cond, r=None: gaussian_flow(x, t, t if r is None else r))
    config = meanflow.MeanFlow(derivative=derivative, fd_step=1e-3, diagonal_fraction=0.25, endpoint_fraction=0.25,
                               density="uniform")
    x0 = MU + STD * random.normal(random.key(0), (256, 2))
    marginal = lambda x_t, t, cond: gaussian_flow(x_t, t, t)
    _, aux = meanflow.loss_fn({}, batch_of(x0), random.key(1), model=model, config=config, velocity=marginal)
    assert aux["mse"] < 1e-8
    _, data_aux = meanflow.loss_fn({}, batch_of(x0), random.key(1), model=model, config=config)
    assert data_aux["mse"] > 0.1  # the data's own velocity noise - x0 is not the marginal's


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 2))

    def forward(self, x, t, r):
        return self.net(torch.cat([x, (t / 1000)[:, None], (r / 1000)[:, None]], dim=1))


def test_a_2d_flow_map_trained_on_data_samples_the_data_in_one_step():
    torch.manual_seed(0)  # the MLP's init only
    mlp = MLP()
    model = toy_model(lambda params, x, t, cond, r=None: torch.func.functional_call(mlp, params, (x, t, r)))
    params = {name: p.detach().clone().requires_grad_() for name, p in mlp.named_parameters()}
    config = meanflow.MeanFlow(density="uniform", diagonal_fraction=0.5)
    optimizer = torch.optim.Adam(params.values(), lr=3e-3)

    def one_step_samples(n=2000):
        noise = random.normal(random.key(7), (n, 2))
        with torch.no_grad():
            return noise - model.apply(params, noise, torch.full((n,), 1000.0), {}, r=torch.zeros(n))

    before = one_step_samples()
    for step in range(600):
        x0 = MU + STD * random.normal(random.fold_in(random.key(2), step), (128, 2))
        loss, _ = meanflow.loss_fn(params, batch_of(x0), random.fold_in(random.key(3), step), model=model,
                                   config=config)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = one_step_samples()
    assert (before.mean(0) - MU).abs().max() > 1.0
    assert (after.mean(0) - MU).abs().max() < 0.1 and (after.std(0) / STD - 1).abs().max() < 0.2


def test_bad_fractions_are_one_line():
    with pytest.raises(ValueError, match=r"method.diagonal_fraction must be in \[0, 1\], got 1.5"):
        meanflow.MeanFlow(diagonal_fraction=1.5)
    with pytest.raises(ValueError, match="method.diagonal_fraction \\+ method.endpoint_fraction = 1.25 is above 1"):
        meanflow.MeanFlow(diagonal_fraction=0.75, endpoint_fraction=0.5)


def quick(world_teacher, *more):
    return ["run.progress=false", "validation.every=0", "run.checkpoint.every=2", "run.checkpoint.async_save=false",
            f"models.student.path={world_teacher}", "data.batch_size=4", *more]


@pytest.mark.parametrize("recipe", ["", ":world_distill"])
def test_a_run_resumes_bitwise(tmp_path, world_teacher, recipe):
    more = [f"models.teacher.path={world_teacher}"] if recipe else []
    assert_resumes_bitwise(EXPERIMENT + recipe, tmp_path, [*quick(world_teacher), *more], ("mse", "loss", "grad_norm"))


@pytest.mark.slow  # 2 + 1 processes
def test_two_processes_train_as_one(tmp_path, world_teacher):
    """2 gloo processes (the student sharded, its derivative by dual tensors) log what 1 does; torch.func.jvp cannot
    run through the shards' gathers and is refused there in one line."""
    knobs = (f"models.student.path={world_teacher}", "data.batch_size=4")
    outputs = launch2(tmp_path / "refused", *knobs, "method.derivative=ad", experiment=EXPERIMENT, expect=2)
    assert "use method.derivative=dual" in outputs[0] and not (tmp_path / "refused").exists()
    assert_two_processes_log_as_one(tmp_path, EXPERIMENT, knobs, ("mse", "grad_norm"))


def test_bad_input_from_the_cli_is_one_line_and_writes_nothing(tmp_path, capsys, world_teacher):
    assert_one_line_errors(EXPERIMENT, tmp_path, capsys, quick(world_teacher), [
        (["models.student.r_embedder=null"],
         "MeanFlow trains a flow map u(x_t, t, r), but models.student (wan:world) has no r input"),
        (["models.student.compile=blocks"],
         "method.derivative=dual runs forward-mode AD eagerly and cannot run inside a compiled model "
         "(compile=blocks or model); use method.derivative=finite_difference"),
        (["method.endpoint_fraction=-0.1"], "method.endpoint_fraction must be in [0, 1], got -0.1"),
    ])
