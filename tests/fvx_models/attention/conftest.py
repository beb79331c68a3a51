"""The attention tests' shared dense checkpoint: a tiny Wan's random params exported as a diffusers folder."""
import pytest

from fvx.core import random
from fvx_models.wan import WanConfig


@pytest.fixture(scope="package")
def dense_folder(tmp_path_factory):
    """``(folder, model, params)`` of a tiny dense Wan exported to ``folder``."""
    model = WanConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    folder = tmp_path_factory.mktemp("dense") / "wan"
    model.export.folder(params, str(folder))
    return folder, model, params
