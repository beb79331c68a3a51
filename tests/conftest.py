"""Shared fixtures: explicit keys, and skipping of CUDA-only tests on machines without a GPU."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def key():
    """A fresh fvx key per test (seed 0): tests derive every draw from it."""
    from fvx import random

    return random.key(0)
