"""fvx.export: a trained role (or its EMA) -> a diffusers folder that from_pretrained loads bit for bit; bad input is
one clear error that writes nothing."""
import json
import pathlib

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

from fvx import checkpoint, loop, run, tree

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENT = str(ROOT / "tests" / "fvx" / "faulty_experiment.py")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> pathlib.Path:
    """A 2-step run, plus a hand-made checkpoint 3 whose role has EMA params (fine-tuning keeps none)."""
    out = tmp_path_factory.mktemp("export") / "run"
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "2"]) == 0
    with checkpoint.Checkpoints(out / "checkpoints", checkpoint.CheckpointConfig(async_save=False)) as checkpoints:
        state = checkpoints.restore(2, loop.initial_state(loop.setup(loop.load_run(out))))
        role = state.roles["student"]
        ema = tree.map_tensors(lambda p: p * 0.5 + 0.25, role.params)
        checkpoints.save(state._replace(step=torch.tensor(3), roles={"student": role._replace(ema=ema)}),
                         config={}, meta={})
    return out


def stored(run_dir: pathlib.Path, step: int, part: str) -> dict:
    with checkpoint.Checkpoints(run_dir / "checkpoints") as checkpoints:
        return checkpoints.read(step, ("roles", "student", part))


def assert_loads_exactly(folder: pathlib.Path, params: dict) -> None:
    loaded = WanTransformer3DModel.from_pretrained(folder / "transformer").state_dict()
    assert loaded.keys() == params.keys()
    for name, tensor in params.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("args, step, part", [([], 3, "params"), (["--step", "2"], 2, "params"),
                                               (["--ema"], 3, "ema")], ids=["latest", "step", "ema"])
def test_export_round_trips_through_from_pretrained(run_dir, tmp_path, capsys, args, step, part):
    out = tmp_path / "exported"
    assert run.main(["export", str(run_dir), "--out", str(out), *args]) == 0
    assert f"at step {step} to {out} (transformer, model_index.json, scheduler/)" in capsys.readouterr().out
    assert_loads_exactly(out, stored(run_dir, step, part))
    manifest = json.loads((out / "fvx_export.json").read_text())
    assert manifest == {"run": str(run_dir), "step": step, "role": "student", "ema": part == "ema"}
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(out, subfolder="scheduler")
    assert scheduler.config.shift == 3.0


@pytest.mark.parametrize("args, message", [
    (["--role", "critic"], "did not train role 'critic'; trained roles: student"),
    (["--step", "2", "--ema"], "role 'student' of the run in"),
    (["--step", "7"], "no checkpoint of step 7 in"),
])
def test_bad_export_is_one_clear_error_that_writes_nothing(run_dir, tmp_path, capsys, args, message):
    out = tmp_path / "exported"
    assert run.main(["export", str(run_dir), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fvx.run: error:") and message in err
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_folder_that_holds_something(run_dir, tmp_path, capsys):
    (tmp_path / "kept.txt").write_text("mine")
    assert run.main(["export", str(run_dir), "--out", str(tmp_path)]) == 2
    assert "already exists and is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]
