"""Video-only models are unchanged, bit for bit, by the modality contract (issue 31): one step of fine-tuning and of
DMD2 on the toy world's Wan gives the state recorded on af561d9, the commit before modalities became pytrees.

The digest is sha256 over the bytes of every tensor of the state after the step (params, optimizer state, EMA, key,
step), in pytree order; the metrics are the logged ones. Recorded with the same function on af561d9 (torch 2.13 CPU,
one thread as the suite runs).
"""
import hashlib

import pytest
import torch

from fvx.config import apply_overrides, load_experiment
from fvx.core import tree
from fvx.training import experiment

RECORDED = {
    "experiments/finetune_wan.py": ("0d712aad5a1eb566", {"loss": 2.368654251098633}, ["method.optim.warmup_steps=0"]),
    "experiments/dmd2.py": ("30f76f82463a12f2",
                            {"generator_loss": 0.1987161636352539, "critic_loss": 2.6889727115631104},
                            ["method.generator_update_interval=1", "models.student.path=null",
                             "models.teacher.path=null"]),
}


def one_step(path: str, overrides: list[str]) -> tuple[str, dict[str, float]]:
    config = apply_overrides(load_experiment(path), overrides)
    built = experiment.setup(config)
    batch = experiment.batch_fn(config, built)(0)
    state, metrics = built.program.step_(experiment.initial_state(built, batch), experiment.frozen_params(built), batch)
    digest = hashlib.sha256()
    for leaf in tree.leaves(state):
        if isinstance(leaf, torch.Tensor):
            digest.update(leaf.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16], {name: float(value) for name, value in metrics.items()}


@pytest.mark.parametrize("path", sorted(RECORDED))
def test_a_video_model_step_is_the_recorded_one(path):
    expected_digest, expected_metrics, overrides = RECORDED[path]
    digest, metrics = one_step(path, overrides)
    assert {name: metrics[name] for name in expected_metrics} == expected_metrics
    assert digest == expected_digest
