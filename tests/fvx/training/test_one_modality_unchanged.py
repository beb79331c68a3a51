"""Video-only models are unchanged by the modality contract (issue 31): one step of fine-tuning and of DMD2 on the toy
world's Wan gives the state recorded on af561d9, the commit before modalities became pytrees.

The record (`one_modality_unchanged.json`) holds the logged metrics and, for every tensor of the state after the step
(params, optimizer state, EMA, key, step) in pytree order, its sum, its absolute sum and its dot with a ramp, in
float64. Bits are not compared: MKL picks other kernels on other CPUs (a few ulps after one AdamW step, 4e-6 of a
leaf's absolute sum with MKL_ENABLE_INSTRUCTIONS=AVX2); a changed model moves them by far more than TOLERANCE. torch's
CPU normal sampler itself differs by vector width, so the record holds only on the capability it was made on.
Re-record with `python tests/fvx/training/test_one_modality_unchanged.py` from a checkout of af561d9 (one thread).
"""
import json
import pathlib
import sys

import pytest
import torch

from fvx.config import apply_overrides, load_experiment
from fvx.core import tree
from fvx.training import experiment

RECORD = pathlib.Path(__file__).with_name("one_modality_unchanged.json")
TOLERANCE = 1e-4  # of each leaf's absolute sum
RECIPES = {
    "experiments/finetune_wan.py": ["method.optim.warmup_steps=0"],
    "experiments/dmd2.py": ["method.generator_update_interval=1", "models.student.path=null",
                            "models.teacher.path=null"],
}


def one_step(path: str, overrides: list[str]) -> tuple[list[list[float]], dict[str, float]]:
    """(per tensor leaf of the state after one step: [sum, absolute sum, dot with a -1..1 ramp]; logged metrics)."""
    config = apply_overrides(load_experiment(path), overrides)
    built = experiment.setup(config)
    batch = experiment.batch_fn(config, built)(0)
    state, metrics = built.program.step_(experiment.initial_state(built, batch), experiment.frozen_params(built), batch)
    prints = []
    for leaf in tree.leaves(state):
        if isinstance(leaf, torch.Tensor):
            values = leaf.detach().double().reshape(-1)
            ramp = torch.linspace(-1, 1, values.numel(), dtype=torch.float64)
            prints.append([float(values.sum()), float(values.abs().sum()), float(values @ ramp)])
    return prints, {name: float(value) for name, value in metrics.items()}


@pytest.mark.parametrize("path", sorted(RECIPES))
def test_a_video_model_step_is_the_recorded_one(path):
    record = json.loads(RECORD.read_text())
    if torch.backends.cpu.get_cpu_capability() != record["cpu_capability"]:
        pytest.skip(f"recorded on {record['cpu_capability']}, whose random draws this CPU's sampler does not repeat")
    prints, metrics = one_step(path, RECIPES[path])
    expected = record["recipes"][path]
    for name, want in expected["metrics"].items():
        assert metrics[name] == pytest.approx(want, rel=1e-5), name
    assert len(prints) == len(expected["leaves"])
    for index, (got, want) in enumerate(zip(prints, expected["leaves"])):
        scale = max(want[1], 1e-12)
        assert all(abs(g - w) <= TOLERANCE * scale for g, w in zip(got, want)), (path, index, got, want)


if __name__ == "__main__":
    torch.set_num_threads(1)
    recipes = {}
    for path, overrides in RECIPES.items():
        prints, metrics = one_step(path, overrides)
        recipes[path] = {"metrics": metrics, "leaves": prints}
    RECORD.write_text(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "recipes": recipes}))
    print(f"wrote {RECORD}", file=sys.stderr)
