"""Fixtures the method tests share: the tiny Wan and its params (a test file may define its own)."""
import pytest

from fvx.core import random
from fvx_models.wan import WanConfig


@pytest.fixture(scope="module")
def model():
    return WanConfig(preset="tiny").build()


@pytest.fixture(scope="module")
def params(model):
    return model.weights.init(random.key(7))
