"""Attention per model in a multi-role run: a DMD2 run whose student runs fake-quantized attention (QAD's stage 2)
keeps its teacher's and critic's outputs bit for bit those of plain models, and a VSA model shared by the student and
the critic gives the critic the dense view."""
import dataclasses
import pathlib

import torch

from fvx import config as fconfig
from fvx.core import random
from fvx.data import batching
from fvx.training import experiment
from fvx_models.wan import WanConfig

DMD2 = pathlib.Path(__file__).parents[3] / "experiments" / "dmd2.py"
TOY = ["models.student.path=null", "models.critic.path=null", "models.teacher.path=null", "data.batch_size=2",
       "method.generator_update_interval=1"]


def recording(model, calls):
    def apply(params, x_t, t, cond, **kwargs):
        out = model.apply(params, x_t, t, cond, **kwargs)
        calls.append(({name: p.detach().clone() for name, p in params.items()}, x_t.detach().clone(), t.clone(),
                      dict(cond), kwargs, out.detach().clone()))  # the step updates the critic's params in place
        return out
    return dataclasses.replace(model, apply=apply)


def test_a_qat_student_leaves_the_teacher_and_critic_bit_for_bit_dense():
    config = fconfig.apply_overrides(fconfig.load_experiment(f"{DMD2}:world_attn_qad"), TOY)
    models = experiment.build_models(config)
    assert [models[role].kernels.attention for role in ("student", "critic", "teacher")] == ["qat", "sdpa", "sdpa"]
    calls = {"critic": [], "teacher": []}
    recorded = {role: recording(model, calls[role]) if role in calls else model for role, model in models.items()}
    program = config.method.build(recorded, total_steps=4)
    program = program._replace(step_=experiment.in_attention_steps(program.step_, recorded, "student"))
    method_key, data_key = experiment.run_keys(config.run.seed)
    dataset = program.dataset(experiment.datasets.open_dataset(config.data, data_key))
    batch = program.model.batch(batching.batch_at(dataset, data_key, 0, batch_size=2))
    state = program.init(method_key)._replace(carry=program.carry(batch))
    frozen = program.frozen(method_key)
    state, metrics = program.step_(state, frozen, batch)
    assert torch.isfinite(metrics["generator_loss"]) and calls["teacher"] and calls["critic"]
    plain = WanConfig(preset="world").build()
    for role, role_calls in calls.items():
        for params, x_t, t, cond, kwargs, out in role_calls:
            with torch.no_grad():
                assert torch.equal(plain.apply(params, x_t, t, cond, **kwargs), out), role


def test_a_vsa_model_shared_by_student_and_critic_gives_the_critic_the_dense_view():
    config = fconfig.apply_overrides(fconfig.load_experiment(DMD2), [
        "models.student.path=null", "models.teacher.path=null", "models.student.attention=vsa",
        "models.student.vsa.implementation=reference"])
    models = experiment.build_models(config)
    assert models["student"].kernels.attention == models["critic"].kernels.attention == "vsa"
    assert models["student"].kernels.dense_apply is not None and models["critic"].kernels.dense_apply is None
    params = models["student"].weights.init(random.key(0))
    x = random.normal(random.key(1), (1, 192, 8, 8, 8))  # an (8, 8, 8) grid: 8 tiles, the student keeps 1 of 8
    t, cond = torch.tensor([500.0]), {"text": random.normal(random.key(2), (1, 4, 32)), "text_mask": torch.ones(1, 4)}
    with torch.no_grad():
        sparse, critic = models["student"].apply(params, x, t, cond), models["critic"].apply(params, x, t, cond)
        dense = models["student"].kernels.dense_apply(params, x, t, cond)
    assert torch.equal(critic, dense) and not torch.allclose(sparse, dense, atol=1e-4)
