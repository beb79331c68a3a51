"""Shared fixtures: explicit keys, and skipping of CUDA-only tests on machines without a GPU; the test helpers
(``tests/helpers``: worker scripts, test experiments, the family cases) importable by name."""
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent / "helpers"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One intra-op thread for the whole suite: tiny models are bound by per-op overhead (one thread is faster, and
    much steadier on a CPU shared with other jobs), and bitwise comparisons across runs need a fixed thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def key():
    """A fresh fvx key per test (seed 0): tests derive every draw from it."""
    from fvx.core import random

    return random.key(0)


@pytest.fixture(scope="session")
def world_teacher(tmp_path_factory):
    """A random model of the toy world's preset, exported as a diffusers folder: the default DMD2 experiment's
    teacher (and student initialisation) in tests, instead of the trained ``runs/teacher``."""
    from fvx.core import random
    from fvx_models.wan import WanConfig

    model = WanConfig(preset="world").build()
    folder = tmp_path_factory.mktemp("world_teacher") / "teacher"
    model.export.folder(model.weights.init(random.key(0)), str(folder))
    return folder


@pytest.fixture(scope="session")
def toy_teacher_300(tmp_path_factory):
    """The README's main job, 300 steps at its batch of 8 (about 25 s): validated at steps 0 and 300, its last step
    saved; one run for the tests that train it briefly (what it learns, what it samples)."""
    from fvx import run

    out = tmp_path_factory.mktemp("toy_teacher") / "run"
    experiment = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "finetune_wan.py"
    assert run.main([str(experiment), "--out", str(out), "--steps", "300", "validation.every=300",
                     "run.progress=false", "run.checkpoint.every=0", "run.checkpoint.final=true"]) == 0
    return out
