"""A run folder given where a diffusers folder goes (``models.<name>.path``) is refused in one line that gives the
export command, before any weights load, instead of being compared as a diffusers folder (issue 40)."""
import json
import pathlib

import pytest

from fvx import run
from fvx.core import random
from fvx.training import config_checks
from fvx_models.wan import WanConfig

EXPERIMENT = str(pathlib.Path(__file__).resolve().parents[3] / "experiments" / "finetune_wan.py")


@pytest.fixture
def run_dir(tmp_path):
    """What a run folder holds that the check reads (fvx.training.run_folder): run.json, checkpoints/N/, and fvx's
    own config.json at the top (``fvx.config.record``: no ``_class_name``)."""
    folder = tmp_path / "finetune_wan"
    (folder / "checkpoints" / "400").mkdir(parents=True)
    (folder / "run.json").write_text("[]")
    (folder / "config.json").write_text(json.dumps({"config_type": "experiments.x:Y", "types": {}, "config": {}}))
    (folder / "exported" / "transformer").mkdir(parents=True)  # an export written into the run folder is not one
    return folder


def test_a_run_folder_as_a_model_path_gives_the_export_command(run_dir, tmp_path, capsys):
    cases = {run_dir: f"export {run_dir} --out FOLDER",
             run_dir / "checkpoints": f"export {run_dir} --out FOLDER",
             run_dir / "checkpoints" / "400": f"export {run_dir} --step 400 --out FOLDER"}
    for path, command in cases.items():
        out = tmp_path / "run"
        assert run.main([EXPERIMENT, "--out", str(out), "validation.every=0", f"models.student.path={path}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"fvx.run: error: models.student.path = {str(path)!r} is an fvx run folder, not a diffusers "
                       f"folder; export it first: python -m fvx.run {command}, then set models.student.path=FOLDER")
        assert not out.exists()
    assert config_checks.run_folder_of(run_dir / "exported") is None


def test_a_loader_reading_a_run_folder_says_export_it_first(run_dir):
    """Any reader of a diffusers folder (not only a config's path: an export's --base, a cache's teacher)."""
    model = WanConfig(preset="tiny", path=str(run_dir)).build()
    with pytest.raises(ValueError) as refused:
        model.weights.initial(random.key(0))
    assert str(refused.value) == (
        f"wan load: {str(run_dir / 'config.json')!r} is an fvx run's config, not a diffusers one: {str(run_dir)!r} is "
        f"a run folder; export it first: python -m fvx.run export {run_dir} --out FOLDER, and load FOLDER")
