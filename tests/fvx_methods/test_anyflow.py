"""fvx_methods.anyflow: the schedule and the flow-map rollout against spec §2.6 by hand, the run on the toy world
resuming bitwise, 2 processes = 1, and its checks."""
import pathlib
import types

import pytest
import torch

from fvx.core import random
from fvx_methods import anyflow
from fvx_methods.library import distribution_matching as dm

from gloo import assert_two_processes_log_as_one  # noqa: E402
from run_state import assert_one_line_errors, assert_resumes_bitwise  # noqa: E402

EXPERIMENT = str(pathlib.Path(__file__).resolve().parents[2] / "experiments" / "anyflow.py")


def test_the_schedule():
    assert anyflow.schedule(anyflow.AnyFlow(denoising_steps=(1000, 750, 500, 250))).tolist() == [1000, 750, 500, 250, 0]
    assert anyflow.schedule(anyflow.AnyFlow(denoising_steps=(1000, 750, 500, 250), student_sample_steps=2)).tolist() \
        == [1000, 750, 0]
    override = anyflow.AnyFlow(t_list_override=(999.0, 937.0, 833.0, 624.0, 0.0), student_sample_steps=4)
    assert anyflow.schedule(override).tolist() == [999, 937, 833, 624, 0]


def test_the_rollout_by_hand():
    """u(x, t, r) = x (t - r) / 1000 + 1: the graded call is the drawn jump, the state after it returned; the
    critic's path makes every jump without a graph."""
    config = anyflow.AnyFlow(denoising_steps=(1000, 600, 200), use_mean_velocity=True)
    w = torch.tensor(1.0, requires_grad=True)
    model = types.SimpleNamespace(
        apply=lambda params, x, t, cond, r=None: w * x * ((t - r) / 1000).view(-1, 1, 1, 1, 1) + 1)
    batch = {"sample_index": torch.arange(3), "latents": torch.zeros(3, 2, 1, 2, 2), "cond": {}}
    key = random.key(4)
    jump_key, noise_key = random.split(key)
    graded = int(random.randint(jump_key, (), 0, 3))
    x = dm.per_sample_normal(noise_key, batch["sample_index"], 0, (2, 1, 2, 2), "cpu")
    levels = [1000.0, 600.0, 200.0, 0.0]
    for i in range(graded + 1):
        t, r = levels[i], levels[i + 1]
        x = x - (t - r) / 1000 * (x * (t - r) / 1000 + 1)
    x0_gen, t_graded = anyflow.rollout({}, batch, key, True, model=model, config=config)
    assert torch.allclose(x0_gen, x) and t_graded.tolist() == [levels[graded]] * 3 and x0_gen.requires_grad
    final, _ = anyflow.rollout({}, batch, key, False, model=model, config=config)
    assert not final.requires_grad


def quick(world_teacher, *more):
    return ["run.progress=false", "validation.every=0", "run.checkpoint.every=2", "run.checkpoint.async_save=false",
            "data.batch_size=2", "method.generator_update_interval=2",
            *[f"models.{name}.path={world_teacher}" for name in ("student", "teacher", "critic")], *more]


def test_a_run_resumes_bitwise(tmp_path, world_teacher):
    assert_resumes_bitwise(EXPERIMENT, tmp_path, quick(world_teacher),
                           ("critic_loss", "generator_loss", "grad_norm/critic"))


@pytest.mark.slow  # 2 + 1 processes
def test_two_processes_train_as_one(tmp_path, world_teacher):
    """The graded jump is one draw of the step key and the noise per sample, so 2 gloo processes log what 1 does."""
    knobs = (*[f"models.{name}.path={world_teacher}" for name in ("student", "teacher", "critic")],
             "data.batch_size=4", "method.generator_update_interval=2")
    assert_two_processes_log_as_one(tmp_path, EXPERIMENT, knobs, ("critic_loss", "generator_loss", "grad_norm/critic"))


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, world_teacher):
    assert_one_line_errors(EXPERIMENT, tmp_path, capsys, quick(world_teacher), [
        (["models.student.r_embedder=null"], "AnyFlow trains a flow map u(x_t, t, r), but models.student (wan:world) "
                                             "has no r input"),
        (["method.rollout_mode=data_latent"], "rollout_mode='data_latent' would be ignored: use "
                                              "method.rollout_mode=simulate"),
        (["method.t_list_override=[500, 900, 0]"], "method.t_list_override must be at least 2 strictly descending"),
    ])
