"""Replay recomputes any logged step exactly and fails loudly on a tampered checkpoint; a NaN halts the run with the
replay command, and that replay reproduces the NaN; ``skip`` leaves the state alone and counts the skip."""
import json
import math
import pathlib
import shutil

import msgspec
import pytest
import torch

from fvx import config as fconfig, run
from fvx.core.state import NONFINITE
from fvx.storage import checkpoint
from fvx.training import experiment, loop, replay, run_folder, tracking

from run_state import start_state  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXPERIMENT = str(ROOT / "tests" / "helpers" / "faulty_experiment.py")  # 8 steps, grad_accum 2, checkpoints every 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("replay") / "run"
    assert run.main([EXPERIMENT, "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("step, start", [(1, None), (4, 4), (7, 6)])
def test_replay_reproduces_logged_steps_exactly(run_dir, step, start):
    result = replay.replay(run_dir, step)
    assert result.from_checkpoint == start
    logged = replay.logged_metrics(run_dir, step)
    assert set(result.metrics) == {"loss", "grad_norm", "lr"}
    for name, value in result.metrics.items():
        assert replay.same_float32(value, logged[name]), name
    assert replay.replay_step(run_dir, step) == result.metrics


def test_replay_command_prints_both_columns(run_dir, capsys):
    assert run.main(["replay", str(run_dir), "--step", "5"]) == 0
    out = capsys.readouterr().out
    assert "from checkpoint 4, 1 step(s) forward, then step 5" in out
    assert out.count("  same") == 3 and "replay matches the logged step 5" in out


def test_replay_of_a_step_that_was_never_logged_exits_non_zero(tmp_path, capsys):
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "4", "run.log_every=2"]) == 0
    assert run.main(["replay", str(out), "--step", "1"]) == 1
    assert "step 1 was not logged" in capsys.readouterr().out
    assert run.main(["replay", str(out), "--step", "2"]) == 0
    assert "bitwise as float32" in capsys.readouterr().out


def test_replay_fails_loudly_on_a_tampered_checkpoint(run_dir, tmp_path, capsys):
    tampered = tmp_path / "run"
    shutil.copytree(run_dir, tampered)
    with checkpoint.Checkpoints(tampered / "checkpoints") as checkpoints:  # a checkpoint 6 that is valid, but other
        state = checkpoints.restore(6, start_state(run_folder.load_run(tampered)))
    state.roles["student"].params["proj_out.bias"].add_(1e-3)
    shutil.rmtree(tampered / "checkpoints" / "6")
    with checkpoint.Checkpoints(tampered / "checkpoints", checkpoint.CheckpointConfig(async_save=False)) as writer:
        writer.save(state, config={}, meta={})
    assert run.main(["replay", str(tampered), "--step", "7"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "replay DIFFERS from the logged step 7: " in out
    assert run.main(["replay", str(tampered), "--step", "5"]) == 0  # from checkpoint 4: untouched

    data = max((tampered / "checkpoints" / "4" / "shards").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0x10
    data.write_bytes(bytes(content))
    assert run.main(["replay", str(tampered), "--step", "5"]) == 2
    err = capsys.readouterr().err  # the flip lands in tensor bytes (their checksum) or in the file's JSON header
    assert f"checkpoint '{tampered / 'checkpoints' / '4'}' is corrupt" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("step", ["8", "-1"])
def test_replay_of_a_step_beyond_the_run_is_bad_input(run_dir, capsys, step):
    assert run.main(["replay", str(run_dir), "--step", step]) == 2
    assert "is not a step of the run in" in capsys.readouterr().err


def test_a_nan_halts_with_the_replay_command_and_its_replay_reproduces_the_nan(tmp_path, capsys):
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), "method.nan_at_step=3"]) == 1
    err = capsys.readouterr().err
    # the NaN comes from the experiment file's own method class, so the replay names the file (a run folder alone
    # is data: its classes' values are rebuilt, their code is not run)
    command = f"python -m fvx.run replay {out} --step 3 --experiment {EXPERIMENT}"
    assert "step 3: non-finite loss or gradient (loss=nan, grad_norm=nan" in err and command in err
    assert "; its data is finite (samples synthetic sample " in err  # the NaN is the method's, not the data's
    record = json.loads((out / run_folder.NONFINITE_FILE).read_text())
    assert record["step"] == 3 and record["replay"] == command and not record["update_applied"]
    assert math.isnan(replay.logged_metrics(out, 3)["loss"])
    with checkpoint.Checkpoints(out / "checkpoints") as checkpoints:
        assert checkpoints.steps() == [2]  # nothing saved after the bad step

    assert run.main(["replay", str(out), "--step", "3", "--experiment", EXPERIMENT]) == 0
    assert "replay matches the logged step 3" in capsys.readouterr().out
    assert math.isnan(replay.replay(out, 3, experiment=EXPERIMENT).metrics["loss"])
    assert run.main(["replay", str(out), "--step", "3"]) == 1  # without the file's code there is no NaN
    assert "FaultyFinetune rebuilt from config.json on Finetune" in capsys.readouterr().out


def test_skip_leaves_the_state_unchanged_and_counts_skips(tmp_path):
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "5", "method.nan_at_step=3", "run.on_nonfinite=skip",
                     "run.checkpoint.every=1"]) == 0
    logged = tracking.read_scalars(out / "tb")
    assert logged["nonfinite_skips"] == [(0, 0.0), (1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0)]
    assert math.isnan(logged["loss"][3][1]) and all(math.isfinite(v) for _, v in logged["loss"][4:])
    with checkpoint.Checkpoints(out / "checkpoints") as checkpoints:
        before, after = (checkpoint.leaves_by_name(checkpoints.read(s, ())) for s in (3, 4))
        assert checkpoints.read_json(4, "meta")["nonfinite_skips"] == 1
    assert int(before.pop("step")) == 3 and int(after.pop("step")) == 4
    for name, tensor in before.items():  # params, optimizer state (count included) and key: untouched
        assert torch.equal(tensor, after[name]), name


def test_skip_halts_when_the_method_applied_a_non_finite_update(tmp_path):
    """A method without the guard of fvx.core.state.skipped reports no flag: its update is spoiled and cannot be
    skipped."""
    config = fconfig.apply_overrides(fconfig.load_experiment(EXPERIMENT), [
        f"run.output_dir={tmp_path / 'run'}", "run.steps=3", "method.nan_at_step=1", "run.on_nonfinite=skip"])
    prepared = experiment.prepare(config)
    guarded = prepared.setup.program.step_

    def unguarded(state, frozen, batch):
        state, metrics = guarded(state, frozen, batch)
        metrics.pop(NONFINITE, None)
        return state, metrics

    setup = msgspec.structs.replace(prepared.setup, program=prepared.setup.program._replace(step_=unguarded))
    with pytest.raises(loop.NonFiniteError, match="step 1: .*the method applied the update anyway") as error:
        loop.train(config, prepared._replace(setup=setup))
    assert error.value.step == 1 and error.value.replay_command.endswith("--step 1")


def test_replay_and_export_work_after_the_experiment_file_is_deleted_or_changed(tmp_path, capsys):
    """config.json types the config by itself: replay rebuilds the experiment's own classes from it (the run folder
    is data, never run) unless the user names the file, also after the file was edited or deleted, and says which;
    fvx's classes come by their recorded names."""
    experiment = tmp_path / "mine.py"
    shutil.copy(ROOT / "experiments" / "finetune_wan.py", experiment)
    out = tmp_path / "run"
    quick = ["--steps", "3", "run.progress=false", "validation.every=0", "run.checkpoint.every=2",
             "run.checkpoint.async_save=false", "data.batch_size=2"]
    assert run.main([str(experiment), "--out", str(out), *quick]) == 0
    capsys.readouterr()
    assert run.main(["replay", str(out), "--step", "2"]) == 0
    assert "config: FinetuneWan rebuilt from config.json on Experiment" in capsys.readouterr().out  # data only
    assert run.main(["replay", str(out), "--step", "2", "--experiment", str(experiment)]) == 0
    assert "config: FinetuneWan from the experiment file" in capsys.readouterr().out  # named by the user
    experiment.write_text(experiment.read_text() + "\n# edited since the run\n")
    assert run.main(["replay", str(out), "--step", "2", "--experiment", str(experiment)]) == 0
    printed = capsys.readouterr().out
    assert "differs from the one the run used (sha256)" in printed and "replay matches" in printed
    experiment.unlink()
    assert run.main(["replay", str(out), "--step", "2"]) == 0
    assert "replay matches the logged step 2" in capsys.readouterr().out
    loaded = run_folder.load_run(out)
    assert type(loaded.method).__module__ == "fvx_methods.finetune" and loaded.method.optim.lr == 3e-3
    assert type(loaded.models["student"]).__module__ == "fvx_models.wan" and loaded.vae is not None
    assert run.main(["export", str(out), "--out", str(tmp_path / "exported")]) == 0
